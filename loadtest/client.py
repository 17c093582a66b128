"""One timed Generate stream per request, over a shared gRPC channel."""
from __future__ import annotations

import time

import grpc

from common.client import build_request
from engine.sampling_params import SamplingParams
from loadtest.datasets import Prompt
from loadtest.stats import RequestRecord


def make_request(request_id: str, prompt: Prompt):
    """Greedy, ignore_eos, max_tokens = the prompt's output length, so outputs have exact lengths."""
    params = SamplingParams(temperature=0.0, max_tokens=prompt.output_len, ignore_eos=True)
    return build_request(request_id, params, prompt=prompt.text, token_ids=prompt.token_ids)


async def send(stub, index: int, request, prompt_len: int, timeout_s: float | None) -> RequestRecord:
    """Stream one request to its end; failures become the record's status, never an exception."""
    record = RequestRecord(index=index, prompt_len=prompt_len)
    record.send_time = time.perf_counter()
    try:
        async for msg in stub.Generate(request, timeout=timeout_s):
            now = time.perf_counter()
            if msg.HasField("chunk"):
                if msg.chunk.token_ids:
                    record.chunk_times.append(now)
                    record.output_tokens += len(msg.chunk.token_ids)
            elif msg.HasField("complete"):
                usage = msg.complete.usage
                record.prompt_len = usage.prompt_tokens or record.prompt_len
                record.cached_tokens = usage.cached_tokens
    except grpc.aio.AioRpcError as exc:
        record.status, record.error = exc.code().name, exc.details() or ""
    record.end_time = time.perf_counter()
    if record.ok and not record.chunk_times:
        record.status, record.error = "NO_OUTPUT", "the stream ended without a token"
    return record
