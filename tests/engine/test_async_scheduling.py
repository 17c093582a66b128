"""Async scheduling (engine/engine_steps.py): step N+1 is launched before step N's tokens are read, its
continuing requests' inputs copied on the device from step N's draw. Whatever the batch holds, the outputs
must equal the engine that reads every step before scheduling the next: tokens, text, finish reasons,
logprobs, stops by token, string, length and min_tokens, parallel and seeded samples, penalties (which do not
continue), preemption, an abort in flight, the prefix cache. Runs on the test host's device (CUDA where a GPU is)."""
from __future__ import annotations

import random

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

BS = 16


def make_engine(model_dir, overlap: bool, num_blocks: int = 256) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", seed=0, overlap_steps=overlap,
                                    cache=CacheConfig(block_size=BS, num_blocks=num_blocks)))
    assert engine.async_scheduling is overlap
    return engine


@pytest.fixture(scope="module")
def pair(tiny_qwen2_dir):
    """(sync, async) engines of the same model."""
    return make_engine(tiny_qwen2_dir, False), make_engine(tiny_qwen2_dir, True)


def prompts(n: int, seed: int = 0, lengths=(5, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished() and not engine._launched and not engine._in_flight
    assert engine.kv.pool.num_used_blocks == 0 and not engine.kv.block_tables
    assert all(r.num_pending_tokens == 0 for r in engine.scheduler.requests.values())


def summary(outputs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason) for c in out.completions] for out in outputs]


def assert_logprobs_close(got, want) -> None:
    for out_g, out_w in zip(got, want, strict=True):
        for c_g, c_w in zip(out_g.completions, out_w.completions, strict=True):
            if c_w.logprobs is None:
                assert c_g.logprobs is None
                continue
            for g, w in zip(c_g.logprobs, c_w.logprobs, strict=True):
                assert g["token_id"] == w["token_id"]
                assert g["logprob"] == pytest.approx(w["logprob"], abs=1e-4)
                assert [t["token_id"] for t in g["top_logprobs"]] == [t["token_id"] for t in w["top_logprobs"]]


def test_a_mixed_batch_equals_the_sync_engine(pair):
    sync, async_ = pair
    ps = prompts(12)
    plain = sync.generate(ps[:3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop_at = plain[0].completions[0].token_ids[4]  # a token the model picks 5th
    late_ids = plain[1].completions[0].token_ids
    late = late_ids[7]  # first picked 8th: min_tokens=6 suppresses nothing the model picks before
    assert late not in late_ids[:7]
    text = plain[2].completions[0].text
    params = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]),  # stops on a token mid-run
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[late], min_tokens=6),  # suppressed until 6
        SamplingParams(temperature=0, max_tokens=20, stop=[text[len(text) // 2:len(text) // 2 + 3]]),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, presence_penalty=0.8, max_tokens=10, ignore_eos=True),  # does not continue
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=11, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    ]
    before = async_.num_continued_tokens
    want = sync.generate(ps, params)
    got = async_.generate(ps, params)
    assert summary(got) == summary(want)
    assert_logprobs_close(got, want)
    assert [o.completions[0].finish_reason for o in want[:3]] == ["stop", "stop", "stop_string"]  # they did stop
    assert len(want[1].completions[0].token_ids) >= 6
    assert async_.num_continued_tokens - before > 50, "requests must decode before their last token is read"
    assert sync.num_continued_tokens == 0
    for engine in pair:
        assert_idle(engine)


def test_preemption_under_async_scheduling_equals_the_sync_engine(tiny_qwen2_dir):
    sync, async_ = make_engine(tiny_qwen2_dir, False, 20), make_engine(tiny_qwen2_dir, True, 20)
    ps = prompts(6, seed=1, lengths=(30, 45))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want, got = sync.generate(ps, params), async_.generate(ps, params)
    assert summary(got) == summary(want)
    assert async_.scheduler.num_preemptions > 0 and async_.num_continued_tokens > 0
    for engine in (sync, async_):
        assert_idle(engine)


def test_abort_of_a_request_whose_token_is_pending(pair):
    sync, async_ = pair
    ps = prompts(4, seed=2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = sync.generate(ps, params)
    for i, p in enumerate(ps):
        async_.add_request(f"r{i}", p, params)
    finished = {}
    aborted = False
    while async_.has_unfinished():
        for d in async_.step():
            finished.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                finished[d.request_id + ":reason"] = d.finish_reason
        request = async_.scheduler.requests.get("r1")
        if not aborted and request is not None and async_.num_continued_tokens and request.num_output_tokens > 3:
            assert async_._in_flight["r1"] == 1 and request.num_pending_tokens == 1  # its token not read yet
            assert async_.abort_request("r1")
            aborted = True
    assert aborted
    assert finished["r1:reason"] == "abort"
    for i in (0, 2, 3):
        assert finished[f"r{i}"] == want[i].completions[0].token_ids
    assert_idle(async_)


def test_blocks_completed_by_a_pending_token_reach_the_prefix_cache(pair):
    cached = []
    prompt = prompts(1, seed=3, lengths=(20, 20))[0]
    for engine in pair:
        engine.kv.pool.reset_prefix_cache()
        first = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=29, ignore_eos=True))[0]
        again = prompt + first.completions[0].token_ids + [5]
        out = engine.generate([again], SamplingParams(temperature=0, max_tokens=1))[0]
        cached.append(out.num_cached_tokens)
        assert_idle(engine)
    # 20 + 29 tokens were computed (the last sampled token's KV never is): 48 = 3 full blocks
    assert cached == [48, 48]


def test_no_async_scheduling_collects_each_step_first(tiny_qwen2_dir, pair):
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", seed=0, overlap_steps=True,
                                    async_scheduling=False, cache=CacheConfig(block_size=BS, num_blocks=256)))
    assert engine.overlap and not engine.async_scheduling
    ps = prompts(3, seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert summary(engine.generate(ps, params)) == summary(pair[0].generate(ps, params))
    assert engine.num_continued_tokens == 0
    assert_idle(engine)
