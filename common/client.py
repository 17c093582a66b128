"""A gRPC client of the Generation service, and `pdserve generate --url`.

`generate_one` and `collect_samples` are the library surface (demo,
benchmarks, tests); `run_generate_url` is the CLI: every line of the input
file is sent at once as its own request, results written in input order.
"""
from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field

import grpc

from common.client_channel import api_key, client_channel
from common.jsonl_requests import LineError, LineRequest, read_requests, result_line
from common.protocol import (
    finish_reason_name,
    generate_pb2,
    generate_pb2_grpc,
    logprobs_from_chunk,
    params_to_proto,
    usage_from_proto,
)
from engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str = ""
    usage: dict = field(default_factory=dict)
    prompt_logprobs: list[dict] | None = None
    """With prompt_logprobs asked for: an entry per prompt token after the first."""


def build_request(request_id: str, params: SamplingParams, prompt: str | None = None,
                  token_ids: list[int] | None = None, messages: list[dict] | None = None):
    msg = generate_pb2.GenerateRequest(request_id=request_id, params=params_to_proto(params))
    if prompt is not None:
        msg.text = prompt
    elif token_ids is not None:
        msg.tokens.ids.extend(token_ids)
    else:
        msg.chat.messages.extend(generate_pb2.ChatMessage(role=m["role"], content=m["content"])
                                 for m in messages or [])
    return msg


async def generate_one(stub, request, on_chunk=None, timeout: float | None = None) -> list[SampleResult]:
    """Run one Generate call to its end; `on_chunk(index, chunk)` sees each chunk as it arrives.

    Raises grpc.aio.AioRpcError on a failed call."""
    return await collect_samples(stub.Generate(request, timeout=timeout), on_chunk)


async def collect_samples(responses, on_chunk=None) -> list[SampleResult]:
    """Gather a stream of GenerateResponse messages into one SampleResult per index."""
    samples: dict[int, SampleResult] = {}
    async for msg in responses:
        sample = samples.setdefault(msg.index, SampleResult(msg.index))
        if msg.HasField("chunk"):
            sample.token_ids.extend(msg.chunk.token_ids)
            sample.text += msg.chunk.text
            sample.logprobs.extend(logprobs_from_chunk(msg.chunk))
            if msg.chunk.prompt_logprobs:
                sample.prompt_logprobs = logprobs_from_chunk(msg.chunk, prompt=True)
            if on_chunk is not None:
                on_chunk(msg.index, msg.chunk)
        else:
            sample.finish_reason = finish_reason_name(msg.complete.finish_reason)
            sample.usage = usage_from_proto(msg.complete.usage)
    return [samples[i] for i in sorted(samples)]


def run_generate_url(args) -> int:
    return asyncio.run(_generate_file(args.url, args.input, args.output, args.stream, args.timeout,
                                      args.tls_ca, api_key(args.api_key_file)))


async def _generate_file(url: str, input_path: str, output_path: str, stream: bool, timeout: float | None,
                         tls_ca_file: str | None = None, key: str | None = None) -> int:
    requests, errors = read_requests(input_path)
    async with client_channel(url, tls_ca_file, key) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        outcomes = await asyncio.gather(*(_one(stub, r, stream, timeout) for r in requests))
    with open(output_path, "w", encoding="utf-8") as out:
        for request, outcome in zip(requests, outcomes, strict=True):
            if isinstance(outcome, LineError):
                errors.append(outcome)
                continue
            for s in outcome:
                logprobs = s.logprobs if request.params.logprobs is not None else None
                out.write(result_line(request.request_id, s.index if request.params.n > 1 else None, s.token_ids,
                                      s.text, s.finish_reason, s.usage, logprobs, s.prompt_logprobs) + "\n")
    for error in sorted(errors, key=lambda e: e.line_no):
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0


async def _one(stub, request: LineRequest, stream: bool, timeout: float | None):
    msg = build_request(request.request_id, request.params, request.prompt, request.token_ids, request.messages)

    def show(index: int, chunk) -> None:
        print(json.dumps({"id": request.request_id, "index": index, "token_ids": list(chunk.token_ids),
                          "text": chunk.text}, ensure_ascii=False), flush=True)

    try:
        return await generate_one(stub, msg, show if stream else None, timeout)
    except grpc.aio.AioRpcError as exc:
        details = exc.details() or ""
        field_name, _, message = details.partition(": ")
        if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or not message:
            field_name, message = "<request>", f"{exc.code().name}: {details}"
        return LineError(request.line_no, field_name, message)
