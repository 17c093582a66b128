"""Phi-3 / Phi-4 (engine/model/phi3.py) against transformers' own Phi3ForCausalLM.

A tiny random Phi-3 (odd sizes, GQA 6:2, head_dim 12, fused qkv_proj and gate_up_proj) gives transformers'
greedy tokens (fp32) token for token: plain, in chunks, with the fused CPU ops and without, and with 2
tensor-parallel ranks (each rank's q, k and v heads cut from the fused rows: slicing the fused tensor
whole would hand rank 0 only q rows). A LongRoPE variant (short/long factors, original context 32)
decodes well past 32 positions from prompts within 32, against transformers' Phi3ForCausalLM stepped one
token per pass with its own KV cache (each pass picks the factor set from its largest position, as pdserve
does per position); Phi3's own `generate` then re-runs the whole sequence with the long factors once it
passes 32 (its `prepare_inputs_for_generation`), which pdserve does not (engine/model/phi3.py): the tokens
agree up to that point and the test says where they part. With a `sliding_window` (Phi-3-mini-4k) every
layer slides, as in transformers. Phi3Config's own reading of config.json (legacy `su` and
`yarn` types, the 4096 default of original_max_position_embeddings) gives the same RoPE tables as
transformers', and Phi-4-mini's partial rotary is refused by name.
"""
import json
import math
import random
import shutil

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.model.fp8_checkpoint import save_fp8_checkpoint
from engine.model.loader import read_tensors
from engine.model.model_config import ModelConfig
from engine.model.quantization import FP8_DTYPE
from engine.model.rope_scaling import attention_factor
from engine.model.rotary import inverse_frequencies
from engine.sampling_params import SamplingParams
from tests.conftest import assert_equal, hf_greedy, perturb_norms_and_biases, save_tiny_checkpoint
from tests.engine.test_hf_equivalence import GREEDY, NEW_TOKENS, assert_no_leak, run
from tests.engine.test_tensor_parallel import generate

CHUNK = 32
ORIGINAL = 32
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
LONG = [1.0, 1.7, 3.0, 5.0, 8.0, 12.0]
LONGROPE = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "rope_theta": 500.0}


def tiny_phi3(path, tokenizer_dir, **overrides):
    """A 2-layer Phi-3 (hidden 72, 6 heads of 12, 2 KV heads, MLP 100) with large random weights."""
    from transformers import Phi3Config, Phi3ForCausalLM
    config = Phi3Config(**{**dict(vocab_size=49152, hidden_size=72, intermediate_size=100, num_hidden_layers=2,
                                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
                                  original_max_position_embeddings=1024, tie_word_embeddings=False,
                                  initializer_range=0.15, rms_norm_eps=1e-5, eos_token_id=2, bos_token_id=1,
                                  pad_token_id=0),
                           **overrides})
    torch.manual_seed(2024)
    model = Phi3ForCausalLM(config)
    perturb_norms_and_biases(model)
    return save_tiny_checkpoint(model, path, tokenizer_dir)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, tokenizer_dir):
    return tiny_phi3(tmp_path_factory.mktemp("tiny-phi3"), tokenizer_dir)


@pytest.fixture(scope="module")
def phi3_case(phi3_dir):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 150))] for _ in range(5)]
    prompts.append([7])
    assert max(map(len, prompts)) > 3 * CHUNK
    return prompts, hf_greedy(phi3_dir, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def longrope_case(tmp_path_factory, tokenizer_dir):
    path = tiny_phi3(tmp_path_factory.mktemp("tiny-phi3-longrope"), tokenizer_dir, max_position_embeddings=256,
                     original_max_position_embeddings=ORIGINAL, rope_parameters=dict(LONGROPE))
    prompts = [[(89 * i + 17 * n) % 49000 + 3 for i in range(n)] for n in (5, 20, 31)]
    new_tokens = 48
    assert max(map(len, prompts)) <= ORIGINAL and min(map(len, prompts)) + new_tokens > 1.5 * ORIGINAL
    return path, prompts, stepped_greedy(path, prompts, new_tokens), new_tokens


def stepped_greedy(model_dir, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' model, greedy: the prompt in one pass, then one token per pass over its DynamicCache."""
    from transformers import AutoModelForCausalLM, DynamicCache
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            cache, ids, out = DynamicCache(config=model.config), torch.tensor([prompt]), []
            positions = torch.arange(len(prompt))[None]
            for _ in range(new_tokens):
                logits = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).logits
                out.append(int(logits[0, -1].argmax()))
                ids, positions = torch.tensor([[out[-1]]]), positions[:, -1:] + 1
            outputs.append(out)
    return outputs



@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("variant", ["plain", "chunked"])
def test_tiny_phi3_equals_transformers(phi3_dir, phi3_case, variant, fused, monkeypatch):
    monkeypatch.setenv("PDSERVE_FUSED", fused)
    prompts, expected = phi3_case
    scheduler = SchedulerConfig(max_num_batched_tokens=CHUNK) if variant == "chunked" else SchedulerConfig()
    engine, got, _ = run(phi3_dir, prompts, scheduler=scheduler, cache=CacheConfig(enable_prefix_caching=False))
    model = engine.runner.model
    assert type(model).__module__ == "engine.model.llama" and model.config.architecture == "Phi3ForCausalLM"
    assert (model.fused is not None) == (fused == "1")
    assert_equal(got, expected)
    assert_no_leak(engine)


def test_phi3_with_a_sliding_window_equals_transformers(tmp_path, tokenizer_dir, phi3_case):
    """Phi-3-mini-4k's form: `sliding_window` alone, every layer slides (here over 24 of up to 150 tokens)."""
    path = tiny_phi3(tmp_path, tokenizer_dir, sliding_window=24)
    prompts = phi3_case[0]
    engine, got, _ = run(path, prompts, scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    assert [a.window for a in engine.runner.model.layer_attention] == [24, 24]
    assert_equal(got, hf_greedy(path, prompts, NEW_TOKENS))
    assert_no_leak(engine)


def test_tiny_phi3_two_ranks_equal_transformers(phi3_dir, phi3_case):
    prompts, expected = phi3_case
    engine, got = generate(phi3_dir, prompts, 2, GREEDY, scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK))
    model = engine.runner.model
    assert (model.config.num_heads, model.config.num_kv_heads, model.config.intermediate_size) == (3, 1, 50)
    assert model.layers[0].qkv.out_features == (3 + 2 * 1) * 12 and model.layers[0].gate_up.out_features == 100
    assert_equal([c[0] for c in got], expected)


@pytest.mark.parametrize("tp,chunk", [(1, None), (1, 16), (2, 16)])
def test_longrope_phi3_equals_transformers_past_the_original_context(longrope_case, tp, chunk):
    path, prompts, expected, new_tokens = longrope_case
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    scheduler = SchedulerConfig(max_num_batched_tokens=chunk) if chunk else SchedulerConfig()
    engine, got = generate(path, prompts, tp, params, scheduler=scheduler,
                           cache=CacheConfig(num_blocks=64, enable_prefix_caching=False))
    scaling = engine.runner.model.config.rope_scaling
    assert (scaling["rope_type"], scaling["original_max_position_embeddings"]) == ("longrope", ORIGINAL)
    assert_equal([c[0] for c in got], expected)


def test_phi3_generate_recomputes_past_the_original_context_and_pdserve_does_not(longrope_case):
    """The documented difference: equal to Phi3's own `generate` until the sequence first exceeds 32 tokens."""
    path, prompts, stepped, new_tokens = longrope_case
    theirs = hf_greedy(path, prompts, new_tokens)
    for prompt, mine, their in zip(prompts, stepped, theirs, strict=True):
        parted = ORIGINAL + 1 - len(prompt)  # the first token from a pass over 33 positions
        assert mine[:parted] == their[:parted]
    assert stepped != theirs  # the long factors on the first 32 keys change the greedy tokens here


def test_fp8_phi3_checkpoint_two_ranks_equal_one(tmp_path, phi3_dir, phi3_case):
    """`pdserve quantize` writes the fused tensors in fp8 with one scale each; a rank takes its q, k and v
    rows with their scales, so 2 ranks give the tokens of 1."""
    out = save_fp8_checkpoint(phi3_dir, tmp_path / "fp8")
    stored = read_tensors(out)
    assert stored["model.layers.0.self_attn.qkv_proj.weight"].dtype == FP8_DTYPE
    assert stored["model.layers.0.mlp.gate_up_proj.weight_scale"].shape == ()
    prompts = phi3_case[0][:3]
    one, two = (generate(out, prompts, tp, GREEDY, cache=CacheConfig(num_blocks=64))[1] for tp in (1, 2))
    assert one == two


def _write_config(src, dst, edit) -> None:
    config = json.loads((src / "config.json").read_text())
    edit(config)
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))


def _legacy_128k(config, kind="yarn"):  # a legacy type name, no original length: Phi3Config's 4096
    for key in ("rope_parameters", "original_max_position_embeddings"):
        config.pop(key)
    config.update(max_position_embeddings=131072, rope_theta=10000.0,
                  rope_scaling={"type": kind, "short_factor": SHORT, "long_factor": LONG})


def _legacy_yarn(config):
    config.pop("rope_parameters")
    config.update(max_position_embeddings=256, original_max_position_embeddings=ORIGINAL, rope_theta=500.0,
                  rope_scaling={"type": "yarn", "short_factor": SHORT, "long_factor": LONG})


def _no_defaults(config):  # a hand-written config.json: Phi3Config's class defaults fill the gaps
    for key in ("rms_norm_eps", "max_position_embeddings", "original_max_position_embeddings"):
        config.pop(key)
    config["rope_parameters"] = dict(LONGROPE)


@pytest.mark.parametrize("edit", [_legacy_128k, _legacy_yarn, _no_defaults])
def test_phi3_config_is_read_as_transformers_reads_it(tmp_path, phi3_dir, edit):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    _write_config(phi3_dir, tmp_path, edit)
    ours, theirs = ModelConfig.from_dir(tmp_path), AutoConfig.from_pretrained(tmp_path)
    assert (ours.rms_norm_eps, ours.max_position_embeddings) == (theirs.rms_norm_eps, theirs.max_position_embeddings)
    rope = theirs.rope_parameters
    assert ours.rope_scaling["rope_type"] == rope["rope_type"] == "longrope"
    assert ours.rope_scaling["original_max_position_embeddings"] == rope["original_max_position_embeddings"]
    inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](theirs)  # the short factors (no seq_len)
    assert torch.equal(inverse_frequencies(12, ours.rope_theta, ours.rope_scaling), inv_freq)
    assert math.isclose(attention_factor(ours.rope_scaling), scale, rel_tol=1e-12)
    long_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](theirs, seq_len=rope["original_max_position_embeddings"] + 1)
    assert torch.equal(inverse_frequencies(12, ours.rope_theta, ours.rope_scaling, long=True), long_freq)
    if edit is _legacy_128k:  # 131072 / 4096: the attention factor of a 32x context
        assert math.isclose(scale, math.sqrt(1 + math.log(32) / math.log(4096)))


def test_phi3_su_rope_is_read_as_longrope(tmp_path, phi3_dir):
    """Phi-3-128k's first `su` type, which Phi3Config renames to longrope (transformers 5.24 then fails its
    own validation on it: the rename runs after the original length is filled in)."""
    _write_config(phi3_dir, tmp_path / "su", lambda c: _legacy_128k(c, "su"))
    _write_config(phi3_dir, tmp_path / "longrope", lambda c: _legacy_128k(c, "longrope"))
    su, longrope = ModelConfig.from_dir(tmp_path / "su"), ModelConfig.from_dir(tmp_path / "longrope")
    assert su.rope_scaling["rope_type"] == "longrope" and su.rope_scaling["original_max_position_embeddings"] == 4096
    assert {**su.rope_scaling, "type": None} == {**longrope.rope_scaling, "type": None}


def test_phi4_mini_partial_rotary_is_refused_by_name(tmp_path, phi3_dir):
    _write_config(phi3_dir, tmp_path, lambda c: c["rope_parameters"].update(partial_rotary_factor=0.75))
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.75 is not supported"):
        ModelConfig.from_dir(tmp_path)


def test_a_fused_tensor_that_disagrees_with_the_config_is_refused_by_name(tmp_path, phi3_dir):
    for file in phi3_dir.iterdir():
        shutil.copy(file, tmp_path / file.name)
    _write_config(phi3_dir, tmp_path, lambda c: c.update(num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight has 120 rows; "
                                         r"the config implies 144 \(72 \+ 36 \+ 36\)"):
        run(tmp_path, [[5, 6]])
