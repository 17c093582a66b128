"""Mixtral (`MixtralForCausalLM`): the Llama decoder with a Mixture-of-Experts feed-forward on every layer.

What differs from Llama, as transformers' `MixtralSparseMoeBlock` computes it:
  router   `block_sparse_moe.gate` [E, H]: softmax over the E logits in float32, top-k
           (`num_experts_per_tok`), the k weights renormalised to sum to 1
  experts  `block_sparse_moe.experts.{e}.w1` (gate), `.w3` (up), `.w2` (down): SwiGLU, each expert as wide
           as `intermediate_size`; only the chosen experts run (engine/model/moe_block.py)
Attention, norms and RoPE are Llama's, fused CPU path included; the experts run as the torch grouped
loop there and as the Triton fused MoE on CUDA. Tensor parallelism slices every expert's intermediate
dimension, one all-reduce per layer as the dense MLP.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.model import llama
from engine.model.llama import LayerWeights, LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.moe_block import MoeDecoder, SparseMlp, load_sparse_mlp
from engine.model.weights import CheckpointWeights


@dataclass
class MixtralLayerWeights(LayerWeights):
    moe: SparseMlp | None


def load_layer(weights: CheckpointWeights, i: int, config: ModelConfig) -> MixtralLayerWeights:
    """Layer i: Llama's attention and norms, and the experts in place of the dense MLP."""
    return MixtralLayerWeights(**vars(llama.load_layer(weights, i, config)),
                               moe=load_sparse_mlp(weights, i, config, "mixtral"))


class Model(MoeDecoder, LlamaModel):
    """The Llama decoder whose `mlp` runs the layer's experts (engine/model/moe_block.py)."""
