"""A prefill worker that answers RESOURCE_EXHAUSTED (full: its last prompts' KV still waits to be pulled,
which the router's ledger does not see) is asked again after a short backoff; the caller sees the error
only when the worker stays full through every retry."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from common.protocol import generate_pb2, worker_pb2
from engine.sampling_params import SamplingParams
from router import pipeline as pipeline_module
from router.config import RouterConfig
from router.pipeline import GenerationPipeline, PipelineError
from router.request_builder import PreparedRequest
from tests.router.test_worker_selector import PROMPT, make


class _BusyThenDonePrefill:
    """Prefill answers RESOURCE_EXHAUSTED `busy` times, then a first token that ends the sample."""

    def __init__(self, busy: int) -> None:
        self.busy = busy
        self.calls = 0

    async def Prefill(self, request, timeout=None):  # noqa: N802 - the gRPC method's name
        self.calls += 1
        if self.calls <= self.busy:
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), details="the worker holds 1 requests (its limit)")
        return worker_pb2.PrefillResponse(first=generate_pb2.Chunk(token_ids=[9]), finished=True,
                                          finish_reason=generate_pb2.FINISH_REASON_STOP)

    async def Abort(self, request, timeout=None):  # noqa: N802
        return generate_pb2.AbortResponse(found=False)


def run(busy: int):
    async def scenario():
        pool, _, selector = make(prefill=("p1:1",), decode=("d1:1",), max_requests=8, skip=0)
        stub = pool.get("p1:1").stub = _BusyThenDonePrefill(busy)
        pipeline = GenerationPipeline(RouterConfig(), selector)
        request = PreparedRequest("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
        try:
            return [m async for m in pipeline.generate(request)], stub.calls
        finally:
            await pipeline.wait_background()
    return asyncio.run(scenario())


def test_a_full_prefill_worker_is_asked_again_and_the_request_completes(monkeypatch):
    monkeypatch.setattr(pipeline_module, "PREFILL_BUSY_BACKOFF_S", 0.001)
    messages, calls = run(busy=3)
    assert calls == 4
    assert [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids] == [9]
    assert messages[-1].complete.finish_reason == generate_pb2.FINISH_REASON_STOP


def test_a_worker_full_through_every_retry_is_resource_exhausted_for_the_caller(monkeypatch):
    monkeypatch.setattr(pipeline_module, "PREFILL_BUSY_BACKOFF_S", 0.001)
    with pytest.raises(PipelineError) as err:
        run(busy=pipeline_module.PREFILL_BUSY_RETRIES + 1)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
