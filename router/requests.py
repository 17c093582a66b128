"""What every front end (gRPC, OpenAI HTTP) does with a request, whatever its wire format.

`RequestRunner.generate(msg)` takes a pdserve.v1.GenerateRequest and yields the
pipeline's GenerateResponse messages: it refuses new work while draining,
validates and tokenizes (RequestBuilder), keeps the request-id registry, runs the
pipeline in a producer task of its own so that `abort(request_id)` (or the
consumer going away) cancels it and the pipeline aborts the request on every
worker, and observes the request metrics. Every failure is one RequestFailed
carrying the gRPC status; each front maps that to its own wire format.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.protocol import finish_reason_name, generate_pb2
from engine.sampling_params import InvalidParameter
from router.metrics import RouterMetrics
from router.pipeline import GenerationPipeline, PipelineError
from router.request_builder import RequestBuilder

_END = object()
_ABORTED = object()


class RequestFailed(Exception):
    """A request refused or ended by an error."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field
        """For INVALID_ARGUMENT: the request field at fault (as RequestBuilder names it)."""
        self.retry_after_s = retry_after_s
        """For RESOURCE_EXHAUSTED: when to try again, if the pipeline said."""


class RequestRunner:
    def __init__(self, builder: RequestBuilder, pipeline: GenerationPipeline, metrics: RouterMetrics) -> None:
        self.builder = builder
        self.pipeline = pipeline
        self.metrics = metrics
        self.draining = False
        self._running: dict[str, asyncio.Task] = {}
        self._tokenize = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        """Validation and tokenizing run here: a long prompt never stalls the event loop."""

    @property
    def num_running(self) -> int:
        return len(self._running)

    def abort(self, request_id: str, tenant: str | None = None) -> bool:
        """Cancel a running request of `tenant`; False when it has none with that id (another
        tenant's request of that id is neither cancelled nor acknowledged)."""
        task = self._running.get((tenant, request_id))
        if task is not None:
            task.cancel()
        return task is not None

    async def generate(self, msg: generate_pb2.GenerateRequest, timeout_s: float | None = None,
                       max_tokens_to_context: bool = False,
                       routes: list | None = None,
                       tenant: str | None = None) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Yield the request's responses; raises RequestFailed. Closing or cancelling the
        consumer aborts the request on every worker. (`max_tokens_to_context`, `tenant`:
        RequestBuilder.build; `routes` receives (index, Route) per sample, as the pipeline's.)
        Request ids are per tenant: one tenant's ids neither collide with nor abort another's."""
        arrival = time.perf_counter()
        if self.draining:
            raise self._failed(grpc.StatusCode.UNAVAILABLE, "the router is draining")
        try:
            if msg.WhichOneof("input") in ("text", "chat") or msg.params.WhichOneof("structured_output"):
                # tokenizing, checking a grammar: off the event loop
                prepared = await asyncio.get_running_loop().run_in_executor(
                    self._tokenize, self.builder.build, msg, max_tokens_to_context, tenant)
            else:
                prepared = self.builder.build(msg, max_tokens_to_context, tenant)
        except InvalidParameter as exc:
            raise self._failed(grpc.StatusCode.INVALID_ARGUMENT, str(exc), field=exc.field) from None
        key = (tenant, prepared.request_id)
        if key in self._running:
            raise self._failed(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id: {prepared.request_id!r} is already running", field="request_id")
        self.metrics.arrivals.inc(prepared.params.n)
        items: asyncio.Queue = asyncio.Queue()
        producer = asyncio.create_task(self._produce(prepared, timeout_s, items, routes))
        self._running[key] = producer
        first_token_at = last_chunk_at = None
        num_tokens = 0
        try:
            while (item := await items.get()) is not _END:
                if item is _ABORTED:
                    self.metrics.cancelled.inc()
                    raise self._failed(grpc.StatusCode.CANCELLED, "aborted by an Abort call")
                if isinstance(item, PipelineError):
                    raise self._failed(item.code, str(item), retry_after_s=item.retry_after_s)
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
                        if last_chunk_at != first_token_at:  # the first gap holds the hand-off to decode
                            self.metrics.decode_itl.observe(now - last_chunk_at)
                    last_chunk_at = now
                    num_tokens += len(item.chunk.token_ids)
                    self.metrics.generation_tokens.inc(len(item.chunk.token_ids))
                yield item
            end = time.perf_counter()
            self.metrics.e2e.observe(end - arrival)
            if num_tokens > 1:
                self.metrics.tpot.observe((end - first_token_at) / (num_tokens - 1))
        except (asyncio.CancelledError, GeneratorExit):  # the client went away, or its deadline passed
            self.metrics.cancelled.inc()
            self.metrics.failures.labels(grpc.StatusCode.CANCELLED.name).inc()
            raise
        finally:
            producer.cancel()  # its pipeline aborts the request on every worker it touched
            self._running.pop(key, None)

    async def _produce(self, prepared, timeout_s, items: asyncio.Queue, routes: list | None) -> None:
        try:
            async for msg in self.pipeline.generate(prepared, timeout_s, routes):
                items.put_nowait(msg)
            items.put_nowait(_END)
        except asyncio.CancelledError:
            items.put_nowait(_ABORTED)
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
            items.put_nowait(exc)

    def _failed(self, code: grpc.StatusCode, message: str, **details) -> RequestFailed:
        self.metrics.failures.labels(code.name).inc()
        return RequestFailed(code, message, **details)
