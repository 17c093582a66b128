"""Pipeline parallelism (engine/parallel/pipeline.py): the layer split, then whole engines against one stage.

The engine tests start real stage processes (gloo on CPU: the hidden states and logits go point to point)
and compare tokens with a one-process engine (float32), greedy and seeded: plain requests, chunked prefill,
preemption, n=3 (copy-on-write of a shared block, which every stage applies to its own layers' KV), two
and three stages on a 4-layer Qwen2 (untied head), two stages of two tensor-parallel ranks each, three
stages with an uneven split on SmolLM2 (tied embeddings: the last stage holds its own copy as the LM head).
"""
import argparse

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.kv_offload.config import OffloadConfig
from engine.llm_engine import LLMEngine
from engine.parallel.pipeline import stage_layers
from engine.sampling_params import SamplingParams
from tests.engine.test_tensor_parallel import generate as tp_generate
from tests.engine.test_tensor_parallel import tiny_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7)


def test_stage_layers_split_evenly_with_the_remainder_first_or_as_given():
    assert stage_layers(30, 1) == [(0, 30)]
    assert stage_layers(30, 2) == [(0, 15), (15, 30)]
    assert stage_layers(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert stage_layers(30, 3, (9, 11, 10)) == [(0, 9), (9, 20), (20, 30)]
    for bad in [(9, 11), (10, 10, 11), (0, 15, 15)]:
        with pytest.raises(ValueError, match="pp_layer_partition"):
            stage_layers(30, 3, bad)
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        stage_layers(2, 3)


def generate(model_dir, prompts, pp, params, partition=None, tp=1, **overrides):
    """Every completion's tokens (n of them per prompt), from an engine with `pp` stages (of `tp` ranks)."""
    return tp_generate(model_dir, prompts, tp, params, pp=pp, partition=partition, **overrides)


VARIANTS = {
    "chunked": {"scheduler": SchedulerConfig(max_num_batched_tokens=32)},  # prompts span several steps
    "preempt": {"cache": CacheConfig(num_blocks=14, enable_prefix_caching=False)},  # 224 tokens for 9 requests
}


SLOW = pytest.mark.slow  # stage processes spawned per engine: `make test-fast` keeps one case of them


@pytest.mark.parametrize("variant,pp,tp", [("chunked", 2, 1), pytest.param("preempt", 2, 1, marks=SLOW),
                                           pytest.param("chunked", 3, 1, marks=SLOW),
                                           pytest.param("preempt", 3, 1, marks=SLOW),
                                           pytest.param("chunked", 2, 2, marks=SLOW)])  # plain steps are in both
def test_stages_equal_one_process_on_a_tiny_qwen2(tiny_qwen2_4l_dir, variant, pp, tp):
    prompts = tiny_prompts()
    # Two prompts fork into 3 samples after their prompt (copy-on-write of the shared partial block); two are
    # sampled with a seed, the rest greedy.
    forks = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=3)
    params = [GREEDY] * (len(prompts) - 4) + [SEEDED] * 2 + [forks] * 2
    one, expected = generate(tiny_qwen2_4l_dir, prompts, 1, params, **dict(VARIANTS[variant]))
    staged, got = generate(tiny_qwen2_4l_dir, prompts, pp, params, tp=tp, **dict(VARIANTS[variant]))
    assert [len(c) for c in got] == [1] * (len(prompts) - 2) + [3, 3]
    first = staged.runner.model
    assert len(first.layers) == 4 // pp + (1 if pp == 3 else 0) and staged.runner.kv_cache.shape[1] == len(first.layers)
    assert first.embed is not None and first.lm_head is None  # the LM head lives on the last stage
    assert first.config.num_kv_heads == 2 // tp and staged.runner.kv_cache.shape[4] == 2 // tp  # its heads
    if variant == "preempt":
        assert staged.scheduler.num_preemptions > 0 and one.scheduler.num_preemptions > 0
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} differs"


@SLOW
def test_three_uneven_stages_equal_one_process_on_smollm2(smollm2_dir):
    from engine.tokenizer import Tokenizer
    tokenizer = Tokenizer(smollm2_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name three colours.")]
    prompts.append(tokenizer.encode("The history of computing spans centuries, from the abacus to"))
    params = [GREEDY, SEEDED, GREEDY]
    _, expected = generate(smollm2_dir, prompts, 1, params)
    staged, got = generate(smollm2_dir, prompts, 3, params, partition=(9, 11, 10))
    assert len(staged.runner.model.layers) == 9
    assert got == expected


def test_a_dead_stage_is_an_error_not_a_hang(tiny_qwen2_4l_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_4l_dir), dtype="float32", pipeline_parallel_size=2,
                                    cache=CacheConfig(num_blocks=64)))
    try:
        assert engine.generate([[5, 6, 7]], GREEDY)[0].completions[0].token_ids
        engine.executor.procs[1].kill()
        engine.executor.procs[1].join()
        with pytest.raises(RuntimeError, match="pipeline stage 1 exited"):
            engine.generate([[5, 6, 7, 8] * 10], GREEDY)
    finally:
        engine.shutdown()


def test_what_is_not_supported_yet_is_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        EngineConfig(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="one layer count per pipeline stage"):
        EngineConfig(pipeline_parallel_size=2, pp_layer_partition=(30,))
    with pytest.raises(ValueError, match="KV offload tiers with pipeline_parallel_size > 1"):
        EngineConfig(pipeline_parallel_size=2, cache=CacheConfig(offload=OffloadConfig(cpu_bytes=1 << 20)))


def test_cli_flags_reach_the_engine_config():
    from pdserve.cli import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--pipeline-parallel-size", "2", "--pp-layer-partition",
                                                        "1, 3"]))
    assert (config.pipeline_parallel_size, config.pp_layer_partition) == (2, (1, 3))
    assert engine_config_from_args(parser.parse_args([])).pipeline_parallel_size == 1


def test_only_the_argmax_of_plain_greedy_rows_crosses_from_the_last_stage(tiny_qwen2_4l_dir):
    """Logprobs, prompt logprobs, penalties and seeded rows need their whole logits; the argmax of a plain greedy
    row is enough. Both kinds in one batch equal one process: tokens and the logprobs reported."""
    import torch

    from engine.sample_state import whole_logit_rows
    prompts = tiny_prompts()[:5]
    params = [GREEDY, SEEDED, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)]
    outputs = []
    for pp in (1, 2):
        engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_4l_dir), dtype="float32", pipeline_parallel_size=pp))
        try:
            outputs.append(engine.generate(prompts, params))
        finally:
            engine.shutdown()
    for one, staged in zip(*outputs, strict=True):
        [a], [b] = one.completions, staged.completions
        assert a.token_ids == b.token_ids
        assert close(a.logprobs, b.logprobs) and close(a.prompt_logprobs, b.prompt_logprobs)
    assert outputs[1][2].completions[0].logprobs and outputs[1][3].completions[0].prompt_logprobs
    # The rows: a chunk without sampling, plain greedy, and a row wanting logprobs.
    item = lambda rid, spec=(): argparse.Namespace(  # noqa: E731
        request=argparse.Namespace(request_id=rid, params=params[0] if rid != "lp" else params[2],
                                   pending_forks=0), spec_token_ids=list(spec))
    sample = argparse.Namespace(grammar=None, context=None)
    plan = [(item("chunk"), [], 0, 0), (item("g"), [sample], 1, 0), (item("lp"), [sample], 1, 0),
            (item("spec", [5, 6]), [sample], 3, 0)]
    rows = whole_logit_rows(plan, {"g": sample, "lp": sample, "spec": sample}, lambda request: [])
    assert rows.tolist() == [False, True, True, True, True] and rows.dtype == torch.bool


def close(x, y) -> bool:
    """Equal structures, floats within 1e-4 (logprobs of two processes' float32 sums)."""
    if isinstance(x, float) or isinstance(y, float):
        return isinstance(x, int | float) and isinstance(y, int | float) and abs(x - y) < 1e-4
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(close(x[k], y[k]) for k in x)
    if isinstance(x, list):
        return isinstance(y, list) and len(x) == len(y) and all(close(a, b) for a, b in zip(x, y, strict=True))
    return x == y


@pytest.mark.parametrize("microbatches", [0, 1], ids=["one-per-stage", "one-step-at-a-time"])
def test_steps_in_flight_equal_one_process(tiny_qwen2_4l_dir, microbatches):
    """By default a 2-stage engine keeps two steps of different requests in flight (the first stage computes the
    next while the last finishes the previous); with pipeline_microbatches=1 one at a time. Same tokens either
    way, as one process's."""
    prompts = tiny_prompts()
    params = [GREEDY] * (len(prompts) - 2) + [SEEDED] * 2
    _, expected = generate(tiny_qwen2_4l_dir, prompts, 1, params)
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_4l_dir), dtype="float32", pipeline_parallel_size=2,
                                    pipeline_microbatches=microbatches, cache=CacheConfig(num_blocks=512)))
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(str(i), prompt, p)
        tokens: dict[str, list[int]] = {}
        in_flight, collect = [], engine._collect

        def counted_collect():  # how many steps are in flight when one is collected
            in_flight.append(len(engine._launched))
            return collect()
        engine._collect = counted_collect
        while engine.has_unfinished():
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        most_in_flight = max(in_flight)
        assert not engine.has_unfinished() and engine.kv.pool.num_used_blocks == 0
    finally:
        engine.shutdown()
    assert [tokens[str(i)] for i in range(len(prompts))] == [c[0] for c in expected]
    assert most_in_flight == (2 if microbatches == 0 else 1)
