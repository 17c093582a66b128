"""Peer prefix pulls between two prefill workers' engine loops (prefill_worker/prefix_pull.py), in this process.

Two PrefillLoops over real engines (the tiny random Qwen2) with real TCP kv_transfer sides: A holds a prefix,
B is asked to prefill a prompt that starts with it. Checked: B pulls the blocks it lacks and computes only
the rest, with the first token a lone engine gives, also when A keeps them only in host memory; every
failure (the lease aborted, the holder's sender closed, the holder dying mid-stream, no room on B) falls back
to computing it, with the same first token; nothing is leaked on either side; a lease under another salt
finds nothing.
"""
import asyncio
import socket

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.kv_offload.config import OffloadConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import InvalidParameter, SamplingParams
from kv_transfer import KVLayout, KVTransferConfig, make_receiver, make_sender
from kv_transfer.wire import send_views
from prefill_worker.prefill_loop import PrefillLoop, PullAborted
from worker_runtime.kv_handle import KVSource

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4)


class Worker:
    """One prefill worker's engine thread and kv_transfer sides."""

    def __init__(self, model_dir, aio, kv_bytes=8 << 20, pull_timeout_s=5.0, cpu_tier_bytes=0):
        self.engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", cache=CacheConfig(
            kv_cache_memory_bytes=kv_bytes, offload=OffloadConfig(cpu_bytes=cpu_tier_bytes))))
        self.layout = layout = KVLayout.of_kv_cache(self.engine.runner.kv_cache, "tiny")
        config = KVTransferConfig(backend="tcp", host="127.0.0.1")
        self.sender = make_sender(self.engine.runner.kv_cache, layout, config)
        self.receiver = make_receiver(self.engine.runner.kv_cache, layout, config)
        self.loop = PrefillLoop(self.engine, aio, self.sender, self.receiver, pull_timeout_s)
        self.loop.idle_wait_s = 0.01
        self.loop.start()

    async def prefill(self, rid, prompt, **kwargs):
        result = await self.loop.prefill(rid, prompt, GREEDY, lease_s=10.0, **kwargs)
        await self.loop.abort(rid)  # no decode worker here: drop the lease on its blocks
        return result.first

    async def idle(self):
        """Wait until the worker holds nothing (every lease, pull and request ended)."""
        while await self.loop.call(lambda: self.engine.num_kv_blocks_used or self.loop.num_requests()):
            await asyncio.sleep(0.01)

    def close(self):
        self.loop.stop()
        self.loop.join(10)
        self.receiver.close()
        self.sender.close()


@pytest.fixture
def run(tiny_qwen2_dir):
    def runner(body, **kwargs):
        async def main():
            aio = asyncio.get_running_loop()
            a, b = Worker(tiny_qwen2_dir, aio, **kwargs), Worker(tiny_qwen2_dir, aio, **kwargs)
            try:
                await asyncio.wait_for(body(a, b), 60)
            finally:
                a.close()
                b.close()
        asyncio.run(main())
    return runner


def prompts():
    shared = list(range(1000, 1000 + 5 * BLOCK))  # 5 blocks A computes
    return shared, shared + list(range(3000, 3000 + 2 * BLOCK + 3))


async def warmed(a, b):
    """A caches the shared prefix; B's answer to the whole prompt computed alone is the reference (its
    cache is emptied after)."""
    shared, prompt = prompts()
    await a.prefill("warm", shared + [7])
    expected = (await b.prefill("alone", prompt)).token_ids
    await b.loop.call(b.engine.kv.pool.reset_prefix_cache)
    return shared, prompt, expected


async def lease(holder, lease_id, prefix, salt=""):
    held = await holder.loop.lease_prefix(lease_id, prefix, salt, lease_s=10.0)
    return held and KVSource(held.peer_info, held.transfer_id, held.block_ids, None, held.capability)


def test_b_pulls_the_prefix_a_holds_and_computes_only_the_rest(run):
    async def body(a, b):
        shared, prompt, expected = await warmed(a, b)
        source = await lease(a, "p1~pull", shared)
        assert len(source.block_ids) == 5
        first = await b.prefill("p1", prompt, prefix=source, prefix_tokens=len(shared))
        assert first.token_ids == expected
        assert first.num_cached_tokens == len(shared)  # the rest (35 tokens) computed on B
        stats = b.loop.pulls.stats
        assert (stats.pulls, stats.fallbacks, stats.tokens) == (1, 0, len(shared))
        assert stats.bytes == 5 * b.layout.block_nbytes
        await a.idle()  # the pull ended A's lease
        await b.idle()
    run(body)


def test_b_pulls_a_prefix_a_keeps_only_in_host_memory(run):
    """A's lease loads the blocks back from its host tier first, then B pulls them."""
    async def body(a, b):
        shared, prompt, expected = await warmed(a, b)
        for w in (a, b):  # A's blocks reach its host tier and leave its device; B's own copies leave its device
            while await w.loop.call(lambda w=w: w.engine.scheduler.offload.busy):  # (a block being stored stays)
                await asyncio.sleep(0.01)
            await w.loop.call(w.engine.kv.pool.reset_prefix_cache)
        source = await lease(a, "p1~pull", shared)
        assert len(source.block_ids) == 5 and a.engine.kv_tier_stats()["cpu"]["hits"] == 5
        first = await b.prefill("p1", prompt, prefix=source, prefix_tokens=len(shared))
        assert first.token_ids == expected
        assert (b.loop.pulls.stats.pulls, b.loop.pulls.stats.tokens) == (1, len(shared))
        await a.idle()
        await b.idle()
    run(body, cpu_tier_bytes=64 << 10)


def test_b_pulls_only_the_blocks_it_lacks(run):
    async def body(a, b):
        shared, prompt = prompts()
        await a.prefill("warm", shared + [7])
        await b.prefill("own", shared[:2 * BLOCK] + [9])  # B has the first 2 blocks itself
        first = await b.prefill("p", prompt, prefix=await lease(a, "p~pull", shared), prefix_tokens=len(shared))
        assert first.num_cached_tokens == len(shared)
        assert b.loop.pulls.stats.tokens == 3 * BLOCK
        await a.idle()
        await b.idle()
    run(body)


def die_mid_stream(sender):
    """Make `sender` stream half of the blocks of its next read, then drop the connection: what the puller
    sees when the holder's process dies mid-transfer."""
    tcp = sender.path_named("tcp")

    def serve(sock, t, block_ids, hello, read):
        views = tcp.region.block_views(block_ids)
        send_views(sock, [views[0][:len(views[0]) // 2]], should_stop=lambda: False)
        sock.shutdown(socket.SHUT_RDWR)
        raise ConnectionResetError("the holder died")
    tcp.serve = serve


@pytest.mark.parametrize("failure", ["lease_aborted", "holder_gone", "holder_dies_mid_pull"])
def test_a_failed_pull_computes_the_prefix_with_the_same_first_token(run, failure):
    async def body(a, b):
        shared, prompt, expected = await warmed(a, b)
        source = await lease(a, "p~pull", shared)
        if failure == "lease_aborted":  # as when it expired: the holder freed the blocks
            assert await a.loop.abort("p~pull")
        elif failure == "holder_dies_mid_pull":
            die_mid_stream(a.sender)
        else:
            a.close()
        first = await b.prefill("p", prompt, prefix=source, prefix_tokens=len(shared))
        assert first.token_ids == expected
        assert first.num_cached_tokens == 0
        assert (b.loop.pulls.stats.pulls, b.loop.pulls.stats.fallbacks) == (0, 1)
        await b.idle()
        if failure != "holder_gone":
            await a.idle()  # the half-served lease failed: its blocks are released too
    run(body)


def test_no_room_to_pull_into_computes_the_prefix_once_blocks_free_up(run):
    async def body(a, b):
        shared, prompt, expected = await warmed(a, b)
        free = await b.loop.call(lambda: b.engine.kv.pool.num_free_blocks)
        await b.loop.prefill("hog", list(range(5000, 5000 + (free - 3) * BLOCK)), GREEDY, lease_s=10.0)
        source = await lease(a, "p~pull", shared)  # 5 blocks: B has 3 free
        pending = b.loop.prefill("p", prompt, GREEDY, 10.0, prefix=source, prefix_tokens=len(shared))
        while not b.loop.pulls.stats.fallbacks:
            await asyncio.sleep(0.01)
        await a.idle()  # B released the lease at once (an empty read)
        await b.loop.abort("hog")  # blocks for the prompt, computed whole
        first = (await pending).first
        assert first.token_ids == expected and first.num_cached_tokens == 0
        await b.loop.abort("p")
        await b.idle()
    run(body, kv_bytes=24 * 8192)


def test_a_second_request_under_the_id_of_one_pulling_is_refused(run):
    async def body(a, b):
        shared, prompt = prompts()
        await a.prefill("warm", shared + [7])
        pending = b.loop.prefill("p", prompt, GREEDY, 10.0, prefix=await lease(a, "p~pull", shared),
                                 prefix_tokens=len(shared))
        with pytest.raises(InvalidParameter, match="already running"):
            await b.loop.prefill("p", prompt, GREEDY, 10.0)
        assert (await pending).first.num_cached_tokens == len(shared)  # the first one goes on
        await b.loop.abort("p")
        await a.idle()
        await b.idle()
    run(body)


def test_abort_during_a_pull_frees_both_sides(run):
    async def body(a, b):
        shared, prompt = prompts()
        await a.prefill("warm", shared + [7])
        source = await lease(a, "p~pull", shared)
        pending = b.loop.prefill("p", prompt, GREEDY, 10.0, prefix=source, prefix_tokens=len(shared))
        assert await b.loop.abort("p")  # queued right behind it: the pull has not been polled yet
        with pytest.raises(PullAborted):
            await pending
        await b.idle()
        assert await a.loop.abort("p~pull")  # the router aborts every worker the sample touched
        await a.idle()
    run(body)


def test_a_lease_under_another_salt_finds_nothing(run):
    async def body(a, b):
        shared, _ = prompts()
        await a.prefill("warm", shared + [7], cache_salt="tenant-a")
        assert await lease(a, "x~pull", shared, salt="tenant-b") is None
        assert await lease(a, "y~pull", shared) is None  # no salt is another salt too
        assert len((await lease(a, "z~pull", shared, salt="tenant-a")).block_ids) == 5
        assert await a.loop.abort("z~pull")
        await a.idle()
    run(body)
