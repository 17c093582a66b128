"""Qwen3 dense (`Qwen3ForCausalLM`): the Llama decoder with a per-head RMSNorm on q and k before RoPE.

What differs from Llama, as transformers' `Qwen3Attention` computes it:
  q_norm, k_norm  RMSNorm over each head's head_dim (weights [head_dim], shared by the heads), applied to
                  q and k after the projection and before RoPE (rms_norm_eps as the layer norms)
  head_dim        from config.json, independent of hidden_size / num_heads (o_proj maps
                  num_heads * head_dim back to hidden_size); read by ModelConfig for every family
  q/k/v bias      none unless `attention_bias` is true (ModelConfig.qkv_bias honours it)
The rest is Llama's, fused CPU path included: there the q/k norm runs as the unfused torch RMSNorm, in
place on the merged qkv rows, before the fused RoPE (which also writes K into the cache), so the norm
has the same rounding points as in the unfused path. With tensor parallelism each rank holds whole
heads, so q_norm and k_norm are replicated, not sharded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model import llama
from engine.model.llama import LayerWeights, LlamaModel, rms_norm
from engine.model.model_config import ModelConfig
from engine.model.weights import CheckpointWeights


@dataclass
class Qwen3LayerWeights(LayerWeights):
    q_norm: torch.Tensor
    k_norm: torch.Tensor


def load_layer(weights: CheckpointWeights, i: int, config: ModelConfig) -> Qwen3LayerWeights:
    """Layer i: Llama's weights and the attention's q_norm / k_norm."""
    attn = f"model.layers.{i}.self_attn."
    return Qwen3LayerWeights(**vars(llama.load_layer(weights, i, config)),
                             q_norm=weights.take(attn + "q_norm.weight"), k_norm=weights.take(attn + "k_norm.weight"))


class Model(LlamaModel):
    def norm_qk_(self, qk: torch.Tensor, layer: Qwen3LayerWeights) -> None:
        """RMSNorm each q head with q_norm and each k head with k_norm, in place."""
        q, k = qk[:, :self.config.num_heads], qk[:, self.config.num_heads:]
        q.copy_(rms_norm(q, layer.q_norm, self.config.rms_norm_eps))
        k.copy_(rms_norm(k, layer.k_norm, self.config.rms_norm_eps))
