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


FAMILIES = {
    "LlamaForCausalLM": Family("engine.model.llama"),
    "MistralForCausalLM": Family("engine.model.llama"),
    "Qwen2ForCausalLM": Family("engine.model.llama", qkv_bias=True),
    "Qwen3ForCausalLM": Family("engine.model.qwen3"),
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
