"""gpt-oss (`GptOssForCausalLM`): the Llama decoder with attention sinks, alternating sliding windows and a
Mixture-of-Experts feed-forward with biases on every layer.

What differs from Llama, as transformers' `modeling_gpt_oss.py` computes it:
  attention  q/k/v/o with biases (`attention_bias`, true by default); head_dim (64) independent of
             hidden_size; `self_attn.sinks` [num_heads]: one more softmax logit per head whose value is
             zero, so the real keys' weights sum to less than one (LayerAttention.sinks, float32; with
             tensor parallelism this rank's contiguous heads, as q is sliced); even layers attend through
             `sliding_window` (128), odd ones to the whole context (`layer_types`)
  RoPE       YaRN (factor 32 over 4096 positions, beta 32/1, `truncate` false: an unrounded ramp; its
             attention factor scales cos and sin); applied on the two halves of each head, which is
             Llama's rotate-half (engine/model/rotary.py)
  MoE        `mlp.router` [E, H] with bias: top-k of the logits, softmax over the k; experts with biases
             and the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`) over interleaved gate/up columns
             (engine/model/moe.py's `from_gpt_oss`; engine/model/moe_block.py runs them)
  MXFP4      the published checkpoints store the experts as MXFP4 blocks and scales: dequantised at load
             (engine/model/mxfp4.py); the rest of the checkpoint is bfloat16
RMSNorm, the residuals and the untied LM head are Llama's, fused CPU path included (the experts run as the
torch grouped loop there, as the Triton fused MoE on CUDA).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.attention import LayerAttention
from engine.model import llama
from engine.model.llama import LayerWeights, LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.moe_block import MoeDecoder, SparseMlp, load_sparse_mlp
from engine.model.weights import CheckpointWeights
from engine.parallel.sharding import shard_rows


@dataclass
class GptOssLayerWeights(LayerWeights):
    sinks: torch.Tensor
    """[num_heads] float32 sink logits of this rank's heads."""
    moe: SparseMlp | None


def load_layer(weights: CheckpointWeights, i: int, config: ModelConfig) -> GptOssLayerWeights:
    """Layer i: Llama's attention (with biases) and norms, the heads' sinks, and the experts."""
    sinks = weights.pop(f"model.layers.{i}.self_attn.sinks")
    if weights.tp is not None:
        sinks = shard_rows(sinks, weights.rank, weights.world)
    return GptOssLayerWeights(**vars(llama.load_layer(weights, i, config)),
                              sinks=sinks.to(device=weights.device, dtype=torch.float32).contiguous(),
                              moe=load_sparse_mlp(weights, i, config, "gpt_oss"))


class Model(MoeDecoder, LlamaModel):
    """The Llama decoder with each layer's sinks handed to attention and the experts as its MLP."""

    def attention_of(self, i: int) -> LayerAttention:
        """Layer i's window (on sliding layers) and its heads' sinks."""
        return replace(super().attention_of(i), sinks=self.layers[i - self.first_layer].sinks)
