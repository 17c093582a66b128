"""Migration bookkeeping without a network: what moves, how often, with which tokens."""
import asyncio

import grpc
import pytest

from common.protocol import generate_pb2
from router.config import RouterConfig
from router.migration import MigrationReason, SampleProgress, migration_reason
from tests.router.test_worker_selector import HASHES, PROMPT, make


def test_only_a_lost_or_draining_worker_is_worth_a_migration():
    assert migration_reason(grpc.StatusCode.UNAVAILABLE, "Socket closed") == MigrationReason.WORKER_LOST
    assert migration_reason(grpc.StatusCode.UNAVAILABLE, "the worker is draining: its 1s drain timeout passed") \
        == MigrationReason.DRAINED
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                 grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED):
        assert migration_reason(code, "draining") is None, code


def test_progress_keeps_the_streamed_tokens_and_resumes_after_them():
    progress = SampleProgress("r-1", max_migrations=2)
    progress.observe([5])  # the prefill worker's first token
    progress.observe([6, 7])
    assert progress.attempt_id == "r-1"
    assert progress.migrate(MigrationReason.WORKER_LOST) == "r-1~m1"
    assert progress.resume_token_ids == [5, 6, 7]
    assert progress.context([1, 2]) == [1, 2, 5, 6, 7]
    progress.observe([8])  # the new worker continues: nothing repeated, nothing dropped
    assert progress.migrate(MigrationReason.STREAM_TIMEOUT) == "r-1~m2"
    assert progress.resume_token_ids == [5, 6, 7, 8]
    assert not progress.may_migrate()  # the limit
    with pytest.raises(RuntimeError):
        progress.migrate(MigrationReason.WORKER_LOST)
    assert progress.migrations == [MigrationReason.WORKER_LOST, MigrationReason.STREAM_TIMEOUT]


def test_finished_samples_and_a_zero_limit_never_migrate():
    assert not SampleProgress("a", max_migrations=0).may_migrate()
    done = SampleProgress("b", max_migrations=3)
    done.finish()
    assert not done.may_migrate()
    with pytest.raises(RuntimeError):
        done.observe([1])
    with pytest.raises(ValueError):
        SampleProgress("c", max_migrations=-1)


def test_router_config_validates_the_migration_settings():
    assert RouterConfig().max_migrations == 3 and RouterConfig().stream_timeout_s == 30.0
    RouterConfig(max_migrations=0, stream_timeout_s=0)
    for kwargs in ({"max_migrations": -1}, {"max_migrations": 1.5}, {"max_migrations": True},
                   {"stream_timeout_s": -1.0}, {"stream_timeout_s": float("nan")}):
        with pytest.raises(ValueError):
            RouterConfig(**kwargs)


def test_a_migrating_sample_is_never_routed_back_to_the_worker_it_left():
    async def scenario():
        pool, _, selector = make(decode=("d1:1", "d2:1"), max_requests=8)
        left = pool.get("d1:1")
        for _ in range(4):
            route = await selector.route(PROMPT, HASHES, exclude=(left,))
            assert route.decode.address == "d2:1"
        from router.worker_selector import NoHealthyWorker
        with pytest.raises(NoHealthyWorker):
            await selector.route(PROMPT, HASHES, exclude=(left, pool.get("d2:1")))
    asyncio.run(scenario())


class _FakeDecodeCall:
    """A decode worker's stream: the given responses, then a clean end (EOF)."""

    def __init__(self, messages) -> None:
        self._messages = list(messages)

    async def read(self):
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    def cancel(self) -> None:
        pass


class _FakeWorkerStub:
    def __init__(self, messages, on_call=lambda: None) -> None:
        self.messages = messages
        self.requests = []
        self.on_call = on_call

    def Decode(self, request, timeout=None):  # noqa: N802 - the gRPC method's name
        self.requests.append(request)
        self.on_call()
        return _FakeDecodeCall(self.messages)

    async def Abort(self, request, timeout=None):  # noqa: N802
        return generate_pb2.AbortResponse(found=False)


def test_a_stream_that_ends_without_completing_moves_instead_of_ending_the_sample_early():
    """A decode stream that ends cleanly but without the sample's Complete must not end the client's
    stream OK with tokens missing: it migrates like a lost worker, and the next worker finishes it."""
    from engine.sampling_params import SamplingParams
    from router.pipeline import GenerationPipeline
    from router.request_builder import PreparedRequest

    def chunk(token):
        return generate_pb2.GenerateResponse(chunk=generate_pb2.Chunk(token_ids=[token]))

    async def scenario():
        pool, _, selector = make(prefill=(), decode=("d1:1", "d2:1"), max_requests=8)
        d1, d2 = pool.get("d1:1"), pool.get("d2:1")
        d2.healthy = False  # the sample starts on d1; d2 joins as d1's stream runs
        d1.stub = _FakeWorkerStub([chunk(7)], on_call=lambda: setattr(d2, "healthy", True))  # then EOF, no Complete
        d2.stub = _FakeWorkerStub([chunk(8), generate_pb2.GenerateResponse(
            complete=generate_pb2.Complete(finish_reason=generate_pb2.FINISH_REASON_LENGTH))])
        reasons = []
        pipeline = GenerationPipeline(RouterConfig(), selector, on_migration=reasons.append)
        request = PreparedRequest("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=2))
        messages = [m async for m in pipeline.generate(request)]
        await pipeline.wait_background()
        return messages, reasons, pool

    messages, reasons, pool = asyncio.run(scenario())
    tokens = [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]
    assert reasons == ["worker_lost"] and tokens == [7, 8]
    assert list(pool.get("d2:1").stub.requests[0].resume_token_ids) == [7]  # resumed after the token streamed
    assert messages[-1].HasField("complete")


class _SilentCall:
    async def read(self):
        await asyncio.sleep(3600)

    def cancel(self) -> None:
        pass


@pytest.mark.parametrize("answers_polls", [False, True])
def test_a_silent_stream_moves_after_the_timeout_unless_its_worker_still_answers_polls(answers_polls):
    """Silent for the stream timeout on a worker that stopped answering: moved at once. On one that still
    answers its health polls (overloaded, not hung): moved only after SLOW_STREAM_PATIENCE timeouts."""
    from engine.sampling_params import SamplingParams
    from router.pipeline import SLOW_STREAM_PATIENCE, GenerationPipeline
    from router.request_builder import PreparedRequest
    timeout = 0.05

    async def scenario():
        pool, _, selector = make(prefill=(), decode=("d1:1", "d2:1"), max_requests=8)
        d1, d2 = pool.get("d1:1"), pool.get("d2:1")
        d2.healthy = False  # the sample starts on d1; d2 joins as d1's stream runs
        d1.stub = _FakeWorkerStub([])
        d1.stub.Decode = lambda request, timeout=None: (setattr(d2, "healthy", True), _SilentCall())[1]
        d2.stub = _FakeWorkerStub([generate_pb2.GenerateResponse(
            complete=generate_pb2.Complete(finish_reason=generate_pb2.FINISH_REASON_LENGTH))])
        loop = asyncio.get_running_loop()

        async def polls():
            while answers_polls:
                d1.answered_at = loop.time()
                await asyncio.sleep(timeout / 5)

        poller = asyncio.create_task(polls())
        reasons = []
        pipeline = GenerationPipeline(RouterConfig(stream_timeout_s=timeout), selector, on_migration=reasons.append)
        started = loop.time()
        request = PreparedRequest("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=2))
        messages = [m async for m in pipeline.generate(request)]
        took = loop.time() - started
        poller.cancel()
        await pipeline.wait_background()
        return messages, reasons, took

    messages, reasons, took = asyncio.run(scenario())
    assert reasons == ["stream_timeout"] and messages[-1].HasField("complete")
    if answers_polls:
        assert took >= SLOW_STREAM_PATIENCE * timeout
    else:
        assert took < SLOW_STREAM_PATIENCE * timeout


class _SlowCall:
    """A stream whose messages come late, and which (like a grpc.aio call) is over once a read of it was
    cancelled: every later read returns EOF."""

    def __init__(self, messages, delay: float) -> None:
        self._messages, self._delay, self._cancelled = list(messages), delay, False

    async def read(self):
        if self._cancelled or not self._messages:
            return grpc.aio.EOF
        try:
            await asyncio.sleep(self._delay)
        except asyncio.CancelledError:
            self._cancelled = True
            raise
        return self._messages.pop(0)

    def cancel(self) -> None:
        self._cancelled = True


def test_waiting_on_a_slow_stream_does_not_cut_it():
    """A worker that answers its polls but streams slower than the stream timeout: the router keeps the
    same read outstanding, so the tokens arrive, the sample completes there, and nothing migrates."""
    from engine.sampling_params import SamplingParams
    from router.pipeline import GenerationPipeline
    from router.request_builder import PreparedRequest
    timeout = 0.05

    async def scenario():
        pool, _, selector = make(prefill=(), decode=("d1:1",), max_requests=8)
        d1 = pool.get("d1:1")
        d1.stub = _FakeWorkerStub([])
        messages = [generate_pb2.GenerateResponse(chunk=generate_pb2.Chunk(token_ids=[t])) for t in (7, 8)]
        messages.append(generate_pb2.GenerateResponse(complete=generate_pb2.Complete(
            finish_reason=generate_pb2.FINISH_REASON_LENGTH)))
        d1.stub.Decode = lambda request, **call_options: _SlowCall(messages, delay=2.5 * timeout)
        loop = asyncio.get_running_loop()

        async def polls():
            while True:
                d1.answered_at = loop.time()
                await asyncio.sleep(timeout / 5)

        poller = asyncio.create_task(polls())
        reasons = []
        pipeline = GenerationPipeline(RouterConfig(stream_timeout_s=timeout), selector, on_migration=reasons.append)
        out = [m async for m in pipeline.generate(PreparedRequest("r", PROMPT, SamplingParams(max_tokens=2)))]
        poller.cancel()
        await pipeline.wait_background()
        return out, reasons

    out, reasons = asyncio.run(scenario())
    assert reasons == []
    assert [t for m in out if m.HasField("chunk") for t in m.chunk.token_ids] == [7, 8]
    assert out[-1].HasField("complete")
