"""Mistral (the Llama decoder under `MistralForCausalLM`) against transformers' own MistralForCausalLM:
a tiny random checkpoint (GQA, odd sizes, no sliding window) gives transformers' greedy tokens (fp32),
plain and in chunks; a checkpoint with a sliding window is refused naming it."""
import json
import random

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.model.model_config import ModelConfig
from tests.conftest import hf_greedy, perturb_norms_and_biases, save_tiny_checkpoint
from tests.engine.test_hf_equivalence import NEW_TOKENS, assert_no_leak, run

CHUNK = 32


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, tokenizer_dir):
    from transformers import MistralConfig, MistralForCausalLM
    config = MistralConfig(vocab_size=49152, hidden_size=80, intermediate_size=104, num_hidden_layers=2,
                           num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=1024,
                           rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.15,
                           rms_norm_eps=1e-5, sliding_window=None, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(77)
    model = MistralForCausalLM(config)
    perturb_norms_and_biases(model)
    return save_tiny_checkpoint(model, tmp_path_factory.mktemp("tiny-mistral"), tokenizer_dir)


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


def test_a_sliding_window_is_refused_by_name(mistral_dir, tmp_path):
    raw = json.loads((mistral_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "sliding_window": 64}))
    with pytest.raises(ValueError, match="sliding_window=64"):
        ModelConfig.from_dir(tmp_path)
