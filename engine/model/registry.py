"""Which family module builds each Hugging Face architecture (config.json's `architectures`).

A family module defines, on top of the shared blocks (engine/model/llama.py's decoder, rotary.py,
linear.py, weights.py for the TP slices and weight formats):

  load_layer(weights, i, config)  layer i's weights, taken by name from a `CheckpointWeights`
  Model                           the decoder class, built as Model(config, embed, layers, final_norm,
                                  lm_head, attention, max_positions, tp)

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
    moe: str | None = None
    """The family's Mixture-of-Experts checkpoint names (`engine.model.moe.read_moe_weights`'s `family`);
    None for a dense family."""


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
}


def find_architecture(architectures: list[str]) -> str:
    """The first of config.json's `architectures` the engine implements; ValueError naming them if none."""
    for name in architectures:
        if name in FAMILIES:
            return name
    raise ValueError(f"unsupported architecture {architectures}; supported: {sorted(FAMILIES)}")


def family_module(architecture: str) -> ModuleType:
    """The module that builds `architecture` (one of FAMILIES)."""
    return importlib.import_module(FAMILIES[architecture].module)
