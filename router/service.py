"""The public pdserve.v1.Generation service on top of the pipeline."""
from __future__ import annotations

import asyncio
import time

import grpc

from engine.sampling_params import InvalidParameter
from pdserve.protocol import finish_reason_name, generate_pb2, generate_pb2_grpc
from router.metrics import RouterMetrics
from router.pipeline import GenerationPipeline, PipelineError
from router.request_builder import RequestBuilder

_END = object()
_ABORTED = object()


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, builder: RequestBuilder, pipeline: GenerationPipeline, metrics: RouterMetrics) -> None:
        self.builder = builder
        self.pipeline = pipeline
        self.metrics = metrics
        self.draining = False
        self._running: dict[str, asyncio.Task] = {}

    @property
    def num_running(self) -> int:
        return len(self._running)

    async def Generate(self, request, context):
        arrival = time.perf_counter()
        if self.draining:
            await self._fail(context, grpc.StatusCode.UNAVAILABLE, "the router is draining")
        try:
            prepared = self.builder.build(request)
        except InvalidParameter as exc:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if prepared.request_id in self._running:
            await self._fail(context, grpc.StatusCode.ALREADY_EXISTS,
                             f"request_id: {prepared.request_id!r} is already running")
        # The pipeline runs in a task of our own so that Abort (from another call) can cancel it.
        items: asyncio.Queue = asyncio.Queue()
        routes: list = []
        producer = asyncio.create_task(self._produce(prepared, context.time_remaining(), items, routes))
        self._running[prepared.request_id] = producer
        first_token_at = last_chunk_at = None
        num_tokens = 0
        try:
            while (item := await items.get()) is not _END:
                if item is _ABORTED:
                    self.metrics.cancelled.inc()
                    await self._fail(context, grpc.StatusCode.CANCELLED, "aborted by an Abort call")
                if isinstance(item, PipelineError):
                    await self._fail(context, item.code, str(item), item.retry_after_s)
                if isinstance(item, BaseException):
                    raise item
                if item.HasField("complete"):
                    self.metrics.success.labels(finish_reason_name(item.complete.finish_reason)).inc()
                    self.metrics.prompt_tokens.inc(item.complete.usage.prompt_tokens)
                elif item.chunk.token_ids:
                    now = time.perf_counter()
                    if first_token_at is None:
                        first_token_at = now
                        self.metrics.ttft.observe(now - arrival)
                    else:
                        self.metrics.itl.observe(now - last_chunk_at)
                    last_chunk_at = now
                    num_tokens += len(item.chunk.token_ids)
                    self.metrics.generation_tokens.inc(len(item.chunk.token_ids))
                yield item
            end = time.perf_counter()
            self.metrics.e2e.observe(end - arrival)
            if num_tokens > 1:
                self.metrics.tpot.observe((end - first_token_at) / (num_tokens - 1))
            context.set_trailing_metadata(route_metadata(routes))
        except asyncio.CancelledError:  # the client cancelled or its deadline passed
            self.metrics.cancelled.inc()
            self.metrics.failures.labels(grpc.StatusCode.CANCELLED.name).inc()
            raise
        finally:
            producer.cancel()  # its pipeline aborts the request on every worker it touched
            self._running.pop(prepared.request_id, None)

    async def _produce(self, prepared, timeout_s, items: asyncio.Queue, routes: list) -> None:
        try:
            async for msg in self.pipeline.generate(prepared, timeout_s, routes):
                items.put_nowait(msg)
            items.put_nowait(_END)
        except asyncio.CancelledError:
            items.put_nowait(_ABORTED)
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised in the handler
            items.put_nowait(exc)

    async def Abort(self, request, context):
        task = self._running.get(request.request_id)
        if task is not None:
            task.cancel()
        return generate_pb2.AbortResponse(found=task is not None)

    async def _fail(self, context, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        self.metrics.failures.labels(code.name).inc()
        if retry_after_s is not None:
            context.set_trailing_metadata(retry_metadata(code, message, retry_after_s))
        await context.abort(code, message)


def route_metadata(routes) -> tuple:
    """Trailing metadata naming the workers of each sample, in index order ("-": none)."""
    ordered = sorted(routes, key=lambda item: item[0])
    return tuple([("pdserve-prefill-worker", route.prefill.address if route.prefill else "-")
                  for _, route in ordered]
                 + [("pdserve-decode-worker", route.decode.address) for _, route in ordered])


def retry_metadata(code: grpc.StatusCode, message: str, retry_after_s: float) -> tuple:
    """google.rpc.RetryInfo in the status details (what gRPC clients read), plus a plain hint."""
    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import error_details_pb2, status_pb2
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
        seconds=int(retry_after_s), nanos=int(retry_after_s % 1 * 1e9))))
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return (("grpc-status-details-bin", status.SerializeToString()), ("retry-after-s", f"{retry_after_s:g}"))
