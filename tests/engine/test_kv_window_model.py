"""Sliding-window block release end to end (the manager alone: tests/engine/test_kv_window.py): a tiny
Mistral with sliding_window 16 and block size 16 against transformers (greedy, float32) with chunked
prefill, prefix caching and preemption, holding fewer blocks than full attention; and a prefill -> decode
KV transfer of a windowed prompt, pulling only its last window.
"""
import random

import pytest

from engine.block_pool import NULL_BLOCK
from engine.config import SchedulerConfig

E2E_WINDOW = 16
E2E_BLOCK = 16


@pytest.fixture(scope="module")
def windowed_mistral_dir(tmp_path_factory, tokenizer_dir):
    """A tiny random Mistral whose every layer slides over 16 tokens (GQA, odd sizes)."""
    from tests.engine.test_mistral import tiny_mistral
    return tiny_mistral(tmp_path_factory.mktemp("tiny-mistral-window"), tokenizer_dir, E2E_WINDOW)


@pytest.fixture(scope="module")
def full_attention_dir(windowed_mistral_dir, tmp_path_factory):
    """The same weights with the window off (every layer attends to everything): the block-count baseline."""
    import json
    path = tmp_path_factory.mktemp("tiny-mistral-full")
    for item in windowed_mistral_dir.iterdir():
        if item.name != "config.json":
            (path / item.name).symlink_to(item)
    raw = json.loads((windowed_mistral_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
    return path


def e2e_prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49152) for _ in range(40)]  # a common prefix: prefix-cache hits
    return [(shared if i % 2 else []) + [rng.randrange(3, 49152) for _ in range(n - (40 if i % 2 else 0))]
            for i, n in enumerate(lengths)]


def generate_tracking_blocks(engine, prompts, params) -> tuple[list[list[int]], int, list]:
    """Greedy outputs, the most blocks in use after any step, and the outputs (cached token counts)."""
    from engine.outputs import CompletionCollector, RequestOutput
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    collector, peak = CompletionCollector(), 0
    while engine.has_unfinished():
        for delta in engine.step():
            collector.add(delta)
        peak = max(peak, engine.num_kv_blocks_used)
        for request in engine.scheduler.running:  # never a visible key in a released block
            assert engine.kv.window_intact(request.request_id, request.num_computed_tokens)
    outputs = [RequestOutput(rid, list(p), collector.completions(rid), collector.cached_tokens.get(rid, 0))
               for rid, p in zip(ids, prompts, strict=True)]
    return [o.completions[0].token_ids for o in outputs], peak, outputs


def test_windowed_mistral_equals_transformers_and_holds_fewer_blocks(windowed_mistral_dir, full_attention_dir):
    """Chunked prefill (32-token budget), prefix caching on: greedy tokens equal transformers' (whose Mistral
    masks by the window) in a cache of 8 usable blocks that forces preemptions, and in a roomy cache twice
    (the second time from prefix hits), where the prompts hold fewer blocks at their peak than the same
    weights under full attention."""
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from tests.conftest import hf_greedy
    from tests.engine.test_hf_equivalence import GREEDY, NEW_TOKENS
    prompts = e2e_prompts(5, [70, 90, 48, 85, 60])  # 3 to 6 windows long
    expected = hf_greedy(windowed_mistral_dir, prompts, NEW_TOKENS)

    def engine_for(path, num_blocks):
        return LLMEngine(EngineConfig(model=str(path), dtype="float32",
                                      scheduler=SchedulerConfig(max_num_batched_tokens=32),
                                      cache=CacheConfig(block_size=E2E_BLOCK, num_blocks=num_blocks)))

    engine = engine_for(windowed_mistral_dir, 9)
    assert engine.kv.sliding_window == E2E_WINDOW and engine.max_model_len == 8 * E2E_BLOCK
    got, _, _ = generate_tracking_blocks(engine, prompts, GREEDY)
    assert got == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.num_window_released > 0
    assert engine.kv.pool.num_used_blocks == 0 and not engine.kv.block_tables and not engine.has_unfinished()

    roomy, full = engine_for(windowed_mistral_dir, 64), engine_for(full_attention_dir, 64)
    assert full.kv.sliding_window is None
    got, peak, _ = generate_tracking_blocks(roomy, prompts, GREEDY)
    _, full_peak, _ = generate_tracking_blocks(full, prompts, GREEDY)
    assert got == expected and roomy.scheduler.num_preemptions == full.scheduler.num_preemptions == 0
    assert peak < full_peak
    again, _, outputs = generate_tracking_blocks(roomy, prompts, GREEDY)
    assert again == expected
    assert all(o.num_cached_tokens >= E2E_BLOCK * ((len(p) - 1) // E2E_BLOCK) for o, p in zip(outputs, prompts,
                                                                                             strict=True))
    assert roomy.kv.pool.num_used_blocks == 0 and not roomy.kv.block_tables


def test_prefill_to_decode_transfer_of_a_windowed_prompt_pulls_only_the_last_window(windowed_mistral_dir):
    """The prefill engine keeps and ships the prompt's whole table; the decode engine reserves only the
    blocks inside the first token's window (the rest stay the null block), pulls those, and continues as
    one engine would."""
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams as Params
    from kv_transfer import KVLayout, KVTransferConfig
    from tests.engine.test_engine_kv_transfer import finish_on_decode, pull_blocks
    config = EngineConfig(model=str(windowed_mistral_dir), dtype="float32",
                          cache=CacheConfig(block_size=E2E_BLOCK, num_blocks=32),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32))
    prefill, decode = LLMEngine(config), LLMEngine(config)
    prompt = e2e_prompts(9, [83])[0]
    params = Params(temperature=0, max_tokens=20, ignore_eos=True)
    expected = prefill.generate([prompt], params)[0].completions[0].token_ids

    prefill.add_request("p", prompt, Params(temperature=0, max_tokens=2), prefill_only=True)
    while True:
        deltas = prefill.step()
        if deltas:
            break
    first_token, src_table = deltas[0].token_ids[0], deltas[0].kv_block_ids
    assert len(src_table) == 6 and NULL_BLOCK not in src_table  # the prefill side shipped everything
    dst_table, num_local = decode.reserve_kv("d", prompt)
    # the first token's query (83) sees keys 68..83: only blocks 4 and 5 are needed
    assert num_local == 4 and dst_table[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in dst_table[4:]
    assert decode.num_kv_blocks_used == 2

    layout = KVLayout.of_kv_cache(prefill.runner.kv_cache, "tiny-mistral-window")
    moved = pull_blocks(prefill, decode, layout, KVTransferConfig(backend="tcp", host="127.0.0.1"), src_table,
                        dst_table, num_local)
    assert moved == 2 * layout.block_nbytes
    prefill.release_kv("p")
    finish_on_decode(prefill, decode, prompt, params, first_token, expected)
