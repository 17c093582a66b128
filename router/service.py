"""The public pdserve.v1.Generation service on top of the pipeline."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine.sampling_params import InvalidParameter
from pdserve.protocol import finish_reason_name, generate_pb2, generate_pb2_grpc
from router.metrics import RouterMetrics
from router.pipeline import GenerationPipeline, PipelineError
from router.request_builder import RequestBuilder

logger = logging.getLogger(__name__)


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
        self._running[prepared.request_id] = asyncio.current_task()
        first_token_seen = False
        try:
            async for msg in self.pipeline.generate(prepared, context.time_remaining()):
                if msg.HasField("chunk"):
                    if not first_token_seen and msg.chunk.token_ids:
                        first_token_seen = True
                        self.metrics.ttft.observe(time.perf_counter() - arrival)
                    self.metrics.generation_tokens.inc(len(msg.chunk.token_ids))
                else:
                    self.metrics.success.labels(finish_reason_name(msg.complete.finish_reason)).inc()
                    self.metrics.prompt_tokens.inc(msg.complete.usage.prompt_tokens)
                yield msg
            self.metrics.e2e.observe(time.perf_counter() - arrival)
        except PipelineError as exc:
            await self._fail(context, exc.code, str(exc))
        except asyncio.CancelledError:
            self.metrics.failures.labels(grpc.StatusCode.CANCELLED.name).inc()
            raise
        finally:
            self._running.pop(prepared.request_id, None)

    async def Abort(self, request, context):
        task = self._running.get(request.request_id)
        if task is not None:
            task.cancel()
        return generate_pb2.AbortResponse(found=task is not None)

    async def _fail(self, context, code: grpc.StatusCode, message: str) -> None:
        self.metrics.failures.labels(code.name).inc()
        await context.abort(code, message)
