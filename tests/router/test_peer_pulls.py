"""The router's half of a peer pull (router/peer_pulls.py) against a fake holder: no network.

Checked: a lease goes into the Prefill request signed over the prefix's tokens and joins the sample's
touched list (a failing sample aborts it on the holder); a holder that holds nothing any more (evicted),
answers with an error, or left rotation leaves the request as it was, so the worker computes the prefix;
with no prefill pool the pipeline hands a busy peer's lease to the decode worker that computes the prompt.
"""
import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry

from common.cluster_auth import handles
from common.protocol import generate_pb2, worker_pb2
from router.kv_index import KvIndex
from router.peer_pulls import PeerPulls
from router.routing_metrics import RoutingMetrics
from router.routing_policy import PullOption
from router.worker_pool import WorkerPool
from router.worker_selector import PrefillPick

BLOCK = 16
PROMPT = list(range(100, 100 + 5 * BLOCK + 3))
KEY = b"k" * 32


class FakeError(grpc.aio.AioRpcError):
    def __init__(self):
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")


class FakeHolder:
    def __init__(self, answer):
        self.answer = answer
        self.calls = []

    async def LeasePrefix(self, request, timeout=None):  # noqa: N802 - the gRPC method's name
        self.calls.append(request)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    async def Abort(self, request, timeout=None):  # noqa: N802
        self.calls.append(request)


def setup(answer, healthy=True):
    pool = WorkerPool(["a:1", "b:1"], [])
    holder = pool.get("a:1")
    holder.healthy, holder.stub = healthy, FakeHolder(answer)
    metrics = RoutingMetrics(CollectorRegistry(), KvIndex(), lambda: 0)
    pulls = PeerPulls(pool, metrics)
    pulls.handle_key = KEY
    pick = PrefillPick(pool.get("b:1"), 1, 0.1, PullOption("a:1", 4))
    return pulls, pick, holder, metrics


def run(pulls, pick):
    request = worker_pb2.PrefillRequest(request_id="s", prompt_token_ids=PROMPT, cache_salt="t")
    touched = []

    async def lease():
        blocks = await pulls.lease("s", PROMPT, pick, request, touched, BLOCK)
        await asyncio.gather(*pulls._aborts)
        return blocks
    return asyncio.run(lease()), request, touched


def outcome(metrics, name):
    return metrics.peer_pulls.labels(name)._value.get()


def test_a_lease_is_signed_into_the_request_and_touched():
    kv = worker_pb2.KVHandle(transfer_id="s~pull0", block_ids=[7, 8, 9, 10], num_tokens=4 * BLOCK,
                             worker_address="a:1", capability="cap")
    pulls, pick, holder, metrics = setup(worker_pb2.PrefixLeaseResponse(kv=kv, num_tokens=4 * BLOCK))
    blocks, request, touched = run(pulls, pick)
    assert blocks == 4 and request.prefix_kv.transfer_id == "s~pull0"
    (call,) = holder.stub.calls
    assert (call.lease_id, list(call.token_ids), call.cache_salt) == ("s~pull0", PROMPT[:4 * BLOCK], "t")
    assert handles.verify(KEY, request.prefix_kv, PROMPT[:4 * BLOCK])
    assert not handles.verify(KEY, request.prefix_kv, PROMPT[:5 * BLOCK])
    assert touched == [(holder, "s~pull0")]
    assert outcome(metrics, "leased") == 1


@pytest.mark.parametrize(("answer", "healthy", "name"), [
    (worker_pb2.PrefixLeaseResponse(num_tokens=0), True, "nothing_held"),  # evicted since its last event
    (FakeError(), True, "lease_failed"),
    (worker_pb2.PrefixLeaseResponse(num_tokens=0), False, "holder_gone"),
])
def test_no_lease_leaves_the_request_to_compute_the_prefix(answer, healthy, name):
    pulls, pick, holder, metrics = setup(answer, healthy)
    blocks, request, touched = run(pulls, pick)
    assert blocks == 0 and not request.HasField("prefix_kv") and touched == []
    assert outcome(metrics, name) == 1 and outcome(metrics, "leased") == 0
    if name == "lease_failed":  # it may still grant it: the lease is aborted by its id
        assert [c.request_id for c in holder.stub.calls[1:]] == ["s~pull0"]


class FakeDecodeWorker(FakeHolder):
    """A decode worker: leases what it holds, and answers Decode with one token that ends the sample."""

    def Decode(self, request, timeout=None):  # noqa: N802
        from tests.router.test_migration import _FakeDecodeCall
        self.calls.append(request)
        return _FakeDecodeCall([
            generate_pb2.GenerateResponse(chunk=generate_pb2.Chunk(token_ids=[9])),
            generate_pb2.GenerateResponse(complete=generate_pb2.Complete(
                finish_reason=generate_pb2.FINISH_REASON_LENGTH, usage=generate_pb2.Usage(prompt_tokens=1)))])


def test_a_decode_worker_computing_the_prompt_gets_the_lease_of_a_busy_peer():
    """No prefill pool: the pipeline leases the prefix on the busy holder and hands it to the decode worker."""
    from engine.sampling_params import SamplingParams
    from router.config import RouterConfig
    from router.pipeline import GenerationPipeline
    from router.request_builder import PreparedRequest
    from tests.router.test_peer_pull_routing import PROMPT as LONG_PROMPT
    from tests.router.test_peer_pull_routing import make_local

    pool, _, selector = make_local()
    kv = worker_pb2.KVHandle(transfer_id="x", block_ids=list(range(40)), num_tokens=40 * BLOCK, capability="c")
    holder, other = pool.get("d:1"), pool.get("d:2")
    holder.stub = FakeDecodeWorker(worker_pb2.PrefixLeaseResponse(kv=kv, num_tokens=40 * BLOCK))
    other.stub = FakeDecodeWorker(None)
    for _ in range(2):
        holder.begin_decode()

    async def scenario():
        pipeline = GenerationPipeline(RouterConfig(), selector)
        request = PreparedRequest("r", LONG_PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
        try:
            return [m async for m in pipeline.generate(request)]
        finally:
            await pipeline.wait_background()
    assert asyncio.run(scenario())[-1].HasField("complete")
    (lease,) = holder.stub.calls
    assert lease.lease_id.endswith("~pull0") and len(lease.token_ids) == 40 * BLOCK
    (decode,) = other.stub.calls
    assert not decode.HasField("first_token_id") and decode.prefix_kv.block_ids == kv.block_ids
