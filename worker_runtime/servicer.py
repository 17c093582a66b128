"""The internal Worker gRPC service: Prefill, Decode, Abort, GetStats.

Thin: converts messages, admits or refuses, and waits on the engine thread.
A cancelled call (router gone, client cancel, deadline) aborts the request.
"""
from __future__ import annotations

import asyncio
import math

import grpc

from decode_worker.decode_loop import DecodeLoop, KVSource
from engine.sampling_params import InvalidParameter
from pdserve.cluster_auth import handles
from pdserve.protocol import (
    FINISH_REASONS,
    chunk_from_delta,
    generate_pb2,
    params_from_proto,
    worker_pb2,
    worker_pb2_grpc,
)
from prefill_worker.prefill_loop import PrefillLoop
from worker_runtime.config import WorkerConfig
from worker_runtime.errors import Draining, Overloaded, WorkerError


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, config: WorkerConfig, loop: PrefillLoop | DecodeLoop, address: str, backend: str) -> None:
        self.config = config
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
        if not isinstance(self.loop, PrefillLoop):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this is a decode worker")
        rid = request.request_id
        async with self._admitted(context):
            params = await self._params(request.params, context)
            lease_s = request.lease_s
            if not math.isfinite(lease_s) or lease_s < 0:
                await _abort_with(context, InvalidParameter("lease_s", "must be a finite number >= 0"))
            lease_s = min(lease_s or self.config.lease_s, self.config.lease_s)  # the worker's --lease-s caps it
            try:
                result = await self.loop.prefill(rid, list(request.prompt_token_ids), params, lease_s,
                                                 cache_salt=request.cache_salt)
            except asyncio.CancelledError:
                self.loop.abort(rid)
                raise
            except (InvalidParameter, WorkerError) as exc:
                await _abort_with(context, exc)
            first = result.first
            response = worker_pb2.PrefillResponse(first=chunk_from_delta(first), finished=first.finished,
                                                  cached_tokens=first.num_cached_tokens)
            if first.finished:
                response.finish_reason = FINISH_REASONS[first.finish_reason]
            else:
                response.kv.CopyFrom(worker_pb2.KVHandle(
                    peer_info_json=result.peer_info_json, transfer_id=result.transfer_id,
                    block_ids=result.block_ids, num_tokens=len(request.prompt_token_ids),
                    worker_address=self.address, capability=result.capability))
            return response

    async def Decode(self, request, context):
        if not isinstance(self.loop, DecodeLoop):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this is a prefill worker")
        rid = request.request_id
        async with self._admitted(context):
            params = await self._params(request.params, context)
            source = None
            resumed = list(request.resume_token_ids)
            if resumed and request.HasField("first_token_id"):
                await _abort_with(context, InvalidParameter("resume_token_ids", "cannot be set with first_token_id"))
            if request.HasField("first_token_id"):
                if self.handle_key is not None and not handles.verify(self.handle_key, request.kv,
                                                                      request.prompt_token_ids):
                    await _abort_with(context, InvalidParameter(
                        "kv", "the handle is not signed by a router of this cluster for this prompt"))
                try:
                    source = KVSource.from_handle(request.kv, request.first_token_id)
                except InvalidParameter as exc:
                    await _abort_with(context, exc)
            items: asyncio.Queue = asyncio.Queue()
            prompt = list(request.prompt_token_ids)
            try:
                await self.loop.decode(rid, prompt, params, source, items.put_nowait, cache_salt=request.cache_salt,
                                       resume_token_ids=resumed)
            except (InvalidParameter, WorkerError) as exc:
                await _abort_with(context, exc)
            num_tokens = 1 if source is not None else len(resumed)  # usage counts every generated token
            finished = False
            try:
                while True:
                    item = await items.get()
                    if isinstance(item, asyncio.CancelledError):
                        finished = True
                        await context.abort(grpc.StatusCode.CANCELLED, "aborted")
                    if isinstance(item, BaseException):
                        finished = True
                        await _abort_with(context, item)
                    num_tokens += len(item.token_ids)
                    if item.token_ids or item.text:
                        yield generate_pb2.GenerateResponse(request_id=rid, chunk=chunk_from_delta(item))
                    if item.finished:
                        finished = True
                        yield generate_pb2.GenerateResponse(request_id=rid, complete=generate_pb2.Complete(
                            finish_reason=FINISH_REASONS[item.finish_reason],
                            usage=generate_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=num_tokens,
                                                     cached_tokens=item.num_cached_tokens)))
                        return
            finally:
                if not finished:
                    self.loop.abort(rid)

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

    # ---- helpers --------------------------------------------------------------
    def _admitted(self, context):
        return _Admission(self, context)

    async def _params(self, msg, context):
        try:
            return params_from_proto(msg)
        except InvalidParameter as exc:
            await _abort_with(context, exc)


class _Admission:
    """Refuses work while draining or full; counts calls in flight for the drain."""

    def __init__(self, servicer: WorkerServicer, context) -> None:
        self.servicer = servicer
        self.context = context

    async def __aenter__(self) -> None:
        s = self.servicer
        if s.draining:
            await _abort_with(self.context, Draining("the worker is draining"))
        if s.loop.stats.get("num_requests", 0) >= s.config.max_num_requests:
            await _abort_with(self.context, Overloaded(
                f"the worker holds {s.config.max_num_requests} requests (its limit)"))
        s.in_flight += 1

    async def __aexit__(self, *exc) -> None:
        self.servicer.in_flight -= 1


async def _abort_with(context, exc: BaseException) -> None:
    if isinstance(exc, InvalidParameter):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    code = exc.code if isinstance(exc, WorkerError) else grpc.StatusCode.INTERNAL
    await context.abort(code, str(exc))
