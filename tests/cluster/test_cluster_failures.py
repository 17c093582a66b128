"""Every way a request can end badly leaves every worker with no blocks and no requests."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from common.grpc_common import insecure_channel
from common.protocol import generate_pb2, generate_pb2_grpc
from tests.cluster.harness import assert_no_leaks, generation_stub


def everyone(workers) -> list:
    return workers["prefill"] + workers["decode"]


def long_request(request_id: str, max_tokens: int = 400) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(request_id=request_id, text="Tell me everything about the history of Rome.",
                                        params=generate_pb2.SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                           ignore_eos=True))


def P(**kw) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(**kw)


INVALID = [
    ("no input", generate_pb2.GenerateRequest(), "input"),
    ("empty text", generate_pb2.GenerateRequest(text=""), "text"),
    ("empty token ids", generate_pb2.GenerateRequest(tokens=generate_pb2.TokenIds(ids=[])), "tokens.ids"),
    ("unknown token id", generate_pb2.GenerateRequest(tokens=generate_pb2.TokenIds(ids=[1, 49152])), "tokens.ids"),
    ("negative token id", generate_pb2.GenerateRequest(tokens=generate_pb2.TokenIds(ids=[-1])), "tokens.ids"),
    ("prompt longer than the context",
     generate_pb2.GenerateRequest(tokens=generate_pb2.TokenIds(ids=[1] * 9000)), "input"),
    ("no chat messages", generate_pb2.GenerateRequest(chat=generate_pb2.Chat()), "chat.messages"),
    ("max_tokens 0", generate_pb2.GenerateRequest(text="hi", params=P(max_tokens=0)), "params.max_tokens"),
    ("max_tokens past the context",
     generate_pb2.GenerateRequest(text="hi", params=P(max_tokens=100000)), "params.max_tokens"),
    ("negative temperature", generate_pb2.GenerateRequest(text="hi", params=P(temperature=-1)), "params.temperature"),
    ("top_p 0", generate_pb2.GenerateRequest(text="hi", params=P(top_p=0)), "params.top_p"),
    ("top_p above 1", generate_pb2.GenerateRequest(text="hi", params=P(top_p=1.5)), "params.top_p"),
    ("top_k -2", generate_pb2.GenerateRequest(text="hi", params=P(top_k=-2)), "params.top_k"),
    ("too many stop strings",
     generate_pb2.GenerateRequest(text="hi", params=P(stop=[f"s{i}" for i in range(17)])), "params.stop"),
    ("empty stop string", generate_pb2.GenerateRequest(text="hi", params=P(stop=[""])), "params.stop"),
    ("min_tokens above max_tokens",
     generate_pb2.GenerateRequest(text="hi", params=P(max_tokens=4, min_tokens=5)), "params.min_tokens"),
    ("logprobs 21", generate_pb2.GenerateRequest(text="hi", params=P(logprobs=21)), "params.logprobs"),
    ("n 0", generate_pb2.GenerateRequest(text="hi", params=P(n=0)), "params.n"),
    ("stop token id outside the vocabulary",
     generate_pb2.GenerateRequest(text="hi", params=P(stop_token_ids=[10 ** 9])), "params.stop_token_ids"),
]


@pytest.mark.parametrize("name,request_msg,field", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_input_is_refused_naming_the_field(name, request_msg, field, router_1p1d):
    with pytest.raises(grpc.RpcError) as info:
        list(generation_stub(router_1p1d.address).Generate(request_msg, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith(field + ":"), info.value.details()


def test_invalid_inputs_leave_nothing_behind(router_1p1d, workers):
    stub = generation_stub(router_1p1d.address)
    for _, request_msg, _ in INVALID:
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(request_msg, timeout=30))
    for w in everyone(workers):
        assert w.popen.poll() is None
    assert_no_leaks(everyone(workers))


def test_cancel_mid_stream_frees_everything(router_2p2d, workers):
    call = generation_stub(router_2p2d.address).Generate(long_request("cancel-me"), timeout=120)
    chunks = 0
    for msg in call:
        chunks += msg.HasField("chunk")
        if chunks == 3:
            call.cancel()
            break
    assert call.code() == grpc.StatusCode.CANCELLED
    assert_no_leaks(everyone(workers))


def test_deadline_exceeded_aborts_on_both_workers(router_1p1d, workers):
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for msg in generation_stub(router_1p1d.address).Generate(long_request("too-slow"), timeout=1.5):
            received.append(msg)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert received, "the first tokens should have streamed before the deadline"
    assert_no_leaks(everyone(workers))


def test_abort_rpc_ends_a_running_request(router_1p1d, workers):
    stub = generation_stub(router_1p1d.address)
    call = stub.Generate(long_request("abort-me"), timeout=120)
    next(call)  # running
    assert stub.Abort(generate_pb2.AbortRequest(request_id="abort-me"), timeout=10).found
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert not stub.Abort(generate_pb2.AbortRequest(request_id="abort-me"), timeout=10).found
    assert_no_leaks(everyone(workers))


def test_200_concurrent_requests_with_random_cancellations(router_2p2d, workers):
    rng = random.Random(0)
    words = "alpha beta gamma delta river mountain city engine token block cache prefill decode".split()
    plans = [(f"r{i}", " ".join(rng.choices(words, k=rng.randint(3, 60))), rng.randint(2, 24),
              rng.random() < 0.3, rng.uniform(0.0, 2.0)) for i in range(200)]

    async def run_all():
        async with insecure_channel(router_2p2d.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)

            async def one(rid, text, max_tokens, cancel, delay):
                call = stub.Generate(generate_pb2.GenerateRequest(
                    request_id=rid, text=text, params=generate_pb2.SamplingParams(
                        temperature=0.7, seed=1, max_tokens=max_tokens, ignore_eos=True)), timeout=300)
                if cancel:
                    asyncio.get_running_loop().call_later(delay, call.cancel)
                tokens, reason = 0, None
                try:
                    async for msg in call:
                        if msg.HasField("chunk"):
                            tokens += len(msg.chunk.token_ids)
                        else:
                            reason = msg.complete.finish_reason
                except asyncio.CancelledError:
                    return rid, "cancelled", tokens
                except grpc.aio.AioRpcError as exc:
                    return rid, exc.code().name, tokens
                return rid, reason, tokens

            return await asyncio.gather(*(one(*p) for p in plans))

    results = {rid: (outcome, tokens) for rid, outcome, tokens in asyncio.run(run_all())}
    for rid, _, max_tokens, cancel, _ in plans:
        outcome, tokens = results[rid]
        if cancel and outcome in ("cancelled", "CANCELLED"):
            continue
        assert outcome == generate_pb2.FINISH_REASON_LENGTH, (rid, outcome)
        assert tokens == max_tokens, rid
    assert sum(1 for rid, *_ in plans if results[rid][0] in ("cancelled", "CANCELLED")) > 20
    assert_no_leaks(everyone(workers), timeout=60)
