"""Qwen3 dense (engine/model/qwen3.py) against transformers' own Qwen3ForCausalLM, and the registry's refusals.

A tiny random Qwen3 (odd sizes, GQA 6:2, head_dim 16 where hidden/heads is 12, random q_norm/k_norm
weights so that mixing them up or skipping them changes the tokens) gives transformers' greedy tokens
(fp32) token for token: plain, in chunks, from the prefix cache, with 2 tensor-parallel ranks, with the
fused CPU ops and without them, and with q/k/v biases when config.json asks for them; with sliding-window
layers from `max_window_layers` on (full and windowed layers in one model).
"""
import json
import random
import shutil

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.model.model_config import ModelConfig
from tests.conftest import assert_equal, hf_greedy, perturb_norms_and_biases, save_tiny_checkpoint
from tests.engine.test_hf_equivalence import GREEDY, NEW_TOKENS, assert_no_leak, run
from tests.engine.test_tensor_parallel import generate

CHUNK = 32


def tiny_qwen3(path, tokenizer_dir, **overrides):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(**{**dict(vocab_size=49152, hidden_size=72, intermediate_size=100, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
                                   initializer_range=0.15, rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1),
                            **overrides})
    torch.manual_seed(4321)
    model = Qwen3ForCausalLM(config)
    perturb_norms_and_biases(model)
    return save_tiny_checkpoint(model, path, tokenizer_dir)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tokenizer_dir):
    return tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), tokenizer_dir)


@pytest.fixture(scope="module")
def qwen3_case(qwen3_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 150))] for _ in range(6)]
    prompts += [prompts[0][:40] + [5] * k for k in (10, 50)]  # shared prefixes
    prompts.append([7])
    assert max(map(len, prompts)) > 3 * CHUNK
    return prompts, hf_greedy(qwen3_dir, prompts, NEW_TOKENS)



@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("variant", ["plain", "chunked", "cached"])
def test_tiny_qwen3_equals_transformers(qwen3_dir, qwen3_case, variant, fused, monkeypatch):
    monkeypatch.setenv("PDSERVE_FUSED", fused)
    prompts, expected = qwen3_case
    kwargs = {"plain": {"cache": CacheConfig(enable_prefix_caching=False)},
              "chunked": {"scheduler": SchedulerConfig(max_num_batched_tokens=CHUNK),
                          "cache": CacheConfig(enable_prefix_caching=False)},
              "cached": {}}[variant]
    engine, got, _ = run(qwen3_dir, prompts, **kwargs)
    model = engine.runner.model
    assert type(model).__module__ == "engine.model.qwen3" and model.config.head_dim == 16
    assert (model.fused is not None) == (fused == "1")
    if variant == "cached":  # the same prompts again: their full blocks now come from the cache
        outputs = engine.generate(prompts, GREEDY)
        assert sum(o.num_cached_tokens for o in outputs) >= sum(16 * ((len(p) - 1) // 16) for p in prompts)
        got = [o.completions[0].token_ids for o in outputs]
    assert_equal(got, expected)
    assert_no_leak(engine)


def test_tiny_qwen3_two_ranks_equal_transformers(qwen3_dir, qwen3_case):
    prompts, expected = qwen3_case
    engine, got = generate(qwen3_dir, prompts, 2, GREEDY, scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    local = engine.runner.model.config
    assert (local.num_heads, local.num_kv_heads, local.head_dim) == (3, 1, 16)  # this rank's heads, whole
    assert engine.runner.model.layers[0].q_norm.shape == (16,)  # replicated, not sharded
    assert_equal([c[0] for c in got], expected)


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_with_attention_bias_equals_transformers(tmp_path, tokenizer_dir, tp):
    """attention_bias: q/k/v biases (column-parallel: sliced) and o_proj's (row-parallel: added once)."""
    path = tiny_qwen3(tmp_path / "biased", tokenizer_dir, attention_bias=True)
    prompts = [[11, 400, 9000, 77] * 9, [3, 5]]
    engine, got = generate(path, prompts, tp, GREEDY, cache=CacheConfig(num_blocks=64, enable_prefix_caching=False))
    assert engine.runner.model.config.qkv_bias and engine.runner.model.layers[0].o_proj.bias is not None
    assert_equal([c[0] for c in got], hf_greedy(path, prompts, NEW_TOKENS))


def test_an_unsupported_architecture_is_refused_by_name(tmp_path, qwen3_dir):
    config = json.loads((qwen3_dir / "config.json").read_text())
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture \['DeepseekV3ForCausalLM'\]; supported: .*"
                                         r"Qwen3ForCausalLM"):
        ModelConfig.from_dir(tmp_path)


@pytest.fixture(scope="module")
def sliding_qwen3(tmp_path_factory, tokenizer_dir, qwen3_case):
    """use_sliding_window with max_window_layers 1: layer 0 attends everything, layers 1 and 2 their last 16 keys."""
    path = tiny_qwen3(tmp_path_factory.mktemp("sliding"), tokenizer_dir, num_hidden_layers=3,
                      use_sliding_window=True, sliding_window=16, max_window_layers=1)
    return path, hf_greedy(path, qwen3_case[0], NEW_TOKENS)


@pytest.mark.parametrize("variant", ["plain", "chunked", "cached"])
def test_qwen3_with_sliding_window_layers_equals_transformers(sliding_qwen3, qwen3_case, variant):
    """A step mixes full and windowed layers; prompts up to 150 tokens, the window 16."""
    path, expected = sliding_qwen3
    prompts = qwen3_case[0]
    kwargs = {"plain": {"cache": CacheConfig(enable_prefix_caching=False)},
              "chunked": {"scheduler": SchedulerConfig(max_num_batched_tokens=CHUNK),
                          "cache": CacheConfig(enable_prefix_caching=False)},
              "cached": {}}[variant]
    engine, got, _ = run(path, prompts, **kwargs)
    model = engine.runner.model
    assert model.config.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert [a.window for a in model.layer_attention] == [None, 16, 16]
    if variant == "cached":
        outputs = engine.generate(prompts, GREEDY)
        assert sum(o.num_cached_tokens for o in outputs) >= sum(16 * ((len(p) - 1) // 16) for p in prompts)
        got = [o.completions[0].token_ids for o in outputs]
    assert_equal(got, expected)
    assert_no_leak(engine)


def test_qwen3_an_unknown_layer_type_is_refused_by_field(tmp_path, qwen3_dir):
    config = json.loads((qwen3_dir / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=16, layer_types=["full_attention", "linear_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layer_types \['linear_attention'\] are not supported"):
        ModelConfig.from_dir(tmp_path)


def test_a_checkpoint_with_layer_tensors_its_family_ignores_is_refused(tmp_path, qwen3_dir):
    """A Qwen3 checkpoint labelled Llama would run without its q/k norms: refused at load, tensor named."""
    for file in qwen3_dir.iterdir():
        shutil.copy(file, tmp_path / file.name)
    config = json.loads((qwen3_dir / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM: .* layer tensors its decoder does not use "
                                         r"\(e\.g\. model\.layers\.0\.self_attn\.k_norm\.weight\)"):
        run(tmp_path, [[5, 6]])
