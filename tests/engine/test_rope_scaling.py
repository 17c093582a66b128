"""RoPE scaling (linear, llama3, yarn, longrope) equals transformers' own.

The inverse frequencies and attention factor against `ROPE_INIT_FUNCTIONS` for configs shaped like
the checkpoints that use them (Llama 3.1, Qwen long-context, gpt-oss, DeepSeek, Phi-3 128k); the cos/sin
table against transformers' rotary module at every position, below and above
`original_max_position_embeddings`; and tiny random Llama checkpoints with yarn and longrope
greedy-equal to transformers' generate through the engine, decoding past the original context.
"""
import copy
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model.rope_scaling import attention_factor, parse_rope_scaling
from engine.model.rotary import RotaryEmbedding, inverse_frequencies
from engine.sampling_params import SamplingParams
from tests.conftest import hf_greedy

SHORT = [1.0 + 0.15 * i for i in range(8)]
LONG = [1.5 + 0.9 * i for i in range(8)]
"""LongRoPE factors for head_dim 16 (8 frequencies), far enough apart that the two sets differ."""

# (transformers config class, config.json fields) as checkpoints write them.
CASES = {
    "linear": (LlamaConfig, dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                                 rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama3": (LlamaConfig, dict(hidden_size=512, num_attention_heads=8, max_position_embeddings=131072,
                                 rope_theta=500000.0,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "yarn-qwen": (LlamaConfig, dict(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                                    rope_theta=1000000.0,
                                    rope_scaling={"type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32768})),
    "yarn-gpt-oss": (LlamaConfig, dict(hidden_size=512, num_attention_heads=8, max_position_embeddings=131072,
                                       rope_theta=150000.0,
                                       rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                        "beta_slow": 1.0, "truncate": False,
                                                        "original_max_position_embeddings": 4096})),
    "yarn-deepseek": (LlamaConfig, dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=163840,
                                        rope_theta=10000.0,
                                        rope_scaling={"type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                                                      "mscale": 0.707, "mscale_all_dim": 1.0,
                                                      "original_max_position_embeddings": 4096})),
    "yarn-implicit-factor": (LlamaConfig, dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                                               original_max_position_embeddings=32, rope_theta=500.0,
                                               rope_scaling={"rope_type": "yarn", "factor": None,
                                                             "attention_factor": 0.85, "beta_fast": 8.0})),
    "longrope-phi3": (Phi3Config, dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                                       original_max_position_embeddings=32,
                                       rope_scaling={"type": "longrope", "short_factor": SHORT,
                                                     "long_factor": LONG})),
    "longrope-explicit": (LlamaConfig, dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                                            rope_parameters={"rope_type": "longrope", "short_factor": SHORT,
                                                             "long_factor": LONG, "attention_factor": 1.3,
                                                             "original_max_position_embeddings": 32})),
}


def ours(raw: dict) -> dict | None:
    """The engine's scaling parameters for a config.json dict, read as model_config.py reads it."""
    return parse_rope_scaling(dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {}), raw)


def theirs(name: str):
    cls, raw = CASES[name]
    config = cls(**copy.deepcopy(raw))
    return config, raw, config.hidden_size // config.num_attention_heads, config.rope_parameters["rope_theta"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_frequencies_and_attention_factor_equal_transformers(name):
    config, raw, head_dim, theta = theirs(name)
    scaling = ours(raw)
    kind = config.rope_parameters["rope_type"]
    assert scaling["rope_type"] == kind
    want, want_factor = ROPE_INIT_FUNCTIONS[kind](config)
    assert torch.equal(inverse_frequencies(head_dim, theta, scaling), want)
    assert attention_factor(scaling) == want_factor
    if kind == "longrope":
        original = config.rope_parameters["original_max_position_embeddings"]
        want_long, _ = ROPE_INIT_FUNCTIONS[kind](config, seq_len=original + 1)
        assert torch.equal(inverse_frequencies(head_dim, theta, scaling, long=True), want_long)
        assert not torch.equal(want_long, want)
    if kind in ("yarn", "longrope"):
        assert want_factor != 1.0  # the cases exercise the attention factor


@pytest.mark.parametrize("name", ["linear", "yarn-implicit-factor", "longrope-phi3", "longrope-explicit"])
def test_cos_sin_table_equals_transformers_at_every_position(name):
    """Each position as transformers' rotary module gives it when decoding that position (longrope:
    short factors below original_max_position_embeddings, long from there on)."""
    config, raw, head_dim, theta = theirs(name)
    table = RotaryEmbedding(head_dim, 256, theta, ours(raw), torch.float32, torch.device("cpu"))
    hf = LlamaRotaryEmbedding(config)
    original = config.rope_parameters.get("original_max_position_embeddings", 256)
    for span in (range(0, original), range(original, 256)):  # one transformers pass per factor set
        if not span:
            continue
        positions = torch.tensor([list(span)])
        cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)
        assert torch.equal(table.cos[positions[0]], cos[0])
        assert torch.equal(table.sin[positions[0]], sin[0])


def test_longrope_switches_per_position_not_per_pass():
    """The documented difference: one transformers pass over positions reaching past the original
    length rotates all of them with the long factors; the engine keeps the short ones below it."""
    config, raw, head_dim, theta = theirs("longrope-phi3")
    table = RotaryEmbedding(head_dim, 64, theta, ours(raw), torch.float32, torch.device("cpu"))
    cos_long_pass, _ = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(64)[None])
    assert torch.equal(table.cos[32:], cos_long_pass[0, 32:])
    assert not torch.allclose(table.cos[1:32], cos_long_pass[0, 1:32])


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope type 'dynamic'"),
    ({"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}},
     "per-layer-type rope_parameters (full_attention, sliding_attention)"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
])
def test_unimplemented_rope_fields_are_refused_by_name(rope, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_rope_scaling(rope, {"max_position_embeddings": 256})


ORIGINAL = 32
NEW_TOKENS = 48
ROPES = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 8.0,
             "rope_theta": 500.0},
    "longrope": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                 "original_max_position_embeddings": ORIGINAL, "rope_theta": 500.0},
}


@pytest.fixture(scope="module", params=sorted(ROPES))
def rope_llama(request, tmp_path_factory, tokenizer_dir):
    """A 2-layer Llama (GQA, head_dim 16) with large random weights and the scaled RoPE."""
    path = tmp_path_factory.mktemp(f"llama-{request.param}")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters=dict(ROPES[request.param]), initializer_range=0.15,
                         tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(99)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    # yarn: prompts shorter and longer than the original context; longrope: prompts within it
    # (transformers switches factor sets per pass: see the note in engine/model/rotary.py).
    lengths = (5, 20, 31) if request.param == "longrope" else (5, 40, 75)
    prompts = [[(97 * i + 13 * n) % 49000 + 3 for i in range(n)] for n in lengths]
    assert min(lengths) + NEW_TOKENS > 1.5 * ORIGINAL
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


@pytest.mark.parametrize("chunked", [False, True])
def test_scaled_rope_llama_equals_transformers_past_the_original_context(rope_llama, chunked):
    """Greedy decoding runs well past original_max_position_embeddings (32); chunked: 16-token prefill chunks."""
    path, prompts, expected = rope_llama
    scheduler = SchedulerConfig(max_num_batched_tokens=16) if chunked else SchedulerConfig()
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", scheduler=scheduler,
                                    cache=CacheConfig(enable_prefix_caching=False)))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert [o.completions[0].token_ids for o in engine.generate(prompts, params)] == expected
