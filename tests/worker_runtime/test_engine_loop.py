"""The asyncio <-> engine-thread bridge (worker_runtime/engine_loop.py) with a fake engine: no model, no
process. What is checked: `call` runs on the engine thread and hands back results and exceptions; a step's
deltas reach their sinks on the asyncio loop only after that step's stats are published; a step that raises
fails every open request (and aborts it in the engine) while the thread keeps serving; a broken engine (a lost
rank or pipeline stage) fails its requests UNAVAILABLE and ends the loop through `on_broken`, idle or not."""
import asyncio
import threading
from types import SimpleNamespace

import pytest

from engine.outputs import SampleDelta
from worker_runtime.engine_loop import EngineLoop
from worker_runtime.errors import EngineBroken


class FakeEngine:
    """Steps emit what `script` holds for them; a step given an exception raises it."""

    def __init__(self):
        self.script: list = []
        self.aborted: list[str] = []
        self.step_threads: set[str] = set()
        self.runner = SimpleNamespace(model=object())
        self.scheduler = SimpleNamespace(requests={}, num_running=0, num_waiting=0, waiting=[], num_preemptions=0)
        self.kv = SimpleNamespace(num_prefix_queries=0, num_prefix_hits=0)
        self.num_kv_blocks_total, self.num_kv_blocks_used = 10, 0
        self.num_spec_draft_tokens = self.num_spec_accepted_tokens = 0
        self.steps = 0
        self.lost: str | None = None
        """What `broken` says: set, a rank is gone."""

    def broken(self) -> str | None:
        return self.lost

    def has_unfinished(self) -> bool:
        return bool(self.script)

    def step(self):
        self.step_threads.add(threading.current_thread().name)
        self.steps += 1
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        self.scheduler.requests = {d.request_id: None for d in item if not d.finished}
        return item

    def kv_tier_stats(self):
        return {}

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)


async def run_with_loop(body):
    engine = FakeEngine()
    loop = EngineLoop(engine, asyncio.get_running_loop())
    loop.idle_wait_s = 0.01
    loop.start()
    try:
        return await asyncio.wait_for(body(engine, loop), 30)
    finally:
        loop.stop()
        loop.join(10)


def test_call_runs_on_the_engine_thread_and_returns_results_and_errors():
    async def body(engine, loop):
        name = await loop.call(lambda: threading.current_thread().name)
        with pytest.raises(ZeroDivisionError):
            await loop.call(lambda: 1 / 0)
        return name

    assert asyncio.run(run_with_loop(body)) == "engine-loop"


def test_deltas_reach_their_sinks_after_the_steps_stats():
    async def body(engine, loop):
        got: list = []
        done = asyncio.get_running_loop().create_future()

        def sink(delta):
            # Seen from the asyncio side: the stats already count the step that produced this delta.
            got.append((delta.token_ids, loop.stats.get("num_requests"), loop.generation_tokens_total))
            if delta.finished:
                done.set_result(None)

        def add():
            loop.add_sink("r", sink)
            engine.script += [[SampleDelta("r", 0, [5], "a")], [SampleDelta("r", 0, [6, 7], "bc", finished=True)]]

        await loop.call(add)
        await done
        return got, engine.step_threads

    got, threads = asyncio.run(run_with_loop(body))
    assert [tokens for tokens, _, _ in got] == [[5], [6, 7]]
    assert got[0][2] >= 1  # the first step's token is counted before its delta is seen (maybe the second too)
    assert got[1][1:] == (0, 3)  # the request's end is seen only once the stats no longer count it
    assert threads == {"engine-loop"}


def test_a_failing_step_fails_the_open_requests_and_the_loop_keeps_serving():
    async def body(engine, loop):
        ended: dict[str, object] = {}
        both = asyncio.Event()

        def sink_for(rid):
            def sink(item):
                ended[rid] = item
                if len(ended) == 2:
                    both.set()
            return sink

        def add():
            loop.add_sink("a", sink_for("a"))
            loop.add_sink("b", sink_for("b"))
            engine.script.append(RuntimeError("boom"))

        await loop.call(add)
        await both.wait()
        alive = await loop.call(lambda: "still serving")
        return ended, engine.aborted, alive

    ended, aborted, alive = asyncio.run(run_with_loop(body))
    assert all(isinstance(item, RuntimeError) for item in ended.values()) and set(ended) == {"a", "b"}
    assert sorted(aborted) == ["a", "b"] and alive == "still serving"


@pytest.mark.parametrize("idle", [False, True], ids=["in-a-step", "idle"])
def test_a_broken_engine_fails_its_requests_unavailable_and_the_loop_hands_over(idle, monkeypatch):
    monkeypatch.setattr("worker_runtime.engine_loop.BROKEN_CHECK_S", 0.0)

    async def body(engine, loop):
        aio = asyncio.get_running_loop()
        reported = aio.create_future()
        loop.on_broken = lambda reason: aio.call_soon_threadsafe(reported.set_result, reason)
        ended = aio.create_future()

        def add():
            if idle:
                engine.lost = "pipeline stage 1 exited"
                return
            loop.add_sink("a", lambda item: ended.set_result(item))
            engine.lost = "pipeline stage 1 exited"
            engine.script.append(RuntimeError("Connection reset by peer"))

        await loop.call(add)
        reason = await reported
        loop.join(10)
        return reason, None if idle else await ended, loop.is_alive()

    reason, item, alive = asyncio.run(run_with_loop(body))
    assert reason == "pipeline stage 1 exited" and not alive
    if not idle:
        assert isinstance(item, EngineBroken) and "pipeline stage 1 exited" in str(item)
        assert item.code.name == "UNAVAILABLE"
