"""The worker's gRPC servicer and the roles' RPCs, driven directly with fakes: no process, no engine, no Ray.

A fake engine-thread loop stands in for PrefillLoop / DecodeLoop (same asyncio-facing methods), a fake
context records how a call was aborted. What is checked: the role's RPC answers or refuses with the right
status, admission (draining, full) refuses before the loop is touched, and a call that ends early aborts
its request on the loop.
"""
import asyncio

import grpc
import pytest

from common.protocol import generate_pb2, worker_pb2
from decode_worker.role import DecodeRole
from engine.outputs import SampleDelta
from prefill_worker.prefill_loop import PrefillResult
from prefill_worker.role import PrefillRole
from worker_runtime.config import WorkerConfig
from worker_runtime.kv_handle import peer_to_proto
from worker_runtime.kv_leases import PrefixLease
from worker_runtime.servicer import WorkerServicer

PEER = {"backend": "tcp", "modes": ["tcp"], "host": "127.0.0.1", "port": 7100, "instance_id": "i1",
        "protocol_version": 1, "compat_hash": "abc", "tls": False}


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class FakeContext:
    async def abort(self, code, details):
        raise Aborted(code, details)


class FakeLoop:
    """The asyncio-facing half of an engine loop; `script` is what a decode call streams."""

    def __init__(self, script=()):
        self.stats = {"num_requests": 0}
        self.script = list(script)
        self.aborted: list[str] = []
        self.calls: list[tuple] = []

    async def prefill(self, rid, prompt, params, lease_s, cache_salt="", prefix=None, prefix_tokens=0):
        self.calls.append(("prefill", rid, lease_s) + ((prefix, prefix_tokens) if prefix is not None else ()))
        return PrefillResult(SampleDelta(rid, 0, [42], "x", num_cached_tokens=16), PEER, "t-" + rid, [3, 4], "cap")

    async def lease_prefix(self, lease_id, token_ids, cache_salt, lease_s):
        self.calls.append(("lease", lease_id, len(token_ids), cache_salt, lease_s))
        return PrefixLease(PEER, lease_id, [7, 8], "cap") if token_ids[0] != 0 else None

    async def decode(self, rid, prompt, params, source, sink, cache_salt="", resume_token_ids=(), prefix=None,
                     prefix_tokens=0):
        self.calls.append(("decode", rid, source) + ((prefix, prefix_tokens) if prefix else ()))
        for item in self.script:
            asyncio.get_running_loop().call_soon(sink, item)

    def abort(self, rid):
        self.aborted.append(rid)
        future = asyncio.get_running_loop().create_future()
        future.set_result(True)
        return future


def servicer(role, loop, **config) -> WorkerServicer:
    return WorkerServicer(WorkerConfig(role=role.name, **config), role, loop, "10.0.0.1:7000", "tcp")


def params(**fields):
    return generate_pb2.SamplingParams(max_tokens=8, **fields)


def prefill_request(**fields):
    return worker_pb2.PrefillRequest(**({"request_id": "r1", "prompt_token_ids": [1, 2, 3], "params": params()}
                                        | fields))


def run(coro):
    return asyncio.run(coro)


def test_prefill_answers_the_first_token_and_a_typed_handle():
    loop = FakeLoop()
    response = run(servicer(PrefillRole(), loop, lease_s=30.0).Prefill(prefill_request(lease_s=99.0),
                                                                       FakeContext()))
    assert list(response.first.token_ids) == [42] and response.cached_tokens == 16 and not response.finished
    assert response.kv.peer == peer_to_proto(PEER) and list(response.kv.block_ids) == [3, 4]
    assert (response.kv.transfer_id, response.kv.capability, response.kv.worker_address) == (
        "t-r1", "cap", "10.0.0.1:7000")
    assert loop.calls == [("prefill", "r1", 30.0)]  # the caller's lease is capped at the worker's


@pytest.mark.parametrize(("role", "method"), [(PrefillRole(), "Decode"), (DecodeRole(), "Prefill")])
def test_a_role_refuses_the_other_roles_rpc(role, method):
    service = servicer(role, FakeLoop())

    async def call():
        if method == "Prefill":
            return await service.Prefill(prefill_request(), FakeContext())
        return [r async for r in service.Decode(worker_pb2.DecodeRequest(request_id="r"), FakeContext())]

    with pytest.raises(Aborted) as caught:
        run(call())
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(("setup", "code"), [("draining", grpc.StatusCode.UNAVAILABLE),
                                             ("full", grpc.StatusCode.RESOURCE_EXHAUSTED),
                                             ("bad lease", grpc.StatusCode.INVALID_ARGUMENT),
                                             ("bad params", grpc.StatusCode.INVALID_ARGUMENT)])
def test_prefill_refusals_never_reach_the_loop(setup, code):
    loop = FakeLoop()
    service = servicer(PrefillRole(), loop, max_num_requests=4)
    request = prefill_request()
    if setup == "draining":
        service.draining = True
    elif setup == "full":
        loop.stats["num_requests"] = 4
    elif setup == "bad lease":
        request.lease_s = float("nan")
    else:
        request.params.temperature = -1.0
    with pytest.raises(Aborted) as caught:
        run(service.Prefill(request, FakeContext()))
    assert caught.value.code == code
    assert loop.calls == [] and service.in_flight == 0


def decode_request(**fields):
    kv = worker_pb2.KVHandle(peer=peer_to_proto(PEER), transfer_id="t", block_ids=[5, 6], num_tokens=3)
    return worker_pb2.DecodeRequest(**({"request_id": "d1", "prompt_token_ids": [1, 2, 3], "params": params(),
                                        "first_token_id": 9, "kv": kv} | fields))


def test_decode_streams_chunks_then_the_completion_with_usage():
    script = [SampleDelta("d1", 0, [11], "a"), SampleDelta("d1", 0, [12, 13], "bc", finished=True,
                                                           finish_reason="length", num_cached_tokens=2)]
    loop = FakeLoop(script)

    async def call():
        return [r async for r in servicer(DecodeRole(), loop).Decode(decode_request(), FakeContext())]

    responses = run(call())
    assert [list(r.chunk.token_ids) for r in responses[:2]] == [[11], [12, 13]]
    complete = responses[2].complete
    assert complete.usage.completion_tokens == 4  # the first token from prefill, then three here
    assert (complete.usage.prompt_tokens, complete.usage.cached_tokens) == (3, 2)
    source = loop.calls[0][2]
    assert source.peer_info == PEER and source.block_ids == [5, 6] and source.first_token_id == 9
    assert loop.aborted == []


def test_a_decode_stream_the_caller_leaves_aborts_its_request():
    loop = FakeLoop([SampleDelta("d1", 0, [11], "a")])

    async def call():
        stream = servicer(DecodeRole(), loop).Decode(decode_request(), FakeContext())
        first = await stream.__anext__()
        await stream.aclose()  # the caller went away after one chunk
        return first

    assert list(run(call()).chunk.token_ids) == [11]
    assert loop.aborted == ["d1"]


@pytest.mark.parametrize(("fields", "detail"), [
    ({"kv": worker_pb2.KVHandle(transfer_id="t", block_ids=[1])}, "kv.peer"),
    ({"resume_token_ids": [4]}, "resume_token_ids"),
])
def test_a_bad_decode_request_is_refused_by_field(fields, detail):
    loop = FakeLoop()

    async def call():
        return [r async for r in servicer(DecodeRole(), loop).Decode(decode_request(**fields), FakeContext())]

    with pytest.raises(Aborted) as caught:
        run(call())
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details.startswith(detail)
    assert loop.calls == []


def test_an_error_from_the_loop_ends_the_stream_with_its_status():
    from worker_runtime.errors import Overloaded
    loop = FakeLoop([Overloaded("KV stayed full")])

    async def call():
        return [r async for r in servicer(DecodeRole(), loop).Decode(decode_request(), FakeContext())]

    with pytest.raises(Aborted) as caught:
        run(call())
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("role", [PrefillRole(), DecodeRole()])
def test_lease_prefix_answers_a_handle_of_the_blocks_held_or_none(role):
    """Both roles lease: a prefill worker its prompts' prefixes, a decode worker the contexts it served."""
    loop = FakeLoop()
    service = servicer(role, loop, lease_s=30.0)
    request = worker_pb2.PrefixLeaseRequest(lease_id="r1~pull0", token_ids=list(range(1, 33)), cache_salt="t",
                                            lease_s=10.0)
    answer = run(service.LeasePrefix(request, FakeContext()))
    assert answer.num_tokens == 32 == answer.kv.num_tokens  # two blocks of 16
    assert (list(answer.kv.block_ids), answer.kv.transfer_id, answer.kv.capability) == ([7, 8], "r1~pull0", "cap")
    assert answer.kv.peer == peer_to_proto(PEER) and answer.kv.worker_address == "10.0.0.1:7000"
    assert loop.calls == [("lease", "r1~pull0", 32, "t", 10.0)]
    request.token_ids[0] = 0  # the fake holds nothing for this one
    answer = run(service.LeasePrefix(request, FakeContext()))
    assert answer.num_tokens == 0 and not answer.HasField("kv")
    with pytest.raises(Aborted) as caught:
        run(service.LeasePrefix(worker_pb2.PrefixLeaseRequest(token_ids=[1]), FakeContext()))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "lease_id" in caught.value.details


def prefix_handle(num_tokens=16, block_ids=(5,)):
    return worker_pb2.KVHandle(peer=peer_to_proto(PEER), transfer_id="r1~pull0", block_ids=list(block_ids),
                               num_tokens=num_tokens, capability="cap")


def test_prefill_hands_a_signed_prefix_handle_to_the_loop():
    from common.cluster_auth import handles
    loop = FakeLoop()
    service = servicer(PrefillRole(), loop)
    service.handle_key = b"k" * 32
    prompt = list(range(1, 20))
    handle = prefix_handle()
    handles.sign(service.handle_key, handle, prompt[:16])
    run(service.Prefill(prefill_request(prompt_token_ids=prompt, prefix_kv=handle), FakeContext()))
    (_, rid, _, source, prefix_tokens), = loop.calls
    assert (rid, prefix_tokens, source.block_ids, source.transfer_id) == ("r1", 16, [5], "r1~pull0")
    assert source.first_token_id is None and source.peer_info["port"] == 7100


def local_decode_request(**fields):
    """A Decode call the worker computes itself: no first token, no KV handle."""
    return worker_pb2.DecodeRequest(**({"request_id": "d1", "prompt_token_ids": list(range(1, 20)),
                                        "params": params()} | fields))


def call_with_prefix(service, role, prompt, handle, **fields):
    if isinstance(role, PrefillRole):
        return run(service.Prefill(prefill_request(prompt_token_ids=prompt, prefix_kv=handle), FakeContext()))

    async def call():
        request = local_decode_request(prompt_token_ids=prompt, prefix_kv=handle, **fields)
        return [r async for r in service.Decode(request, FakeContext())]
    return run(call())


def test_a_decode_worker_computing_the_prompt_gets_the_signed_prefix_handle_too():
    from common.cluster_auth import handles
    loop = FakeLoop([SampleDelta("d1", 0, [11], "a", finished=True, finish_reason="length")])
    service = servicer(DecodeRole(), loop)
    service.handle_key = b"k" * 32
    prompt, handle = list(range(1, 20)), prefix_handle()
    handles.sign(service.handle_key, handle, prompt[:16])
    call_with_prefix(service, DecodeRole(), prompt, handle)
    (_, rid, source, prefix, prefix_tokens), = loop.calls
    assert (rid, source, prefix_tokens, prefix.block_ids, prefix.first_token_id) == ("d1", None, 16, [5], None)
    loop.calls.clear()
    kv = decode_request().kv
    handles.sign(service.handle_key, kv, prompt)
    with pytest.raises(Aborted) as caught:  # a prompt computed elsewhere has nothing to pull a prefix for
        call_with_prefix(service, DecodeRole(), prompt, handle, first_token_id=9, kv=kv)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details.startswith("prefix_kv")
    assert loop.calls == []


@pytest.mark.parametrize("role", [PrefillRole(), DecodeRole()])
@pytest.mark.parametrize(("handle", "signed", "field"), [
    (prefix_handle(num_tokens=8), True, "prefix_kv.num_tokens"),  # not whole blocks
    (prefix_handle(num_tokens=32, block_ids=(5, 6)), True, "prefix_kv.num_tokens"),  # past the prompt
    (prefix_handle(block_ids=(5, 6)), True, "prefix_kv.block_ids"),  # one id per block
    (prefix_handle(), False, "prefix_kv"),  # not signed by a router
])
def test_a_bad_prefix_handle_is_refused_naming_the_field(role, handle, signed, field):
    from common.cluster_auth import handles
    loop = FakeLoop()
    service = servicer(role, loop)
    service.handle_key = b"k" * 32
    prompt = list(range(1, 20))
    if signed:
        handles.sign(service.handle_key, handle, prompt[:handle.num_tokens])
    with pytest.raises(Aborted) as caught:
        call_with_prefix(service, role, prompt, handle)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details.startswith(field)
    assert loop.calls == []
