"""Engine behaviour on the real default model: sampling, stops, n > 1, abort, errors.

Every test using the `engine` fixture runs twice: steps reported as they run, and
overlapped (step N+1 launched before step N is detokenized and reported, as on CUDA)."""
import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import InvalidParameter, SamplingParams
from tests.conftest import step_until_output


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def engine(smollm2_dir, request):
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), dtype="float32", overlap_steps=request.param,
                                    cache=CacheConfig(kv_cache_memory_bytes=256 << 20)))
    assert engine.overlap is request.param
    return engine


@pytest.fixture(scope="module")
def france(engine):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])


def one(engine, prompt, **params):
    return engine.generate([prompt], SamplingParams(**params))[0]


def assert_idle(engine):
    assert not engine.has_unfinished()
    assert engine.kv.pool.num_used_blocks == 0 and not engine.kv.block_tables
    assert not engine._samples and not engine._groups


def test_greedy_answer_and_stop_on_eos(engine, france):
    out = one(engine, france, temperature=0, max_tokens=32)
    c = out.completions[0]
    assert c.text == "The capital of France is Paris."
    assert c.finish_reason == "stop" and c.token_ids[-1] == 2  # EOS kept in ids, not in text
    assert out.usage["prompt_tokens"] == len(france)
    assert_idle(engine)


def test_max_tokens_gives_length(engine, france):
    c = one(engine, france, temperature=0, max_tokens=3).completions[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"


def test_stop_string_is_not_emitted_even_when_streamed(engine, france):
    engine.add_request("s", france, SamplingParams(temperature=0, max_tokens=32, stop=["Paris", "zzz"]))
    streamed, reason = "", None
    while engine.has_unfinished():
        for d in engine.step():
            streamed += d.text
            reason = d.finish_reason or reason
    assert streamed == "The capital of France is "
    assert reason == "stop_string"
    assert_idle(engine)


def test_stop_token_ids_end_generation_including_the_token(engine, france):
    greedy = one(engine, france, temperature=0, max_tokens=8).completions[0].token_ids
    c = one(engine, france, temperature=0, max_tokens=8, stop_token_ids=[greedy[3]]).completions[0]
    assert c.token_ids == greedy[:4] and c.finish_reason == "stop"


def test_min_tokens_suppresses_eos(engine, france):
    c = one(engine, france, temperature=0, max_tokens=40, min_tokens=12).completions[0]
    assert len(c.token_ids) >= 12
    assert 2 not in c.token_ids[:11]
    assert c.text.startswith("The capital of France is Paris")


def test_ignore_eos_runs_to_max_tokens(engine, france):
    c = one(engine, france, temperature=0, max_tokens=20, ignore_eos=True).completions[0]
    assert len(c.token_ids) == 20 and c.finish_reason == "length" and 2 in c.token_ids


def test_seed_reproducible_whatever_the_batch(engine, france):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = engine.generate([france], params)[0].completions[0].token_ids
    other = SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True)
    engine.add_request("x", france[:20], other)
    engine.add_request("y", list(range(100, 180)), other)
    batched = engine.generate([france], params, request_ids=["z"])[0].completions[0].token_ids
    assert batched == alone
    different = engine.generate([france], SamplingParams(temperature=1.0, max_tokens=16, seed=99,
                                                         ignore_eos=True))[0].completions[0].token_ids
    assert different != alone
    assert_idle(engine)


def test_top_k_one_and_tiny_top_p_equal_greedy(engine, france):
    greedy = one(engine, france, temperature=0, max_tokens=10, ignore_eos=True).completions[0].token_ids
    assert one(engine, france, temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True,
               seed=3).completions[0].token_ids == greedy
    assert one(engine, france, temperature=1.0, top_p=0.01, max_tokens=10, ignore_eos=True,
               seed=3).completions[0].token_ids == greedy


def test_logprobs(engine, france):
    c = one(engine, france, temperature=0, max_tokens=5, logprobs=3).completions[0]
    assert len(c.logprobs) == 5
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert entry["token_id"] == token
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token_id"] == token  # greedy picks the top one
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
        lps = [t["logprob"] for t in entry["top_logprobs"]]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)


def test_parallel_samples_share_prompt_and_match_single_requests(engine, france):
    """Sample i of n equals a lone request with seed + i: copy-on-write kept each KV intact."""
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=500, n=3, ignore_eos=True)
    out = engine.generate([france], params)[0]
    assert [c.index for c in out.completions] == [0, 1, 2]
    assert out.usage["completion_tokens"] == 36
    for i, c in enumerate(out.completions):
        lone = one(engine, france, temperature=1.0, max_tokens=12, seed=500 + i, ignore_eos=True)
        assert c.token_ids == lone.completions[0].token_ids
    assert len({tuple(c.token_ids) for c in out.completions}) > 1
    assert_idle(engine)


def test_streamed_deltas_concatenate_to_final_text(engine, france):
    engine.add_request("d", france, SamplingParams(temperature=0.8, seed=5, max_tokens=40))
    pieces, ids = [], []
    while engine.has_unfinished():
        for d in engine.step():
            pieces.append(d.text)
            ids += d.token_ids
    assert len(pieces) > 5
    assert "".join(pieces) == engine.tokenizer.decode(ids)


def test_abort_mid_generation_frees_everything(engine, france):
    engine.add_request("a", france, SamplingParams(temperature=0, max_tokens=50, n=2, seed=1))
    for _ in range(4):
        engine.step()
    assert engine.kv.pool.num_used_blocks > 0
    assert engine.abort_request("a")
    deltas = engine.step()
    assert {d.finish_reason for d in deltas} == {"abort"}
    assert_idle(engine)
    assert not engine.abort_request("a")


def test_bad_requests_are_refused_with_the_field(engine):
    with pytest.raises(InvalidParameter) as e:
        engine.add_request("e1", [], SamplingParams())
    assert e.value.field == "input"
    with pytest.raises(InvalidParameter) as e:
        engine.add_request("e2", [1, 49152], SamplingParams())
    assert e.value.field == "token_ids"
    with pytest.raises(InvalidParameter) as e:
        engine.add_request("e3", [5] * engine.max_model_len, SamplingParams())
    assert e.value.field == "input"
    for field, value in [("temperature", -1), ("top_p", 0), ("top_k", -5), ("max_tokens", 0),
                         ("n", 0), ("logprobs", 99), ("stop", [""]), ("min_tokens", 100)]:
        with pytest.raises(InvalidParameter) as e:
            SamplingParams(**{field: value})
        assert e.value.field == field
    assert_idle(engine)


def test_max_model_len_is_capped_by_kv_capacity(smollm2_dir):
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), dtype="float32", cache=CacheConfig(num_blocks=4)))
    assert engine.max_model_len == 64
    out = engine.generate([list(range(100, 160))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert out[0].completions[0].finish_reason == "length"
    assert len(out[0].completions[0].token_ids) == 4
    assert_idle(engine)


def test_decode_role_continues_from_kv_computed_by_another_engine(tiny_qwen2_dir, engine, france):
    """Prefill on one engine, copy its KV blocks into another, continue there: same tokens as one engine
    (in this `engine`'s overlap mode). Three engines on the tiny checkpoint (same tokenizer as SmolLM2)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tiny(**kwargs):
        return LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32",
                                      cache=CacheConfig(kv_cache_memory_bytes=64 << 20), **kwargs))

    expected = tiny(overlap_steps=engine.overlap).generate([france], params)[0].completions[0].token_ids
    prefill = tiny()
    prefill.add_request("p", france, SamplingParams(temperature=0, max_tokens=2))
    first_token = step_until_output(prefill)[0].token_ids[0]  # the prompt's KV computed, first token sampled
    src_table = list(prefill.kv.block_table("p"))
    assert first_token == expected[0]
    decode = tiny()
    decode.generate([france], SamplingParams(temperature=0, max_tokens=1))  # caches its 2 full blocks locally
    table, num_local = decode.reserve_kv("d", france)
    assert num_local == 2 and len(table) == len(src_table) == -(-len(france) // 16)
    missing = table[num_local:]
    decode.runner.kv_cache[missing] = 0  # a freed block may still hold this KV: only the copy may bring it
    decode.runner.kv_cache[missing] = prefill.runner.kv_cache[src_table[num_local:]]  # "the transfer"
    decode.add_request("d", france, params, first_token_id=first_token)
    tokens = [first_token]
    while decode.has_unfinished():
        tokens += [t for d in decode.step() for t in d.token_ids]
    assert tokens == expected
    assert decode.kv.pool.num_used_blocks == 0


def test_decode_role_request_finished_by_its_first_token(engine, france):
    engine.reserve_kv("one", france)
    engine.add_request("one", france, SamplingParams(temperature=0, max_tokens=1), first_token_id=504)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert [(d.request_id, d.token_ids, d.finish_reason) for d in deltas] == [("one", [], "length")]
    assert_idle(engine)


def test_reserved_kv_is_released_when_it_never_arrives(engine, france):
    table, _ = engine.reserve_kv("r", france)
    assert engine.kv.pool.num_used_blocks == len(table)
    engine.release_kv("r")
    assert_idle(engine)


def test_token_ids_beside_the_prompt_are_checked_against_the_vocabulary(engine, france):
    """stop_token_ids / first_token_id index the logits: out of range they must be refused, not
    fail the batch (IndexError on CPU, a device-side assert that kills a CUDA worker)."""
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidParameter) as e:
        engine.add_request("v1", france, SamplingParams(stop_token_ids=[vocab]))
    assert e.value.field == "stop_token_ids"
    with pytest.raises(InvalidParameter) as e:
        engine.add_request("v2", france, SamplingParams(max_tokens=2), first_token_id=vocab + 5,
                           recompute_prompt=True)
    assert e.value.field == "first_token_id"
    engine.reserve_kv("v3", france)
    with pytest.raises(InvalidParameter) as e:
        engine.add_request("v3", france, SamplingParams(max_tokens=2), first_token_id=-1)
    assert e.value.field == "first_token_id"
    assert engine.abort_request("v3")  # abort frees the reserved blocks too
    assert_idle(engine)


def test_seed_and_stop_bounds():
    from engine.sampling_params import MAX_SEED
    SamplingParams(seed=MAX_SEED)
    SamplingParams(seed=MAX_SEED - 3, n=4)
    for kwargs in [{"seed": MAX_SEED - 2, "n": 4}, {"seed": -1}, {"seed": 2**64}]:
        with pytest.raises(InvalidParameter) as e:
            SamplingParams(**kwargs)
        assert e.value.field == "seed"
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(stop=["x" * 10_000])
    assert e.value.field == "stop"
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(stop_token_ids=list(range(10_000)))
    assert e.value.field == "stop_token_ids"
