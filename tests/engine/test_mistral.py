"""Mistral (the Llama decoder under `MistralForCausalLM`) against transformers' own MistralForCausalLM:
a tiny random checkpoint (GQA, odd sizes) gives transformers' greedy tokens (fp32), plain and in chunks,
without a sliding window and with one (Mistral v0.1's: every layer slides) much shorter than the prompts,
also from the prefix cache; a layer type the engine does not know is refused naming it."""
import json
import random

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.model.model_config import ModelConfig
from tests.conftest import hf_greedy, perturb_norms_and_biases, save_tiny_checkpoint
from tests.engine.test_hf_equivalence import GREEDY, NEW_TOKENS, assert_no_leak, run

CHUNK = 32


def tiny_mistral(path, tokenizer_dir, sliding_window: int | None = None, seed: int = 77):
    """A tiny random Mistral (GQA 5:1, odd sizes); with `sliding_window`, every layer slides (Mistral v0.1)."""
    from transformers import MistralConfig, MistralForCausalLM
    config = MistralConfig(vocab_size=49152, hidden_size=80, intermediate_size=104, num_hidden_layers=2,
                           num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=1024,
                           rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.15,
                           rms_norm_eps=1e-5, sliding_window=sliding_window, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(seed)
    model = MistralForCausalLM(config)
    perturb_norms_and_biases(model)
    return save_tiny_checkpoint(model, path, tokenizer_dir)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, tokenizer_dir):
    return tiny_mistral(tmp_path_factory.mktemp("tiny-mistral"), tokenizer_dir)


WINDOW = 24


@pytest.fixture(scope="module")
def sliding_mistral_dir(tmp_path_factory, tokenizer_dir):
    return tiny_mistral(tmp_path_factory.mktemp("tiny-mistral-sliding"), tokenizer_dir, WINDOW, seed=78)


@pytest.fixture(scope="module")
def sliding_case(sliding_mistral_dir):
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3 * WINDOW, 150))] for _ in range(4)]
    prompts += [prompts[0][:70] + [9] * 30, [11] * 5]  # a shared prefix; one prompt inside the window
    return prompts, hf_greedy(sliding_mistral_dir, prompts, NEW_TOKENS)


@pytest.mark.parametrize("variant", ["plain", "chunked"])
def test_tiny_mistral_equals_transformers(mistral_dir, variant):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 120))] for _ in range(5)]
    expected = hf_greedy(mistral_dir, prompts, NEW_TOKENS)
    scheduler = SchedulerConfig(max_num_batched_tokens=CHUNK) if variant == "chunked" else SchedulerConfig()
    engine, got, _ = run(mistral_dir, prompts, scheduler=scheduler, cache=CacheConfig(enable_prefix_caching=False))
    assert type(engine.runner.model).__module__ == "engine.model.llama"
    assert got == expected
    assert_no_leak(engine)


@pytest.mark.parametrize("variant", ["plain", "chunked", "cached"])
def test_tiny_mistral_with_a_sliding_window_equals_transformers(sliding_mistral_dir, sliding_case, variant):
    """Prompts several windows long, the new tokens past them: every layer attends only its last 24 keys."""
    prompts, expected = sliding_case
    kwargs = {"plain": {"cache": CacheConfig(enable_prefix_caching=False)},
              "chunked": {"scheduler": SchedulerConfig(max_num_batched_tokens=20),  # chunks shorter than the window
                          "cache": CacheConfig(enable_prefix_caching=False)},
              "cached": {"scheduler": SchedulerConfig(max_num_batched_tokens=CHUNK)}}[variant]
    engine, got, _ = run(sliding_mistral_dir, prompts, **kwargs)
    model = engine.runner.model
    assert model.config.all_sliding and [a.window for a in model.layer_attention] == [WINDOW, WINDOW]
    if variant == "cached":  # the same prompts again: their full blocks now come from the prefix cache
        outputs = engine.generate(prompts, GREEDY)
        assert sum(o.num_cached_tokens for o in outputs) >= sum(16 * ((len(p) - 1) // 16) for p in prompts)
        got = [o.completions[0].token_ids for o in outputs]
    assert got == expected
    assert_no_leak(engine)


def test_the_window_changes_the_tokens(sliding_mistral_dir, sliding_case, tmp_path):
    """The same weights without the window give other tokens: the equality above depends on the window."""
    for file in sliding_mistral_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    raw = json.loads((sliding_mistral_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
    prompts, expected = sliding_case
    _, got, _ = run(tmp_path, prompts, cache=CacheConfig(enable_prefix_caching=False))
    assert got != expected


def test_an_unknown_layer_type_is_refused_by_name(mistral_dir, tmp_path):
    raw = json.loads((mistral_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "sliding_window": 64,
                                                      "layer_types": ["sliding_attention", "chunked_attention"]}))
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        ModelConfig.from_dir(tmp_path)
