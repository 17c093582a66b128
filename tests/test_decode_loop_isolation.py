"""The decode loop isolates its jobs: a KV job that raises something unforeseen fails its own
request and frees its reserved blocks; the batch running beside it goes on (real engine)."""
from __future__ import annotations

import asyncio

from decode_worker.decode_loop import DecodeLoop
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from worker_runtime.kv_handle import KVSource

PROMPT = list(range(1000, 1040))


class BrokenReceiver:
    """A receiver whose read fails in a way the loop does not expect."""

    def read(self, *args, **kwargs):
        raise TypeError("unexpected")

    def stats(self) -> dict:
        return {}


def test_a_job_that_raises_fails_only_its_request(smollm2_dir):
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                    cache=CacheConfig(kv_cache_memory_bytes=64 << 20)))
    num_blocks = -(-len(PROMPT) // engine.config.cache.block_size)

    async def main() -> None:
        loop = DecodeLoop(engine, asyncio.get_running_loop(), BrokenReceiver(), pull_timeout_s=5.0)
        loop.start()
        try:
            good, bad = asyncio.Queue(), asyncio.Queue()
            await loop.decode("good", PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                              None, good.put_nowait)
            source = KVSource({"host": "127.0.0.1", "port": 9, "modes": ["tcp"]}, "t", list(range(num_blocks)), 5)
            await loop.decode("bad", PROMPT, SamplingParams(max_tokens=4), source, bad.put_nowait)
            failure = await asyncio.wait_for(bad.get(), 60)
            assert isinstance(failure, RuntimeError) and "TypeError" in str(failure)
            tokens = []
            while True:
                delta = await asyncio.wait_for(good.get(), 120)
                assert not isinstance(delta, BaseException), delta
                tokens += delta.token_ids
                if delta.finished:
                    break
            assert len(tokens) == 30
            assert await loop.call(lambda: (engine.num_kv_blocks_used, loop.num_requests())) == (0, 0)
        finally:
            loop.stop()
            loop.join(10)

    asyncio.run(main())
