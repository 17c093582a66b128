"""Qwen3-MoE (`Qwen3MoeForCausalLM`): the Qwen3 decoder (q/k norm) with Mixture-of-Experts layers.

What differs from Qwen3, as transformers' `Qwen3MoeSparseMoeBlock` and `Qwen3MoeDecoderLayer` compute it:
  router        `mlp.gate` [E, H]: softmax over the E logits in float32, top-k (`num_experts_per_tok`),
                renormalised only with `norm_topk_prob`; the weights cast to the activations' dtype
  experts       `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`, `moe_intermediate_size` wide;
                only the chosen experts run (engine/model/moe_block.py)
  dense layers  those in `mlp_only_layers` or where (i + 1) % `decoder_sparse_step` != 0 keep Qwen3's
                dense MLP (`intermediate_size`) under its usual names (engine/model/moe_config.py)
The rest is Qwen3's, fused CPU path included (the experts run as the torch grouped loop there, as the
Triton fused MoE on CUDA). Tensor parallelism slices every expert's intermediate dimension.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.model import qwen3
from engine.model.model_config import ModelConfig
from engine.model.moe_block import MoeDecoder, SparseMlp, load_sparse_mlp
from engine.model.qwen3 import Qwen3LayerWeights
from engine.model.weights import CheckpointWeights


@dataclass
class Qwen3MoeLayerWeights(Qwen3LayerWeights):
    moe: SparseMlp | None
    """The experts on a sparse layer; None on a dense one (gate_up and down are set instead)."""


def load_layer(weights: CheckpointWeights, i: int, config: ModelConfig) -> Qwen3MoeLayerWeights:
    """Layer i: Qwen3's attention (q/k norm included) and either its dense MLP or the experts."""
    return Qwen3MoeLayerWeights(**vars(qwen3.load_layer(weights, i, config)),
                                moe=load_sparse_mlp(weights, i, config, "qwen3_moe"))


class Model(MoeDecoder, qwen3.Model):
    """The Qwen3 decoder whose `mlp` runs the layer's experts on sparse layers (engine/model/moe_block.py)."""
