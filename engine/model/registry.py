"""Which family module builds each Hugging Face architecture (config.json's `architectures`).

A family module defines, on top of the shared blocks (engine/model/llama.py's decoder, rotary.py,
linear.py, weights.py for the TP slices and weight formats):

  load_layer(weights, i, config)  layer i's weights, taken by name from a `CheckpointWeights`
  Model                           the decoder class, built as Model(config, embed, layers, final_norm,
                                  lm_head, attention, max_positions, tp)
  attention_scale(config)         optional: the softmax scale (default head_dim ** -0.5; Gemma's differs)

Adding a family is its module, one entry here and its test. The table holds module names, imported
only when a model is loaded, so reading a config does not import torch.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Family:
    module: str
    """The module defining `load_layer` and `Model`."""
    qkv_bias: bool = False
    """Whether q/k/v carry biases when config.json has no `attention_bias` (Qwen2's always do)."""
    config_defaults: tuple[tuple[str, object], ...] = ()
    """config.json fields a checkpoint may omit, with the defaults of the family's transformers config class
    where they differ from the engine's (field, value)."""
    rope_aliases: tuple[tuple[str, str], ...] = ()
    """Legacy RoPE type names the family's transformers config class reads as another type."""
    alternating_window: bool = False
    """Without `layer_types` in config.json, even layers slide and odd ones are full (Gemma 2, gpt-oss)."""
    moe: str | None = None
    """The family's Mixture-of-Experts checkpoint names (`engine.model.moe.read_moe_weights`'s `family`);
    None for a dense family."""
    fields: str | None = None
    """A torch-free module whose `parse_fields(raw, architecture)` reads the family's own config.json fields
    into `ModelConfig.family_fields` (refusing those the engine does not implement); None: no own fields."""
    layer_type_rope: bool = False
    """RoPE parameters may nest per layer type (Gemma 3): ModelConfig's rope is the full-attention layers',
    the family's `fields` module reads the others'."""


_GEMMA_DEFAULTS = (("head_dim", 256), ("sliding_window", 4096), ("tie_word_embeddings", True))

FAMILIES = {
    "LlamaForCausalLM": Family("engine.model.llama"),
    "MistralForCausalLM": Family("engine.model.llama"),
    "Qwen2ForCausalLM": Family("engine.model.llama", qkv_bias=True),
    "Qwen3ForCausalLM": Family("engine.model.qwen3"),
    "Qwen3MoeForCausalLM": Family("engine.model.qwen3_moe", moe="qwen3_moe"),
    "MixtralForCausalLM": Family("engine.model.mixtral", moe="mixtral"),
    "Phi3ForCausalLM": Family("engine.model.phi3", config_defaults=(
        ("original_max_position_embeddings", 4096), ("max_position_embeddings", 4096), ("rms_norm_eps", 1e-5)),
        rope_aliases=(("su", "longrope"), ("yarn", "longrope"))),
    "Gemma2ForCausalLM": Family("engine.model.gemma", fields="engine.model.gemma_config", alternating_window=True,
                                config_defaults=_GEMMA_DEFAULTS + (("max_position_embeddings", 8192),)),
    "Gemma3ForCausalLM": Family("engine.model.gemma", fields="engine.model.gemma_config", layer_type_rope=True,
                                config_defaults=_GEMMA_DEFAULTS + (("max_position_embeddings", 131072),
                                                                   ("rope_theta", 1_000_000.0),
                                                                   ("sliding_window_pattern", 6))),
    "GptOssForCausalLM": Family("engine.model.gpt_oss", moe="gpt_oss", alternating_window=True, config_defaults=(
        ("attention_bias", True), ("head_dim", 64), ("rms_norm_eps", 1e-5), ("sliding_window", 128),
        ("max_position_embeddings", 131072), ("num_local_experts", 128), ("num_experts_per_tok", 4),
        ("swiglu_limit", 7.0), ("swiglu_alpha", 1.702),
        # Under the legacy name, so that a checkpoint's own rope_scaling or rope_parameters wins.
        ("rope_scaling", {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                          "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}))),
}
NOT_SUPPORTED = {
    "Gemma3ForConditionalGeneration": "Gemma 3's vision-language model; its text-only Gemma3ForCausalLM is supported",
}
"""Architectures refused with a reason (a nearby family is supported)."""


def find_architecture(architectures: list[str]) -> str:
    """The first of config.json's `architectures` the engine implements; ValueError naming them if none."""
    for name in architectures:
        if name in FAMILIES:
            return name
    for name in architectures:
        if name in NOT_SUPPORTED:
            raise ValueError(f"unsupported architecture {name}: {NOT_SUPPORTED[name]}")
    raise ValueError(f"unsupported architecture {architectures}; supported: {sorted(FAMILIES)}")


def family_fields(raw: dict, architecture: str) -> dict:
    """The family's own config.json fields (`Family.fields`), {} for a family without any."""
    module = FAMILIES[architecture].fields
    return importlib.import_module(module).parse_fields(raw, architecture) if module else {}


def family_module(architecture: str) -> ModuleType:
    """The module that builds `architecture` (one of FAMILIES)."""
    return importlib.import_module(FAMILIES[architecture].module)
