"""gpt-oss (engine/model/gpt_oss.py, engine/model/mxfp4.py) against transformers' own GptOssForCausalLM.

A tiny random gpt-oss (odd sizes: hidden 72, GQA 6:2, head_dim 16 where hidden/heads is 12; 4 layers, even
ones sliding over 24 tokens; 8 experts top-2 with router and expert biases; random attention sinks; a SwiGLU
limit of 2 and alpha 1.6, low enough that the clamps bite; gpt-oss's own YaRN: factor 32 over 4096, truncate
false) gives transformers' greedy tokens (fp32) token for token: plain, in chunks of 32 (prompts of up to
120 tokens: several chunks, many windows), from the prefix cache, with the fused CPU ops and without, with 2
tensor-parallel ranks (a slice of every expert; sinks sliced by head) and 2 expert-parallel ranks (whole
experts with their biases), and on the Triton attention backend.
`test_each_gpt_oss_feature_changes_the_tokens` shows that dropping any one of the sinks, the window, the
unrounded YaRN ramp or the SwiGLU constants changes the tokens, so the equality tests would catch its loss.

MXFP4: the tiny model's experts (hidden 96 and width 64, multiples of 32) packed by `pack_mxfp4` below into
`*_blocks` / `*_scales` with `quantization_config.quant_method: mxfp4`, as the published checkpoints are;
transformers loads that same checkpoint (its CPU dequantising path, float32) and both give the same tokens.
`dequantize` equals transformers' `convert_moe_packed_tensors` bit for bit. Config fields a checkpoint omits
take GptOssConfig's defaults; mxfp4 is refused for other families and with --quantization.
"""
import json
import random
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model import gpt_oss
from engine.model.model_config import ModelConfig
from engine.model.mxfp4 import E2M1_VALUES, dequantize
from engine.model.rotary import RotaryEmbedding, inverse_frequencies
from tests.conftest import assert_equal, hf_greedy, perturb_norms_and_biases, save_tiny_checkpoint, with_config
from tests.engine.test_hf_equivalence import GREEDY, NEW_TOKENS, assert_no_leak, run
from tests.engine.test_tensor_parallel import generate

CHUNK = 32
WINDOW = 24
VOCAB = 49152
SLIDING, FULL = "sliding_attention", "full_attention"
TINY = dict(vocab_size=VOCAB, hidden_size=72, intermediate_size=40, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, num_local_experts=8, num_experts_per_tok=2,
            swiglu_limit=2.0, swiglu_alpha=1.6, max_position_embeddings=131072, initializer_range=0.15,
            eos_token_id=2, bos_token_id=1, pad_token_id=0)
"""rope_parameters and layer_types are GptOssConfig's own: gpt-oss's YaRN, even layers sliding."""
MXFP4_SIZES = dict(hidden_size=96, intermediate_size=64)
"""MXFP4 packs the experts' input dimensions (hidden for gate_up, the width for down) in blocks of 32."""
MXFP4_PROMPTS = 4


def tiny_gpt_oss(path, tokenizer_dir, **overrides):
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(1234)
    model = GptOssForCausalLM(GptOssConfig(**{**TINY, **overrides}))
    perturb_norms_and_biases(model)  # router and attention biases; the experts' are named *_bias
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj_bias"):
                p.normal_(0, 0.3)
    assert all(layer.self_attn.sinks.abs().min() > 0 for layer in model.model.layers)
    return save_tiny_checkpoint(model, path, tokenizer_dir)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, tokenizer_dir):
    return tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss"), tokenizer_dir)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 120))] for _ in range(5)]
    prompts += [prompts[0][:40] + [5] * k for k in (10, 50)] + [[7]]  # shared prefixes; one token
    assert max(map(len, prompts)) > 3 * CHUNK and sum(len(p) > WINDOW for p in prompts) >= 4
    return prompts


@pytest.fixture(scope="module")
def expected(gpt_oss_dir, prompts):
    return hf_greedy(gpt_oss_dir, prompts, NEW_TOKENS)





# ---- greedy equal to transformers ------------------------------------------------------------------------------
@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("variant", ["plain", "chunked", "cached"])
def test_tiny_gpt_oss_equals_transformers(gpt_oss_dir, prompts, expected, variant, fused, monkeypatch):
    monkeypatch.setenv("PDSERVE_FUSED", fused)
    no_cache = CacheConfig(enable_prefix_caching=False)
    kwargs = {"plain": {"cache": no_cache},
              "chunked": {"scheduler": SchedulerConfig(max_num_batched_tokens=CHUNK), "cache": no_cache},
              "cached": {}}[variant]
    engine, got, _ = run(gpt_oss_dir, prompts, **kwargs)
    model = engine.runner.model
    assert type(model) is gpt_oss.Model and (model.fused is not None) == (fused == "1")
    assert [a.window for a in model.layer_attention] == [WINDOW, None, WINDOW, None]
    for layer, attention in zip(model.layers, model.layer_attention, strict=True):
        assert attention.sinks is layer.sinks and layer.sinks.dtype == torch.float32 and layer.sinks.shape == (6,)
        assert layer.moe is not None and layer.moe.weights.b13.shape == (8, 80) and layer.moe.spec.swiglu_limit == 2
    if variant == "cached":  # the same prompts again: their full blocks now come from the cache
        outputs = engine.generate(prompts, GREEDY)
        assert sum(o.num_cached_tokens for o in outputs) > 0
        got = [o.completions[0].token_ids for o in outputs]
    assert_equal(got, expected)
    assert_no_leak(engine)


def expert_shapes(moe) -> tuple[int, int, int]:
    """(experts, gate|up rows, hidden) of a loaded layer's experts (CPU: per-expert Linears)."""
    return len(moe.linears), moe.linears[0][0].out_features, moe.linears[0][0].in_features


def test_tiny_gpt_oss_two_ranks_equal_transformers(gpt_oss_dir, prompts, expected):
    engine, got = generate(gpt_oss_dir, prompts, 2, GREEDY, scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    model = engine.runner.model
    assert (model.config.num_heads, model.config.num_kv_heads, model.config.moe.intermediate_size) == (3, 1, 20)
    hf = load_file(gpt_oss_dir / "model.safetensors")["model.layers.1.self_attn.sinks"]
    assert torch.equal(model.layers[1].sinks, hf[:3])  # rank 0's heads
    moe = model.layers[0].moe.weights
    assert expert_shapes(moe) == (8, 40, 72) and moe.b13.shape == (8, 40) and moe.b2.abs().sum() > 0  # rank 0: b2
    assert_equal([c[0] for c in got], expected)


def test_tiny_gpt_oss_two_expert_parallel_ranks_equal_transformers(gpt_oss_dir, prompts, expected):
    config = EngineConfig(model=str(gpt_oss_dir), dtype="float32", tensor_parallel_size=2,
                          enable_expert_parallel=True, cache=CacheConfig(num_blocks=512))
    engine = LLMEngine(config)
    try:
        got = [o.completions[0].token_ids for o in engine.generate(prompts, GREEDY)]
        moe = engine.runner.model.layers[0].moe.weights
        assert expert_shapes(moe) == (4, 80, 72) and moe.b13.shape == (4, 80) and moe.b2.shape == (4, 72)
        assert_no_leak(engine)
    finally:
        engine.shutdown()
    assert_equal(got, expected)


def test_tiny_gpt_oss_on_the_triton_backend_equals_transformers(gpt_oss_dir, prompts, expected):
    """Windows and sinks in the Triton kernels (interpreted on CPU: two prompts, 8 tokens, chunks of 32)."""
    pytest.importorskip("triton", reason="the triton wheel is part of the test install")
    config = EngineConfig(model=str(gpt_oss_dir), dtype="float32", attention_backend="triton",
                          scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK),
                          cache=CacheConfig(enable_prefix_caching=False))
    engine = LLMEngine(config)
    outputs = engine.generate(prompts[:2], replace(GREEDY, max_tokens=8))
    assert_equal([o.completions[0].token_ids for o in outputs], [e[:8] for e in expected[:2]])
    assert_no_leak(engine)


CHANGES = {
    "sinks zero": None,  # a sink logit of 0 still takes softmax mass: not the same as no sinks
    "no sinks": None,
    "no window": {"layer_types": [FULL] * 4},
    "rounded YaRN ramp": {"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                              "truncate": True, "original_max_position_embeddings": 4096,
                                              "rope_theta": 150000.0}},
    "swiglu_alpha 1.702": {"swiglu_alpha": 1.702},
    "swiglu_limit 7": {"swiglu_limit": 7.0},
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_gpt_oss_feature_changes_the_tokens(gpt_oss_dir, prompts, expected, tmp_path, change, monkeypatch):
    path = gpt_oss_dir
    if CHANGES[change] is not None:
        path = with_config(gpt_oss_dir, tmp_path / "changed", **CHANGES[change])
    else:
        attention_of = gpt_oss.Model.attention_of
        zero = change == "sinks zero"
        monkeypatch.setattr(gpt_oss.Model, "attention_of", lambda self, i: replace(
            attention_of(self, i), sinks=torch.zeros_like(self.layers[i].sinks) if zero else None))
    _, got, _ = run(path, prompts[:4], cache=CacheConfig(enable_prefix_caching=False))
    assert got != expected[:4]


# ---- MXFP4 ------------------------------------------------------------------------------------------------------
def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] float -> (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32]): per block of 32
    the smallest power-of-two scale that brings its largest value within 6, each value rounded to the nearest
    e2m1 magnitude, sign in bit 3, the even value of each pair in the low nibble."""
    *prefix, rows, cols = w.shape
    groups = w.reshape(*prefix, rows, cols // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    codes |= ((scaled < 0) & (codes > 0)).long() << 3
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def to_mxfp4_checkpoint(src, dst):
    """A copy of gpt-oss checkpoint `src` at `dst` with its expert matrices stored as the published ones are."""
    shutil.copytree(src, dst)
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stored as the transpose: [E, out, in]
            tensors[name + "_blocks"], tensors[name + "_scales"] = pack_mxfp4(t.transpose(1, 2))
        else:
            tensors[name] = t
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def mxfp4_case(tmp_path_factory, tokenizer_dir, prompts):
    """(the unquantized checkpoint, its MXFP4 copy, transformers' greedy tokens on the MXFP4 one)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    source = tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss-96"), tokenizer_dir, **MXFP4_SIZES)
    path = to_mxfp4_checkpoint(source, tmp_path_factory.mktemp("mxfp4") / "ckpt")
    # dequantize=True: transformers' CPU path whatever kernels are installed (dequantised to float32).
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True))
    model.generation_config.eos_token_id = None
    expected = []
    with torch.inference_mode():
        for prompt in prompts[:MXFP4_PROMPTS]:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    stored = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj.data,
                       dequantize(stored[name + "_blocks"], stored[name + "_scales"]))
    return source, path, expected


def test_mxfp4_gpt_oss_equals_transformers_on_the_same_checkpoint(mxfp4_case, prompts):
    source, path, expected = mxfp4_case
    engine, got, _ = run(path, prompts[:MXFP4_PROMPTS], scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK),
                         cache=CacheConfig(enable_prefix_caching=False))
    model = engine.runner.model
    assert model.config.quantization == "mxfp4"
    assert model.layers[0].moe.weights.linears[0][0].weight_dtype == torch.float32
    assert_equal(got, expected)
    assert_no_leak(engine)
    _, unquantized, _ = run(source, prompts[:MXFP4_PROMPTS], cache=CacheConfig(enable_prefix_caching=False))
    assert unquantized != got  # the FP4 rounding shows: the MXFP4 experts were the ones that ran


def test_dequantize_equals_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=generator)
    blocks[0, :4] = torch.arange(256, dtype=torch.uint8).view(4, 4, 16)  # every byte value somewhere
    scales = torch.randint(0, 255, (3, 40, 4), dtype=torch.uint8, generator=generator)  # 255 is E8M0's NaN
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        ours = dequantize(blocks, scales, dtype)
        assert ours.shape == (3, 128, 40) and ours.dtype == dtype
        assert torch.equal(ours.view(bits), convert_moe_packed_tensors(blocks, scales, dtype=dtype).view(bits))


def test_dequantize_reads_the_low_nibble_first_and_scales_by_a_power_of_two():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x92  # low nibble 2 (+1.0) first, high nibble 9 (-0.5) second
    blocks[0, 0, 1] = 0x7F  # -6.0, then +6.0
    values = dequantize(blocks, torch.tensor([[129]], dtype=torch.uint8))  # scale 2 ** 2
    assert values.shape == (32, 1)
    assert values[:4, 0].tolist() == [4.0, -2.0, -24.0, 24.0] and not values[4:].any()


# ---- config.json ------------------------------------------------------------------------------------------------
def test_yarn_tables_equal_transformers_for_gpt_oss():
    """gpt-oss's own RoPE (head_dim 64, theta 150000, YaRN factor 32 over 4096 positions, truncate false)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    hf_config = GptOssConfig()
    hf_config.architectures = ["GptOssForCausalLM"]
    hf = GptOssRotaryEmbedding(hf_config)
    config = config_of(hf_config.to_dict())
    assert config.rope_scaling["truncate"] is False and config.rope_theta == 150000.0
    ours = inverse_frequencies(64, config.rope_theta, config.rope_scaling)
    assert torch.equal(ours, hf.inv_freq)
    assert not torch.equal(inverse_frequencies(64, 150000.0, {**config.rope_scaling, "truncate": True}), ours)
    positions = torch.tensor([0, 1, 127, 128, 4095, 4096, 20000, 131071])
    table = RotaryEmbedding(64, 131072, config.rope_theta, config.rope_scaling, torch.float32, torch.device("cpu"))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    assert torch.equal(table.cos[positions, :32], cos[0]) and torch.equal(table.sin[positions, :32], sin[0])
    assert torch.equal(table.cos[:, :32], table.cos[:, 32:])  # the halves share each frequency


def config_of(raw: dict) -> ModelConfig:
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(raw))
        return ModelConfig.from_dir(Path(d))


PUBLISHED = {  # openai/gpt-oss-20b's config.json (legacy rope_scaling) less its layer_types: the default must alternate
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}


def test_the_published_gpt_oss_config_reads_as_transformers_reads_it():
    from transformers import GptOssConfig
    config = config_of(PUBLISHED)
    hf = GptOssConfig(**{k: v for k, v in PUBLISHED.items() if k != "quantization_config"})
    assert config.layer_types == tuple(hf.layer_types) and config.layer_types[:2] == (SLIDING, FULL)
    assert (config.sliding_window, config.head_dim, config.qkv_bias, config.quantization) == (128, 64, True, "mxfp4")
    assert config.rope_theta == hf.rope_parameters["rope_theta"] and config.rope_scaling["truncate"] is False
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.scoring) == (32, 4, 2880, "topk_softmax")
    assert (moe.swiglu_limit, moe.swiglu_alpha) == (hf.swiglu_limit, hf.swiglu_alpha) == (7.0, 1.702)
    assert moe.dense_layers == ()


def test_omitted_fields_take_gpt_oss_config_defaults():
    from transformers import GptOssConfig
    minimal = dict(vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2)
    config = config_of({"architectures": ["GptOssForCausalLM"], **minimal})
    hf = GptOssConfig(**minimal)
    assert (config.head_dim, config.qkv_bias, config.rms_norm_eps) == (hf.head_dim, hf.attention_bias, hf.rms_norm_eps)
    assert (config.sliding_window, config.max_position_embeddings) == (hf.sliding_window, hf.max_position_embeddings)
    assert config.layer_types == tuple(hf.layer_types)
    assert (config.moe.num_experts, config.moe.top_k) == (hf.num_local_experts, hf.num_experts_per_tok)
    assert (config.moe.swiglu_limit, config.moe.swiglu_alpha) == (hf.swiglu_limit, hf.swiglu_alpha)
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    hf_rope = {k: v for k, v in hf.rope_parameters.items() if k != "rope_theta"}
    assert {k: v for k, v in config.rope_scaling.items() if k != "rope_theta"} == hf_rope


def test_mxfp4_is_refused_for_other_families_by_name():
    from transformers import MixtralConfig
    raw = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1).to_dict()
    raw.update(architectures=["MixtralForCausalLM"], quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match=r"MixtralForCausalLM: mxfp4 checkpoints are supported for gpt-oss "
                                         r"\(GptOssForCausalLM\) only"):
        config_of(raw)


def test_quantizing_gpt_oss_at_load_is_refused(gpt_oss_dir, mxfp4_case):
    with pytest.raises(ValueError, match=r"the checkpoint is already quantized \(mxfp4\); cannot load it as int8"):
        LLMEngine(EngineConfig(model=str(mxfp4_case[1]), dtype="float32", quantization="int8"))
    with pytest.raises(ValueError, match=r"quantized weights \(fp8\) are not supported for Mixture-of-Experts"):
        LLMEngine(EngineConfig(model=str(gpt_oss_dir), dtype="float32", quantization="fp8"))
