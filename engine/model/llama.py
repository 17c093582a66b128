"""Llama-family decoder (Llama, Qwen2 with q/k/v bias, Mistral) over a paged KV cache.

q/k/v are merged into one projection and gate/up into another, so a layer is
four matrix multiplies (`Linear`, prepacked for oneDNN in bf16 on CPU) over all
packed tokens of a step. Numerics follow Hugging Face's implementation (RMSNorm in float32,
rotate-half RoPE), so greedy outputs match transformers token for token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, AttentionMetadata
from engine.model.linear import Linear
from engine.model.model_config import ModelConfig
from engine.model.rotary import RotaryEmbedding


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm. In float32 exactly as transformers computes it; otherwise torch's fused kernel."""
    if x.dtype != torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h


class LlamaModel:
    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: Linear, attention: AttentionBackend,
                 max_positions: int) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.attention = attention
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                      config.rope_scaling, embed.dtype, embed.device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Run packed tokens through the model; return float32 logits of `logits_indices`.

        kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
        """
        cfg = self.config
        x = F.embedding(input_ids, self.embed)
        num_tokens = input_ids.shape[0]
        cos, sin = self.rotary.lookup(positions)
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.input_norm, cfg.rms_norm_eps)
            qkv = w.qkv(h)
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = self.rotary.apply(qk.view(num_tokens, -1, cfg.head_dim), cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            attn = self.attention.forward(q, k, v, kv_cache[:, i, 0], kv_cache[:, i, 1], meta)
            x = x + w.o_proj(attn.reshape(num_tokens, self.q_size))
            h = rms_norm(x, w.post_norm, cfg.rms_norm_eps)
            gate, up = w.gate_up(h).chunk(2, dim=-1)
            x = x + w.down(F.silu(gate) * up)
        h = rms_norm(x[logits_indices], self.final_norm, cfg.rms_norm_eps)
        return self.lm_head(h).float()
