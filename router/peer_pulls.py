"""The router's half of a peer prefix pull: lease the prefix on the worker holding it, hand the handle on.

When the routing policy plans a pull (`PrefillPick.pull`: the chosen prefill worker lacks leading blocks
another worker holds, and moving them is cheaper than computing them; or `Route.pull`, the same for a
decode worker computing the prompt itself), `lease` asks the holder to hold those blocks (`LeasePrefix`)
and puts its answer, signed with the cluster's handle key over the prefix's tokens, into the Prefill (or
Decode) request as `prefix_kv`. The chosen worker pulls them before it computes the rest
(worker_runtime/prefix_pulls.py). Anything short of a lease (the holder gone, slow, no longer
holding the blocks) leaves the request as it was: the worker computes the prefix. The lease's id joins
the sample's touched list, so a sample that fails frees it on the holder at once.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from common.cluster_auth import handles
from common.protocol import generate_pb2, worker_pb2
from router.worker_pool import WorkerPool

logger = logging.getLogger(__name__)
LEASE_CALL_S = 2.0
"""Longest wait for a holder's LeasePrefix answer (or 4x its learnt latency, if longer): it answers between two
of its engine steps, so a busy holder answers within a step."""
ABORT_S = 5.0
LEASE_ALPHA = 0.3
"""Weight of the newest call in a holder's learnt lease latency (`WorkerClient.lease_s`)."""
PEER_LEASE_S = 10.0
"""How long the holder keeps the blocks for the pull (the puller starts it on arrival, within its
--peer-pull-timeout-s)."""


class PeerPulls:
    def __init__(self, pool: WorkerPool, metrics=None) -> None:
        self.pool = pool
        self.metrics = metrics
        self.handle_key: bytes | None = None
        self._aborts: set[asyncio.Task] = set()

    async def lease(self, sample_id: str, prompt: list[int], pick, request, touched: list, block_size: int,
                    attempt: int = 0) -> int:
        """Lease `pick.pull` (a PrefillPick's or a Route's) for `request` (a PrefillRequest or DecodeRequest:
        sets its `prefix_kv`); returns the prompt blocks the chosen worker will hold once it has pulled them
        (0: no pull, it computes them)."""
        if pick.pull is None:
            return 0
        holder = self.pool.get(pick.pull.holder)
        if holder is None or not holder.healthy:
            return self._outcome("holder_gone")
        lease_id = f"{sample_id}~pull{attempt}"
        call = worker_pb2.PrefixLeaseRequest(lease_id=lease_id, token_ids=prompt[:pick.pull.blocks * block_size],
                                             cache_salt=request.cache_salt, lease_s=PEER_LEASE_S)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            answer = await holder.stub.LeasePrefix(call, timeout=max(LEASE_CALL_S, 4 * holder.lease_s))
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else "timeout"
            logger.info("%s: no prefix lease from %s (%s); computing the prefix", sample_id, holder.address, detail)
            self._abort_later(holder, lease_id)  # it may still grant the lease after we stopped waiting
            return self._outcome("lease_failed")
        finally:  # a timed-out call teaches it too: a holder that slow is not asked to lease again soon
            holder.lease_s += LEASE_ALPHA * (loop.time() - started - holder.lease_s)
        if not answer.num_tokens:
            return self._outcome("nothing_held")  # evicted since its last event reached us
        touched.append((holder, lease_id))
        if self.handle_key is not None:
            handles.sign(self.handle_key, answer.kv, prompt[:answer.kv.num_tokens])
        request.prefix_kv.CopyFrom(answer.kv)
        self._outcome("leased")
        return answer.num_tokens // block_size

    def _abort_later(self, holder, lease_id: str) -> None:
        async def abort() -> None:
            try:
                await holder.stub.Abort(generate_pb2.AbortRequest(request_id=lease_id), timeout=ABORT_S)
            except grpc.aio.AioRpcError:
                pass  # the lease expires on its own
        task = asyncio.get_running_loop().create_task(abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def _outcome(self, outcome: str) -> int:
        if self.metrics is not None:
            self.metrics.peer_pulls.labels(outcome).inc()
        return 0
