"""Structured outputs in the engine: every constrained output parses and validates; greedy constrained output
is the same with n-gram or draft speculation, after a hand-off (first token drawn elsewhere) and after a
migration (resumed tokens); a token the grammar forbids fails that sample only; bad constraints name their field.

A tiny random-weight model with SmolLM2's tokenizer: its outputs wander as far as the grammar lets them,
which is what the constraint must hold against (the default model is exercised through the cluster)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.sample_state import bad_words_token_ids
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.structured_output.spec import StructuredOutput

SCHEMAS = json.loads((Path(__file__).parents[1] / "data/json_schemas.json").read_text())
PROMPT = "Answer in JSON: describe the thing."


def make_engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", overlap_steps=False,
                                  cache=CacheConfig(kv_cache_memory_bytes=64 << 20), **kwargs))


@pytest.fixture(scope="module")
def engine(tiny_qwen2_dir):
    engine = make_engine(tiny_qwen2_dir)
    yield engine
    engine.shutdown()


def prompt_ids(engine) -> list[int]:
    return engine.tokenizer.encode(PROMPT)


def run(engine, params: list[SamplingParams], prompt=None):
    outs = engine.generate([prompt or prompt_ids(engine)] * len(params), params)
    return [o.completions[0] for o in outs]


def test_200_seeded_samples_of_10_schemas_all_parse_and_validate(engine):
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=300,
                             structured_output=StructuredOutput.json_schema(schema))
              for schema in SCHEMAS.values() for seed in range(20)]
    outputs = run(engine, params)
    for (name, schema), start in zip(SCHEMAS.items(), range(0, 200, 20), strict=True):
        for completion in outputs[start:start + 20]:
            assert completion.finish_reason == "stop", (name, completion.text)
            jsonschema.validate(json.loads(completion.text), schema)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks


def test_regex_choice_and_grammars_hold_for_seeded_samples(engine):
    """(Any JSON object is checked on the default model, tests/cluster/test_structured_output_cluster.py:
    a random model's free-form keys need not end within any budget.)"""
    regex = r"[A-Z]{2}-[0-9]{2,4}( (ok|fail))?"
    choices = ["red", "green", "blue", "light blue"]
    lark = 'start: "x=" NUM (";" "x=" NUM)?\nNUM: /[0-9]{1,3}/'
    gbnf = 'root ::= "(" [a-c]+ ")"'
    kinds = [(StructuredOutput.regex(regex), lambda t: re.fullmatch(regex, t)),
             (StructuredOutput.choice(choices), lambda t: t in choices),
             (StructuredOutput.grammar(lark), lambda t: re.fullmatch(r"x=[0-9]{1,3}(;x=[0-9]{1,3})?", t)),
             (StructuredOutput.grammar(gbnf), lambda t: re.fullmatch(r"\([a-c]+\)", t))]
    for spec, holds in kinds:
        outputs = run(engine, [SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_output=spec)
                               for s in range(10)])
        for completion in outputs:
            assert completion.finish_reason == "stop" and holds(completion.text), (spec.kind, completion.text)


def test_parallel_samples_each_follow_the_grammar_with_a_matcher_of_their_own(engine):
    spec = StructuredOutput.json_schema(SCHEMAS["order"])
    out = engine.generate([prompt_ids(engine)], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=300,
                                                               structured_output=spec))[0]
    texts = [c.text for c in out.completions]
    assert len(set(texts)) > 1
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS["order"])


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_constrained_output_is_the_same_with_speculation(engine, tiny_qwen2_dir, method):
    specs = [StructuredOutput.json_schema(SCHEMAS[name]) for name in ("order", "address_book", "matrix")]
    specs.append(StructuredOutput.regex(r"(ab|cd){3,6}"))
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_output=s) for s in specs]
    plain = run(engine, params)
    speculative = make_engine(tiny_qwen2_dir, speculative=SpeculativeConfig(
        method=method, num_speculative_tokens=3, model=str(tiny_qwen2_dir) if method == "draft" else None))
    try:
        assert [c.token_ids for c in run(speculative, params)] == [c.token_ids for c in plain]
        assert speculative.num_spec_draft_tokens > 0
    finally:
        speculative.shutdown()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_hand_off_or_a_migration_continues_the_grammar_exactly(engine, tiny_qwen2_dir, temperature):
    """The first token drawn elsewhere (decode role, prompt recomputed) and tokens resumed after a migration
    advance a fresh matcher: the rest equals the unbroken run, greedy and seeded."""
    spec = StructuredOutput.json_schema(SCHEMAS["address_book"])
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=200, structured_output=spec)
    whole = run(engine, [params])[0].token_ids
    prompt = prompt_ids(engine)
    engine.add_request("handed-off", prompt, params, first_token_id=whole[0], recompute_prompt=True)
    engine.add_request("migrated", prompt, params, resume_token_ids=whole[:7])
    tokens = {"handed-off": [whole[0]], "migrated": list(whole[:7])}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    assert tokens == {"handed-off": whole, "migrated": whole}


def test_a_token_the_grammar_forbids_fails_that_sample_only(engine):
    spec = StructuredOutput.json_schema(SCHEMAS["person"])
    bad = engine.tokenizer.encode("hello")  # not the start of a JSON object
    engine.add_request("bad", prompt_ids(engine), SamplingParams(max_tokens=50, structured_output=spec),
                       resume_token_ids=bad)
    engine.add_request("good", prompt_ids(engine), SamplingParams(temperature=0, max_tokens=100,
                                                                  structured_output=spec))
    reasons = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
    assert reasons == {"bad": "error", "good": "stop"}
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks


@pytest.mark.parametrize(("spec", "field"), [
    (lambda: StructuredOutput("json_schema", "{not json"), "structured_output.json_schema"),
    (lambda: StructuredOutput("json_schema", "[1, 2]"), "structured_output.json_schema"),
    (lambda: StructuredOutput.regex(""), "structured_output.regex"),
    (lambda: StructuredOutput.choice([]), "structured_output.choice"),
    (lambda: StructuredOutput("xml", "<a/>"), "structured_output"),
])
def test_malformed_constraints_name_their_field(spec, field):
    with pytest.raises(InvalidParameter) as err:
        spec()
    assert err.value.field == field


@pytest.mark.parametrize(("spec", "field"), [
    (StructuredOutput.regex("a(b"), "structured_output.regex"),
    (StructuredOutput.grammar("start: undefined_rule"), "structured_output.grammar"),
    (StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}}),
     "structured_output.json_schema"),
])
def test_constraints_that_do_not_compile_fail_the_request_and_leave_nothing(engine, spec, field):
    with pytest.raises(InvalidParameter) as err:
        engine.add_request("broken", prompt_ids(engine), SamplingParams(structured_output=spec))
    assert err.value.field == field and "does not compile" in str(err.value)
    assert not engine.has_unfinished()
    engine.add_request("broken", prompt_ids(engine), SamplingParams(max_tokens=2))  # the id is free again
    while engine.has_unfinished():
        engine.step()


def test_penalties_bias_and_bad_words_change_greedy_output(engine):
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run(engine, [base])[0].token_ids
    top = max(set(plain), key=plain.count)
    word = next(w for t in sorted(set(plain), key=plain.count, reverse=True)  # a token that is a word of its own
                if [t] in bad_words_token_ids(engine.tokenizer, [w := engine.tokenizer.decode([t])]))
    changed = {
        "repetition_penalty": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=2.0),
        "frequency_penalty": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0),
        "logit_bias": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={top: -100.0}),
        "bad_words": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=[word]),
    }
    outputs = dict(zip(changed, run(engine, list(changed.values())), strict=True))
    for name, completion in outputs.items():
        assert completion.token_ids != plain, name
    assert top not in outputs["logit_bias"].token_ids
    assert not set(outputs["bad_words"].token_ids) & {ids[0] for ids in bad_words_token_ids(engine.tokenizer, [word])
                                                      if len(ids) == 1}
    assert outputs["frequency_penalty"].token_ids.count(top) < plain.count(top)
