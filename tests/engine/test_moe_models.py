"""Mixtral and Qwen3-MoE (engine/model/mixtral.py, qwen3_moe.py) against transformers' own model classes.

Tiny random checkpoints (odd sizes, GQA 6:2, 8 experts top-2; Qwen3-MoE with a dense layer between sparse
ones, `norm_topk_prob` false, Mixtral always renormalising) give transformers' greedy tokens (fp32) token
for token: plain and in chunks, with the fused CPU ops and without, and with two tensor-parallel ranks
(each a slice of every expert). The per-expert token counts the model keeps equal the routing transformers
computes over the same tokens. Which layers are sparse is what transformers' decoder layer decides.
"""
import json
import random
from dataclasses import replace

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model.model_config import ModelConfig
from engine.parallel.sharding import check_tp_size
from tests.conftest import assert_equal, hf_greedy, perturb_norms_and_biases, save_tiny_checkpoint
from tests.engine.test_hf_equivalence import GREEDY, NEW_TOKENS, assert_no_leak, run
from tests.engine.test_pipeline_parallel import generate as pp_generate
from tests.engine.test_tensor_parallel import generate

CHUNK = 32
VOCAB = 49152
COMMON = dict(vocab_size=VOCAB, hidden_size=72, num_attention_heads=6, num_key_value_heads=2,
              max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.15,
              rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1, num_experts_per_tok=2)
# Expert widths of 40 (and 20 per rank): transformers' grouped_mm experts need 16-byte strides.
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_hidden_layers=2, intermediate_size=40, num_local_experts=8)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=3, head_dim=16, intermediate_size=100, moe_intermediate_size=40,
                       num_experts=8, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1])),
}
SPARSE_LAYERS = {"mixtral": [0, 1], "qwen3_moe": [0, 2]}


def tiny_moe(family: str, path, tokenizer_dir):
    import transformers
    config_cls, model_cls, args = FAMILIES[family]
    config = getattr(transformers, config_cls)(**COMMON, **args)
    torch.manual_seed(1234)
    model = getattr(transformers, model_cls)(config)
    perturb_norms_and_biases(model)
    return save_tiny_checkpoint(model, path, tokenizer_dir)


_CASES: dict[str, tuple] = {}  # family -> moe_case: built once per session, shared with test_moe_combinations


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe_case(request, tmp_path_factory, tokenizer_dir):
    """(family, checkpoint dir, prompts, transformers' greedy tokens)."""
    if request.param not in _CASES:
        path = tiny_moe(request.param, tmp_path_factory.mktemp(request.param), tokenizer_dir)
        rng = random.Random(5)
        prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 120))] for _ in range(5)] + [[7]]
        assert max(map(len, prompts)) > 3 * CHUNK
        _CASES[request.param] = request.param, path, prompts, hf_greedy(path, prompts, NEW_TOKENS)
    family, path, prompts, expected = _CASES[request.param]
    return family, path, [list(p) for p in prompts], [list(e) for e in expected]



def hf_expert_counts(path, sequences: list[list[int]]) -> dict[int, torch.Tensor]:
    """{layer: [E] tokens transformers routes to each expert} over the given token sequences."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    sparse = [i for i, layer in enumerate(model.model.layers) if not hasattr(layer.mlp, "gate_proj")]
    counts = {i: torch.zeros(model.config.num_local_experts, dtype=torch.long) for i in sparse}
    with torch.inference_mode():
        for seq in sequences:
            out = model(torch.tensor([seq]), output_router_logits=True)
            for i, logits in zip(sparse, out.router_logits, strict=True):
                ids = logits.topk(model.config.num_experts_per_tok, dim=-1).indices
                counts[i] += torch.bincount(ids.flatten(), minlength=model.config.num_local_experts)
    return counts


@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("variant", ["plain", "chunked"])
def test_tiny_moe_equals_transformers(moe_case, variant, fused, monkeypatch):
    monkeypatch.setenv("PDSERVE_FUSED", fused)
    family, path, prompts, expected = moe_case
    no_cache = CacheConfig(enable_prefix_caching=False)
    kwargs = {"plain": {"cache": no_cache},
              "chunked": {"scheduler": SchedulerConfig(max_num_batched_tokens=CHUNK), "cache": no_cache}}[variant]
    engine, got, _ = run(path, prompts, **kwargs)
    model = engine.runner.model
    assert type(model).__module__ == f"engine.model.{family}"
    assert (model.fused is not None) == (fused == "1")
    assert [i for i, layer in enumerate(model.layers) if layer.moe is not None] == SPARSE_LAYERS[family]
    assert_equal(got, expected)
    assert_no_leak(engine)


def test_expert_token_counts_equal_transformers_routing(moe_case):
    """Every token the engine ran (prompt and fed-back outputs) counted once per chosen expert, per layer."""
    family, path, prompts, expected = moe_case
    engine, got, _ = run(path, prompts, cache=CacheConfig(enable_prefix_caching=False))
    counts = engine.runner.model.expert_token_counts()
    want = hf_expert_counts(path, [p + g[:-1] for p, g in zip(prompts, got, strict=True)])
    assert sorted(counts) == SPARSE_LAYERS[family] == sorted(want)
    for i in counts:
        assert counts[i].tolist() == want[i].tolist(), f"layer {i}"
        assert (counts[i] > 0).sum() > 2  # spread over experts, not one winner


def test_tiny_moe_two_ranks_equal_transformers(moe_case):
    family, path, prompts, expected = moe_case
    engine, got = generate(path, prompts, 2, GREEDY, scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    model = engine.runner.model
    assert model.config.moe.intermediate_size == 20  # this rank's slice of each expert's 40
    sparse = model.layers[SPARSE_LAYERS[family][0]].moe
    gate_up, down = sparse.weights.linears[0]  # CPU: each expert's prepacked linears (moe.pack_experts)
    assert len(sparse.weights.linears) == 8
    assert (gate_up.out_features, gate_up.in_features, down.out_features, down.in_features) == (40, 72, 72, 20)
    assert_equal([c[0] for c in got], expected)


@pytest.mark.slow  # spawns a stage process (`make test-fast` leaves it out)
def test_tiny_moe_two_pipeline_stages_equal_transformers(moe_case):
    """Each stage routes its own sparse layers; the expert counts keep their global layer indices."""
    family, path, prompts, expected = moe_case
    engine, got = pp_generate(path, prompts, 2, GREEDY, scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    first = engine.runner.model
    assert sorted(first.expert_token_counts()) == [i for i in SPARSE_LAYERS[family] if i < len(first.layers)]
    assert_equal([c[0] for c in got], expected)


def small_qwen3_moe(**overrides):
    """A Qwen3-MoE config of transformers' own class (no weights needed), architectures set."""
    from transformers import Qwen3MoeConfig
    hf = Qwen3MoeConfig(**{**dict(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                                  num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                  num_experts=4, num_experts_per_tok=2), **overrides})
    hf.architectures = ["Qwen3MoeForCausalLM"]
    return hf


def test_qwen3_moe_sparse_layers_are_those_transformers_builds(tmp_path):
    """decoder_sparse_step and mlp_only_layers place the experts where transformers' decoder layer does."""
    from transformers import Qwen3MoeForCausalLM
    hf = small_qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[3])
    (tmp_path / "config.json").write_text(hf.to_json_string())
    moe = ModelConfig.from_dir(tmp_path).moe
    layers = Qwen3MoeForCausalLM(hf).model.layers
    assert [moe.is_sparse(i) for i in range(7)] == [not hasattr(layer.mlp, "gate_proj") for layer in layers]
    assert moe.dense_layers == (0, 2, 3, 4, 6) and not moe.renormalize


def test_a_tp_size_that_does_not_split_the_experts_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(small_qwen3_moe(moe_intermediate_size=9).to_json_string())
    config = ModelConfig.from_dir(tmp_path)
    check_tp_size(2, replace(config, moe=None))  # the attention and dense MLP split
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 must divide the experts' intermediate size 9"):
        check_tp_size(2, config)


def edited_config(tmp_path, source, **changes):
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_shared_experts_are_refused_by_field(tmp_path, moe_case):
    path = edited_config(tmp_path, moe_case[1], shared_expert_intermediate_size=64)
    with pytest.raises(ValueError, match=r"shared experts are not supported \(shared_expert_intermediate_size=64\)"):
        ModelConfig.from_dir(path)


def test_quantizing_an_moe_model_is_refused(moe_case):
    with pytest.raises(ValueError, match=r"quantized weights \(int8\) are not supported for Mixture-of-Experts"):
        LLMEngine(EngineConfig(model=str(moe_case[1]), dtype="float32", quantization="int8"))
