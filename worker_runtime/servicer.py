"""The internal Worker gRPC service: Prefill, Decode, LeasePrefix, Abort, GetStats, the KV event feed.

Thin: converts messages, admits or refuses, and waits on the engine thread. Prefill and Decode are the
role's (worker_runtime/role.py); the rest is every worker's. A cancelled call (router gone, client
cancel, deadline) aborts the request.
"""
from __future__ import annotations

import asyncio

import grpc

from common.protocol import generate_pb2, params_from_proto, worker_pb2, worker_pb2_grpc
from engine.sampling_params import InvalidParameter
from worker_runtime.config import WorkerConfig
from worker_runtime.engine_loop import EngineLoop
from worker_runtime.errors import Draining, Overloaded, WorkerError
from worker_runtime.kv_handle import MAX_TRANSFER_ID_CHARS, peer_to_proto
from worker_runtime.kv_leases import lease_seconds
from worker_runtime.role import WorkerRole


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, config: WorkerConfig, role: WorkerRole, loop: EngineLoop, address: str,
                 backend: str) -> None:
        self.config = config
        self.role = role
        """What this worker serves (Prefill or Decode): prefill_worker/role.py or decode_worker/role.py."""
        self.loop = loop
        self.address = address
        self.backend = backend
        self.kv_block_bytes = 0
        """Bytes of one block on the wire (kv_transfer's layout)."""
        self.draining = False
        self.in_flight = 0
        self.handle_key: bytes | None = None
        """Decode: the cluster's handle key; with it, only router-signed KV handles are accepted."""

    # ---- RPCs -----------------------------------------------------------------
    async def Prefill(self, request, context):
        return await self.role.prefill(self, request, context)

    async def Decode(self, request, context):
        async for response in self.role.decode(self, request, context):
            yield response

    async def LeasePrefix(self, request, context):
        """Hold a cached prefix for a peer's pull (worker_runtime/kv_leases.py); every role serves it."""
        async with self.admitted(context):
            try:
                lease_s = lease_seconds(request.lease_s, self.config.lease_s)
                if not 0 < len(request.lease_id) <= MAX_TRANSFER_ID_CHARS:
                    raise InvalidParameter("lease_id", f"must have 1 to {MAX_TRANSFER_ID_CHARS} characters")
                lease = await self.loop.lease_prefix(request.lease_id, list(request.token_ids), request.cache_salt,
                                                     lease_s)
            except InvalidParameter as exc:
                await abort_with(context, exc)
        if lease is None:
            return worker_pb2.PrefixLeaseResponse(num_tokens=0)
        num_tokens = len(lease.block_ids) * self.config.engine.cache.block_size
        return worker_pb2.PrefixLeaseResponse(num_tokens=num_tokens, kv=worker_pb2.KVHandle(
            peer=peer_to_proto(lease.peer_info), transfer_id=lease.transfer_id, block_ids=lease.block_ids,
            num_tokens=num_tokens, worker_address=self.address, capability=lease.capability))

    async def Abort(self, request, context):
        found = await self.loop.abort(request.request_id)
        return generate_pb2.AbortResponse(found=bool(found))

    async def GetStats(self, request, context):
        stats = dict(self.loop.stats)
        fields = set(worker_pb2.WorkerStats.DESCRIPTOR.fields_by_name)
        return worker_pb2.WorkerStats(role=self.config.role, kv_transfer_backend=self.backend, draining=self.draining,
                                      max_num_requests=self.config.max_num_requests,
                                      block_size=self.config.engine.cache.block_size,
                                      kv_block_bytes=self.kv_block_bytes,
                                      **{k: v for k, v in stats.items() if k in fields})

    async def SubscribeKvEvents(self, request, context):
        log = self.loop.kv_events
        queue = log.subscribe()
        try:
            snapshot = await self.loop.call(log.snapshot_now)
            yield snapshot
            while (batch := await queue.get()) is not None:
                if batch.seq > snapshot.seq:
                    yield batch
        finally:
            log.unsubscribe(queue)

    async def GetKvSnapshot(self, request, context):
        return await self.loop.call(self.loop.kv_events.snapshot_now)

    # ---- what the roles' RPCs share --------------------------------------------
    def admitted(self, context) -> _Admission:
        """`async with`: refuse the call while draining or full; count it in flight for the drain."""
        return _Admission(self, context)

    async def params(self, msg, context):
        """The call's sampling parameters, or the call aborted with INVALID_ARGUMENT naming the field."""
        try:
            params = params_from_proto(msg)
            if params.structured_output is not None:  # compiled before the engine thread sees the request
                await self._compile(params.structured_output)
            return params
        except InvalidParameter as exc:
            await abort_with(context, exc)

    async def _compile(self, spec) -> None:
        """Wait for a constraint to compile (on the engine's compile thread, cached), within the time limit."""
        future = self.loop.engine.grammars.compile_future(spec)
        timeout_s = self.config.grammar_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except TimeoutError:
            raise InvalidParameter(spec.field, f"compiling took longer than {timeout_s:g}s") from None


class _Admission:
    """Refuses work while draining or full; counts calls in flight for the drain."""

    def __init__(self, servicer: WorkerServicer, context) -> None:
        self.servicer = servicer
        self.context = context

    async def __aenter__(self) -> None:
        s = self.servicer
        if s.draining:
            await abort_with(self.context, Draining("the worker is draining"))
        if s.loop.stats.get("num_requests", 0) >= s.config.max_num_requests:
            await abort_with(self.context, Overloaded(
                f"the worker holds {s.config.max_num_requests} requests (its limit)"))
        s.in_flight += 1

    async def __aexit__(self, *exc) -> None:
        self.servicer.in_flight -= 1


async def abort_with(context, exc: BaseException) -> None:
    """End the call with the status `exc` maps to: INVALID_ARGUMENT naming the field, a WorkerError's code
    (RESOURCE_EXHAUSTED, UNAVAILABLE), else INTERNAL."""
    if isinstance(exc, InvalidParameter):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    code = exc.code if isinstance(exc, WorkerError) else grpc.StatusCode.INTERNAL
    await context.abort(code, str(exc))
