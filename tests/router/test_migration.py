"""Migration bookkeeping without a network: what moves, how often, with which tokens."""
import asyncio

import grpc
import pytest

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
