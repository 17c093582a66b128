"""Gemma 2 and Gemma 3 text (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`) over the paged KV cache.

As transformers 5 computes them (modeling_gemma2.py, modeling_gemma3.py), what differs from Llama:
  RMSNorm        x * rsqrt(mean(x^2) + eps) in float32, times (1 + weight) in float32, then cast to the
                 model dtype (Llama casts before the weight); (1 + weight) is taken once at load
  four norms     per layer: input and post-attention around the attention, pre- and post-feedforward
                 around the MLP; each branch is normed before it joins the residual
  embedding      scaled by sqrt(hidden_size), the factor rounded to the model dtype first (as transformers'
                 `embed_scale` buffer); the LM head is the embedding (tie_word_embeddings is the default)
  MLP            down(gelu_tanh(gate) * up)
  attention      scale query_pre_attn_scalar ** -0.5 (`attention_scale`, used by the loader); sliding
                 windows on the layers `config.layer_types` makes slide (Gemma 2: even layers by default;
                 Gemma 3: five of every six); Gemma 2 soft-caps the scores (`attn_logit_softcapping`)
  Gemma 3        q_norm / k_norm (Gemma RMSNorm over each head's head_dim, replicated across
                 tensor-parallel ranks) before RoPE; its sliding layers have their own RoPE (base
                 `rope_local_base_freq`, or `rope_parameters["sliding_attention"]`), its full layers the
                 config's global one (e.g. linear scaling by 8 on Gemma 3 4B and larger)
  final logits   cap * tanh(logits / cap) when `final_logit_softcapping` is set (Gemma 2: 30), on the
                 logits `forward` returns, so the sampler and every caller see the capped values
The fields come from engine/model/gemma_config.py. There is no fused CPU path: Llama's fused kernels
(engine/model/fused.py) round RMSNorm the Llama way and fuse the norm into the residual add, which
Gemma's post-norms (normed before the add) and (1 + weight) in float32 do not fit, so on CPU the unfused
torch ops below run (bf16 included). On CUDA the Triton ops (engine/model/fused_triton.py) run the four
norms and GELU * up, one kernel each: their RMSNorm is computed in float32 and rounded once, Gemma's rounding
with the (1 + weight) kept in float32; q_norm/k_norm (strided head views) stay torch ops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, AttentionMetadata, LayerAttention
from engine.model.linear import Linear
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.rotary import RotaryEmbedding
from engine.model.weights import CheckpointWeights
from engine.parallel.pipeline import PipelineStage
from engine.parallel.tp_group import TPGroup


@dataclass
class GemmaLayerWeights:
    input_norm: torch.Tensor
    """Each norm is held as (1 + weight) in float32."""
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    gate_up: Linear
    down: Linear
    q_norm: torch.Tensor | None = None
    """Gemma 3 only: [head_dim], (1 + weight) in float32; k_norm likewise."""
    k_norm: torch.Tensor | None = None


def attention_scale(config: ModelConfig) -> float:
    """The softmax scale: query_pre_attn_scalar ** -0.5."""
    return config.family_fields["query_pre_attn_scalar"] ** -0.5


def norm_weight(weights: CheckpointWeights, name: str) -> torch.Tensor:
    """A Gemma norm's (1 + weight) in float32, the weight first rounded to the model dtype (as transformers
    holds it)."""
    return 1.0 + weights.take(name).float()


def load_layer(weights: CheckpointWeights, i: int, config: ModelConfig) -> GemmaLayerWeights:
    """Layer i: q|k|v and gate|up merged, the four norms, and Gemma 3's q_norm / k_norm."""
    prefix = f"model.layers.{i}."
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    qk_norm = config.architecture == "Gemma3ForCausalLM"
    return GemmaLayerWeights(
        input_norm=norm_weight(weights, prefix + "input_layernorm.weight"),
        post_attention_norm=norm_weight(weights, prefix + "post_attention_layernorm.weight"),
        pre_feedforward_norm=norm_weight(weights, prefix + "pre_feedforward_layernorm.weight"),
        post_feedforward_norm=norm_weight(weights, prefix + "post_feedforward_layernorm.weight"),
        qkv=weights.linear([attn + f"{n}_proj" for n in "qkv"], bias=config.qkv_bias),
        o_proj=weights.linear([attn + "o_proj"], bias=attn + "o_proj.bias" in weights, row_parallel=True),
        gate_up=weights.linear([mlp + "gate_proj", mlp + "up_proj"]),
        down=weights.linear([mlp + "down_proj"], row_parallel=True),
        q_norm=norm_weight(weights, attn + "q_norm.weight") if qk_norm else None,
        k_norm=norm_weight(weights, attn + "k_norm.weight") if qk_norm else None,
    )


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm with `weight` = (1 + w) in float32: computed in float32, cast back at the end."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight).to(x.dtype)


class Model(LlamaModel):
    def __init__(self, config: ModelConfig, embed: torch.Tensor | None, layers: list[GemmaLayerWeights],
                 final_norm: torch.Tensor | None, lm_head: Linear | None, attention: AttentionBackend,
                 max_positions: int, tp: TPGroup | None = None, stage: PipelineStage | None = None) -> None:
        final_norm = 1.0 + final_norm.float() if final_norm is not None else None
        super().__init__(config, embed, layers, final_norm, lm_head, attention, max_positions, tp, stage)
        self.gemma_ops = self.fused if self.fused is not None and hasattr(self.fused, "gelu_tanh_and_mul") else None
        """The Triton ops on CUDA (see the module docstring), else None: the torch ops."""
        self.fused = None  # Llama's fused forward does not fit Gemma's norms
        fields = config.family_fields
        self.final_softcap: float | None = fields["final_logit_softcapping"]
        self.normalizer = torch.tensor(config.hidden_size ** 0.5).to(self.dtype)
        """sqrt(hidden_size) in the model dtype, the embedding's scale."""
        self.local_rotary = self.rotary
        """The sliding layers' RoPE: Gemma 3's own, Gemma 2's shared with the full layers."""
        if fields["local_rope_theta"] is not None:
            self.local_rotary = RotaryEmbedding(config.head_dim, max_positions, fields["local_rope_theta"],
                                                fields["local_rope_scaling"], self.dtype, self.rotary.cos.device)

    def attention_of(self, i: int) -> LayerAttention:
        """Layer i's sliding window (where it slides) and Gemma 2's attention soft-cap."""
        window = self.config.sliding_window if self.config.is_sliding(i) else None
        return LayerAttention(window=window, softcap=self.config.family_fields["attn_logit_softcapping"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor, hidden: torch.Tensor | None = None
                ) -> torch.Tensor:
        """The logits (soft-capped where the config says so) of `logits_indices`, in the model dtype
        (`hidden`, and what a pipeline stage before the last returns: LlamaModel.forward).

        kv_cache: [num_blocks, len(layers), 2, block_size, num_kv_heads, head_dim].
        """
        cfg = self.config
        eps = cfg.rms_norm_eps
        x = self.embed_tokens(input_ids) * self.normalizer if hidden is None else hidden
        num_tokens = x.shape[0]
        rope = self.rotary.lookup(positions)
        local_rope = rope if self.local_rotary is self.rotary else self.local_rotary.lookup(positions)
        ops = self.gemma_ops
        norm = gemma_rms_norm if ops is None else ops.rms_norm
        for j, w in enumerate(self.layers):
            i = self.first_layer + j
            h = norm(x, w.input_norm, eps)
            qk, v = w.qkv(h).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(num_tokens, -1, cfg.head_dim)
            if w.q_norm is not None:
                qk = torch.cat([gemma_rms_norm(qk[:, :cfg.num_heads], w.q_norm, eps),
                                gemma_rms_norm(qk[:, cfg.num_heads:], w.k_norm, eps)], dim=1)
            cos, sin = local_rope if cfg.is_sliding(i) else rope
            q, k = self.rotary.apply(qk, cos, sin).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            attn = self.attention.forward(q, k, v, kv_cache[:, j, 0], kv_cache[:, j, 1], meta, self.kv_scales[i],
                                          self.layer_attention[j])
            h = w.o_proj(attn.reshape(num_tokens, self.q_size))
            x = x + norm(h, w.post_attention_norm, eps)
            gate_up = w.gate_up(norm(x, w.pre_feedforward_norm, eps))
            if ops is None:
                gate, up = gate_up.chunk(2, dim=-1)
                h = w.down(F.gelu(gate, approximate="tanh") * up)
            else:
                h = w.down(ops.gelu_tanh_and_mul(gate_up))
            x = x + norm(h, w.post_feedforward_norm, eps)
        if self.lm_head is None:
            return x
        logits = self.lm_head(norm(x[logits_indices], self.final_norm, eps))
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
