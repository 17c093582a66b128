"""Gemma 2 and Gemma 3 text (engine/model/gemma.py) against transformers' own Gemma2ForCausalLM / Gemma3ForCausalLM.

Tiny random checkpoints (odd sizes, GQA 6:2, head_dim 16 where hidden/heads is 12, a 24-token sliding window
on some of the 4 layers, query_pre_attn_scalar 20, norm weights drawn around 0 since Gemma scales by 1 + w)
give transformers' greedy tokens (fp32) token for token: plain, in chunks of 32 (prompts of up to 150
tokens: several chunks, many windows), from the prefix cache, with 2 tensor-parallel ranks and through
the Triton backend. Gemma 2 soft-caps its attention scores (at 5, small enough to bind) and its final
logits (checked through the logprobs, which greedy tokens cannot show); Gemma 3 has q/k norms and a local
RoPE (base 100) unlike its global one (linear scaling by 4, base 10000). `test_each_gemma_feature_changes_the_tokens`
shows that transformers itself answers differently without each feature, so the equality tests would catch its loss.
The older config forms (Gemma 3's sliding_window_pattern / rope_local_base_freq / rope_scaling, Gemma 2
without layer_types) read as transformers reads them; multimodal and unimplemented fields are refused by name.
"""
import random

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from tests.conftest import DROP, assert_equal, hf_greedy, perturb_norms_and_biases, save_tiny_checkpoint, with_config
from tests.engine.test_hf_equivalence import GREEDY, NEW_TOKENS, assert_no_leak, run
from tests.engine.test_pipeline_parallel import generate as pp_generate
from tests.engine.test_tensor_parallel import generate

CHUNK = 32
WINDOW = 24
SLIDING, FULL = "sliding_attention", "full_attention"
COMMON = dict(vocab_size=49152, hidden_size=72, intermediate_size=100, num_hidden_layers=4, num_attention_heads=6,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, query_pre_attn_scalar=20,
              sliding_window=WINDOW, tie_word_embeddings=False, initializer_range=0.15, rms_norm_eps=1e-6,
              eos_token_id=2, bos_token_id=1, pad_token_id=0)
GEMMA2 = dict(COMMON, attn_logit_softcapping=5.0, final_logit_softcapping=4.0)
"""Layer types left to Gemma2Config: even layers slide."""
GEMMA3 = dict(COMMON, layer_types=[SLIDING, SLIDING, FULL, SLIDING],
              rope_parameters={FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                               SLIDING: {"rope_type": "default", "rope_theta": 100.0}})


def tiny_gemma(family, path, tokenizer_dir, **overrides):
    """A random-weight Gemma `family` ("gemma2" / "gemma3") checkpoint; norm weights from U(-0.5, 0.5)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig
    config_class, model_class, fields = {"gemma2": (Gemma2Config, Gemma2ForCausalLM, GEMMA2),
                                         "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, GEMMA3)}[family]
    torch.manual_seed(2024)
    model = model_class(config_class(**{**fields, **overrides}))
    perturb_norms_and_biases(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.sub_(1.0)  # U(0.5, 1.5) -> U(-0.5, 0.5): the norms scale by 1 + w
    return save_tiny_checkpoint(model, path, tokenizer_dir)




@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory, tokenizer_dir):
    return {family: tiny_gemma(family, tmp_path_factory.mktemp(f"tiny-{family}"), tokenizer_dir)
            for family in ("gemma2", "gemma3")}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 150))] for _ in range(5)]
    prompts += [prompts[0][:40] + [5] * k for k in (10, 50)]  # shared prefixes
    prompts.append([7])
    assert max(map(len, prompts)) > 4 * WINDOW and max(map(len, prompts)) > 3 * CHUNK
    return prompts


@pytest.fixture(scope="module")
def expected(gemma_dirs, prompts):
    return {family: hf_greedy(path, prompts, NEW_TOKENS) for family, path in gemma_dirs.items()}



@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("variant", ["plain", "chunked", "cached"])
def test_tiny_gemma_equals_transformers(gemma_dirs, prompts, expected, family, variant):
    kwargs = {"plain": {"cache": CacheConfig(enable_prefix_caching=False)},
              "chunked": {"scheduler": SchedulerConfig(max_num_batched_tokens=CHUNK),
                          "cache": CacheConfig(enable_prefix_caching=False)},
              "cached": {}}[variant]
    engine, got, _ = run(gemma_dirs[family], prompts, **kwargs)
    model = engine.runner.model
    assert type(model).__module__ == "engine.model.gemma" and model.attention.scale == 20 ** -0.5
    windows = [a.window for a in model.layer_attention]
    assert windows == ([WINDOW, None, WINDOW, None] if family == "gemma2" else [WINDOW, WINDOW, None, WINDOW])
    assert {a.softcap for a in model.layer_attention} == ({5.0} if family == "gemma2" else {None})
    assert (model.local_rotary is model.rotary) == (family == "gemma2")
    if variant == "cached":  # the same prompts again: their full blocks now come from the cache
        outputs = engine.generate(prompts, GREEDY)
        assert sum(o.num_cached_tokens for o in outputs) >= sum(16 * ((len(p) - 1) // 16) for p in prompts)
        got = [o.completions[0].token_ids for o in outputs]
    assert_equal(got, expected[family])
    assert_no_leak(engine)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_tiny_gemma_two_ranks_equal_transformers(gemma_dirs, prompts, expected, family):
    engine, got = generate(gemma_dirs[family], prompts, 2, GREEDY,
                           scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    model = engine.runner.model
    assert (model.config.num_heads, model.config.num_kv_heads, model.config.head_dim) == (3, 1, 16)
    if family == "gemma3":
        assert model.layers[0].q_norm.shape == (16,)  # replicated, not sharded
    assert_equal([c[0] for c in got], expected[family])


@pytest.mark.slow  # spawns a stage process (`make test-fast` leaves it out)
def test_tiny_gemma3_two_pipeline_stages_equal_transformers(gemma_dirs, prompts, expected):
    """Each stage's windows and RoPE (global or local) are those of its own layers (global indices)."""
    family = "gemma3"
    engine, got = pp_generate(gemma_dirs[family], prompts, 2, GREEDY, partition=(1, 3),
                              scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    assert len(engine.runner.model.layers) == 1
    assert_equal([c[0] for c in got], expected[family])


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_tiny_gemma_through_the_triton_backend(gemma_dirs, prompts, expected, family):
    """The Triton kernels' window and soft-cap, with the Triton norms and GELU * up a CUDA engine runs Gemma's
    layers with (interpreted on CPU, so few prompts and tokens)."""
    pytest.importorskip("triton", reason="the triton wheel is part of the test install")
    from engine.model.fused_triton import TritonFusedOps
    config = EngineConfig(model=str(gemma_dirs[family]), dtype="float32", attention_backend="triton",
                          scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    engine = LLMEngine(config)
    engine.runner.model.gemma_ops = TritonFusedOps()  # what load_fused_ops gives it on CUDA
    outputs = engine.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert_equal([o.completions[0].token_ids for o in outputs], [e[:8] for e in expected[family][:3]])


def test_gemma2_final_logits_are_soft_capped(gemma_dirs, prompts):
    """Greedy tokens cannot show a monotonic cap: the logprobs equal transformers' (capped at 4), not the
    uncapped ones."""
    from transformers import AutoModelForCausalLM
    path = gemma_dirs["gemma2"]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32"))
    outputs = engine.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0))
    models = {cap: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, final_logit_softcapping=cap)
              for cap in (4.0, None)}
    for prompt, output in zip(prompts[:3], outputs, strict=True):
        completion = output.completions[0]
        ids = torch.tensor([prompt + completion.token_ids])
        got = torch.tensor([entry["logprob"] for entry in completion.logprobs])
        steps = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
        for cap, model in models.items():
            with torch.inference_mode():
                logprobs = model(ids).logits[0].log_softmax(-1)
            want = logprobs[steps, ids[0, steps + 1]]
            if cap is None:
                assert (got - want).abs().max() > 1e-2
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_tiny_tied_gemma3_equals_transformers(gemma_dirs, tmp_path, tokenizer_dir, prompts):
    """The LM head is the embedding (Gemma's default: a config.json without the field ties, as transformers)."""
    from transformers import AutoConfig
    path = tiny_gemma("gemma3", tmp_path / "tied", tokenizer_dir, tie_word_embeddings=True, initializer_range=0.05)
    _, got, _ = run(path, prompts[:4], cache=CacheConfig(enable_prefix_caching=False))
    assert_equal(got, hf_greedy(path, prompts[:4], NEW_TOKENS))
    for family, untied in gemma_dirs.items():
        default = with_config(untied, tmp_path / family, tie_word_embeddings=DROP)
        assert ModelConfig.from_dir(default).tie_word_embeddings
        assert AutoConfig.from_pretrained(default).tie_word_embeddings


@pytest.mark.parametrize("family, change", [
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"layer_types": [FULL] * 4}),
    ("gemma2", {"query_pre_attn_scalar": 16}),
    ("gemma3", {"rope_parameters": {FULL: GEMMA3["rope_parameters"][FULL], SLIDING: GEMMA3["rope_parameters"][FULL]}}),
    ("gemma3", {"rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 10000.0},
                                    SLIDING: GEMMA3["rope_parameters"][SLIDING]}}),
    ("gemma3", {"layer_types": [FULL] * 4}),
])
def test_each_gemma_feature_changes_the_tokens(gemma_dirs, prompts, expected, tmp_path, family, change):
    """Without the soft-cap, the sliding window, Gemma's attention scale, Gemma 3's local RoPE or its global
    scaling, transformers' own greedy tokens differ: the equality tests above depend on each."""
    changed = with_config(gemma_dirs[family], tmp_path / "changed", **change)
    assert hf_greedy(changed, prompts, NEW_TOKENS) != expected[family]


def test_gemma3_older_config_fields_read_as_transformers_reads_them(gemma_dirs, tmp_path):
    """sliding_window_pattern, rope_local_base_freq, rope_theta and a top-level rope_scaling (for the global
    layers only), as Gemma 3 checkpoints before transformers 5 wrote them."""
    from transformers import AutoConfig
    old = with_config(gemma_dirs["gemma3"], tmp_path / "old", layer_types=DROP, rope_parameters=DROP,
                      sliding_window_pattern=3, rope_theta=10000.0, rope_local_base_freq=100.0,
                      rope_scaling={"rope_type": "linear", "factor": 4.0})
    got, new = ModelConfig.from_dir(old), ModelConfig.from_dir(gemma_dirs["gemma3"])
    hf = AutoConfig.from_pretrained(old)
    assert list(got.layer_types) == hf.layer_types == [SLIDING, SLIDING, FULL, SLIDING] == list(new.layer_types)
    assert hf.rope_parameters[SLIDING]["rope_theta"] == got.family_fields["local_rope_theta"] == 100.0
    assert hf.rope_parameters[FULL]["rope_theta"] == got.rope_theta == new.rope_theta == 10000.0
    assert hf.rope_parameters[FULL]["factor"] == got.rope_scaling["factor"] == new.rope_scaling["factor"] == 4.0
    assert got.rope_scaling["rope_type"] == new.rope_scaling["rope_type"] == "linear"
    assert got.family_fields == new.family_fields and got.family_fields["local_rope_scaling"] is None


def test_gemma_config_defaults_are_transformers_defaults(gemma_dirs, tmp_path):
    """Fields a config.json may omit: Gemma 2's alternating windows and soft-caps (50, 30), Gemma 3's
    five-in-six windows and global RoPE base 1e6, both families' head_dim 256 and attention scalar 256."""
    from transformers import AutoConfig
    omitted = dict(layer_types=DROP, attn_logit_softcapping=DROP, final_logit_softcapping=DROP, head_dim=DROP,
                   query_pre_attn_scalar=DROP, rope_parameters=DROP, num_hidden_layers=7)
    for family in ("gemma2", "gemma3"):
        path = with_config(gemma_dirs[family], tmp_path / family, **omitted)
        got, hf = ModelConfig.from_dir(path), AutoConfig.from_pretrained(path)
        assert list(got.layer_types) == hf.layer_types
        assert got.head_dim == hf.head_dim == 256
        assert got.family_fields["query_pre_attn_scalar"] == hf.query_pre_attn_scalar == 256
        assert got.family_fields["final_logit_softcapping"] == hf.final_logit_softcapping
        if family == "gemma2":
            assert got.family_fields["attn_logit_softcapping"] == hf.attn_logit_softcapping == 50.0
            assert got.rope_theta == hf.rope_parameters["rope_theta"]
        else:
            assert got.family_fields["attn_logit_softcapping"] is None  # transformers' Gemma 3 never applies it
            assert got.rope_theta == hf.rope_parameters[FULL]["rope_theta"] == 1e6
            assert got.family_fields["local_rope_theta"] == hf.rope_parameters[SLIDING]["rope_theta"]
    assert ModelConfig.from_dir(tmp_path / "gemma2").layer_types == (SLIDING, FULL) * 3 + (SLIDING,)


@pytest.mark.parametrize("family, change, message", [
    ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]},
     r"unsupported architecture Gemma3ForConditionalGeneration: Gemma 3's vision-language model"),
    ("gemma3", {"vision_config": {"model_type": "siglip_vision_model"}},
     r"Gemma3ForCausalLM: config.json has a vision_config \(a multimodal Gemma checkpoint\)"),
    ("gemma2", {"hidden_activation": "gelu"}, r"hidden_activation 'gelu' is not supported"),
    ("gemma3", {"use_bidirectional_attention": True}, r"use_bidirectional_attention is not supported"),
    ("gemma3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
     r"rope_parameters must be given per layer type"),
    ("gemma3", {"rope_parameters": {FULL: {"rope_type": "dynamic", "factor": 2.0}, SLIDING: {}}},
     r"unsupported rope type 'dynamic'"),
    ("gemma2", {"layer_types": [SLIDING, "chunked_attention", SLIDING, FULL]},
     r"layer_types \['chunked_attention'\] are not supported"),
])
def test_unsupported_gemma_configs_are_refused_by_name(gemma_dirs, tmp_path, family, change, message):
    path = with_config(gemma_dirs[family], tmp_path / "refused", **change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(path)


def test_other_families_still_refuse_per_layer_type_rope(gemma_dirs, tmp_path):
    """Only Gemma 3 reads nested rope_parameters; a Gemma 3 config relabelled Gemma 2 is refused."""
    path = with_config(gemma_dirs["gemma3"], tmp_path / "relabelled", architectures=["Gemma2ForCausalLM"])
    with pytest.raises(ValueError, match=r"per-layer-type rope_parameters \(full_attention, sliding_attention\)"):
        ModelConfig.from_dir(path)
