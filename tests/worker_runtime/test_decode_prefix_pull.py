"""A decode worker that computes a prompt itself (no remote prefill) pulls the prefix a peer holds first
(decode_worker/decode_loop.py with worker_runtime/prefix_pulls.py), in this process.

Holder A is a prefill worker's engine loop, D a decode worker's, each over a real engine (the tiny random
Qwen2) with real TCP kv_transfer sides. Checked: D pulls A's blocks and computes only the rest, generating
what D alone generates; a broken lease falls back to computing with the same output; an abort during the
pull ends the stream as cancelled; nothing is leaked on either side.
"""
import asyncio
import threading

import pytest

from decode_worker.decode_loop import DecodeLoop
from tests.prefill_worker.test_peer_prefix_pull import GREEDY, Worker, lease, prompts


class DecodeWorker(Worker):
    """Worker's engine and kv_transfer sides, driven by a DecodeLoop."""

    def __init__(self, model_dir, aio):
        super().__init__(model_dir, aio)
        self.loop.stop()
        self.loop.join(10)
        self.loop = DecodeLoop(self.engine, aio, self.receiver, 5.0, self.sender, peer_pull_timeout_s=5.0)
        self.loop.idle_wait_s = 0.01
        self.loop.start()

    async def generate(self, rid, prompt, **prefix):
        """The tokens generated and the prompt tokens the engine did not compute."""
        items = asyncio.Queue()
        await self.loop.decode(rid, prompt, GREEDY, None, items.put_nowait, **prefix)
        tokens = []
        while True:
            item = await items.get()
            if isinstance(item, BaseException):
                raise item
            tokens += item.token_ids
            if item.finished:
                return tokens, item.num_cached_tokens


@pytest.fixture
def run(tiny_qwen2_dir):
    def runner(body):
        async def main():
            aio = asyncio.get_running_loop()
            a, d = Worker(tiny_qwen2_dir, aio), DecodeWorker(tiny_qwen2_dir, aio)
            try:
                await asyncio.wait_for(body(a, d), 60)
            finally:
                a.close()
                d.close()
        asyncio.run(main())
    return runner


async def warmed(a, d):
    shared, prompt = prompts()
    await a.prefill("warm", shared + [7])
    expected, _ = await d.generate("alone", prompt)
    await d.loop.call(d.engine.kv.pool.reset_prefix_cache)
    return shared, prompt, expected


def test_d_pulls_the_prefix_a_holds_then_computes_the_rest(run):
    async def body(a, d):
        shared, prompt, expected = await warmed(a, d)
        source = await lease(a, "p~pull", shared)
        assert await d.generate("p", prompt, prefix=source, prefix_tokens=len(shared)) == (expected, len(shared))
        stats = d.loop.pulls.stats
        assert (stats.pulls, stats.fallbacks, stats.tokens) == (1, 0, len(shared))
        assert d.loop.extra_stats()["peer_pull_tokens"] == len(shared)
        await a.idle()
        await d.idle()
    run(body)


def test_a_broken_lease_computes_the_prefix_with_the_same_output(run):
    async def body(a, d):
        shared, prompt, expected = await warmed(a, d)
        source = await lease(a, "p~pull", shared)
        assert await a.loop.abort("p~pull")
        assert await d.generate("p", prompt, prefix=source, prefix_tokens=len(shared)) == (expected, 0)
        assert (d.loop.pulls.stats.pulls, d.loop.pulls.stats.fallbacks) == (0, 1)
        await a.idle()
        await d.idle()
    run(body)


def test_an_abort_during_the_pull_cancels_the_stream_and_frees_both_sides(run):
    async def body(a, d):
        shared, prompt = prompts()
        await a.prefill("warm", shared + [7])
        source = await lease(a, "p~pull", shared)
        tcp = a.sender.path_named("tcp")
        serve, go = tcp.serve, threading.Event()
        tcp.serve = lambda *args: go.wait(30) and serve(*args)  # the pull stays in flight until `go`
        pending = asyncio.ensure_future(d.generate("p", prompt, prefix=source, prefix_tokens=len(shared)))
        while not await d.loop.call(lambda: len(d.loop.pulls)):
            await asyncio.sleep(0.01)
        assert await d.loop.abort("p")
        with pytest.raises(asyncio.CancelledError):
            await pending
        go.set()
        await d.idle()
        await a.loop.abort("p~pull")  # the router aborts every worker the sample touched
        await a.idle()
    run(body)
