"""Llama-family decoder (Llama, Qwen2 with q/k/v bias, Mistral) over a paged KV cache.

q/k/v are merged into one projection and gate/up into another, so a layer is
four matrix multiplies (`Linear`, prepacked for oneDNN in bf16 on CPU) over all
packed tokens of a step. Numerics follow Hugging Face's implementation (RMSNorm in float32,
rotate-half RoPE), so greedy outputs match transformers token for token.
On CPU the elementwise half of each layer runs fused (`engine/model/fused.py`):
residual add + RMSNorm, SiLU*up, and RoPE in place (writing K/V into the cache
too when the attention backend lets it), with the same rounding points.

Other families build on this decoder where their math is the same (engine/model/registry.py):
`norm_qk_` is the step between the q/k projection and RoPE that Qwen3 fills in (engine/model/qwen3.py),
`mlp` the feed-forward step that the Mixture-of-Experts families replace on their sparse layers
(engine/model/moe_block.py), in both paths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import FULL_ATTENTION, AttentionBackend, AttentionMetadata, LayerAttention
from engine.model.fused import FusedOps, load_fused_ops
from engine.model.linear import Linear
from engine.model.model_config import ModelConfig
from engine.model.rotary import RotaryEmbedding
from engine.model.weights import CheckpointWeights
from engine.parallel.layers import vocab_parallel_embedding
from engine.parallel.pipeline import PipelineStage
from engine.parallel.sharding import vocab_range
from engine.parallel.tp_group import TPGroup


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear | None
    """None on a Mixture-of-Experts family's sparse layer (its experts replace the dense MLP)."""
    down: Linear | None


def load_layer(weights: CheckpointWeights, i: int, config: ModelConfig) -> LayerWeights:
    """Layer i of a Llama / Mistral / Qwen2 checkpoint: q|k|v and gate|up merged into one linear each;
    o_proj's bias where the checkpoint has one (`attention_bias` in Llama and Qwen3, not Qwen2). No dense MLP
    on the layers `config.moe` makes sparse (their family loads the experts)."""
    attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    dense = config.moe is None or not config.moe.is_sparse(i)
    return LayerWeights(
        input_norm=weights.take(f"model.layers.{i}.input_layernorm.weight"),
        qkv=weights.linear([attn + f"{n}_proj" for n in "qkv"], bias=config.qkv_bias),
        o_proj=weights.linear([attn + "o_proj"], bias=attn + "o_proj.bias" in weights, row_parallel=True),
        post_norm=weights.take(f"model.layers.{i}.post_attention_layernorm.weight"),
        gate_up=weights.linear([mlp + "gate_proj", mlp + "up_proj"]) if dense else None,
        down=weights.linear([mlp + "down_proj"], row_parallel=True) if dense else None,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm. In float32 exactly as transformers computes it; otherwise torch's fused kernel."""
    if x.dtype != torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h


class LlamaModel:
    def __init__(self, config: ModelConfig, embed: torch.Tensor | None, layers: list[LayerWeights],
                 final_norm: torch.Tensor | None, lm_head: Linear | None, attention: AttentionBackend,
                 max_positions: int, tp: TPGroup | None = None, stage: PipelineStage | None = None) -> None:
        self.config = config
        """With tensor parallelism, this rank's shapes (its heads and MLP slice; see engine/parallel/)."""
        self.embed = embed
        """None on a pipeline stage after the first."""
        self.layers = layers
        """The layers this process runs: all of them, or a pipeline stage's range (from `first_layer` on)."""
        self.final_norm = final_norm
        self.lm_head = lm_head
        """None (and `final_norm` too) on a pipeline stage before the last: `forward` returns hidden states."""
        self.attention = attention
        self.tp = tp
        """The tensor-parallel group (None: one rank). The row-parallel linears and the LM head are
        wrapped at load (engine/parallel/layers.py); the embedding is looked up in `embed_tokens`."""
        self.first_layer = stage.start if stage is not None else 0
        """Global index of `layers[0]` (engine/parallel/pipeline.py); the KV cache holds `layers`' only."""
        self.vocab_start = vocab_range(config.vocab_size, tp.rank, tp.world_size)[0] if tp is not None else 0
        ref = layers[0].input_norm
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                      config.rope_scaling, ref.dtype, ref.device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.fused: FusedOps | None = load_fused_ops(ref.device, ref.dtype)
        """The fused CPU kernels, or None (CUDA, other dtypes, PDSERVE_FUSED=0): the unfused torch ops."""
        self.kv_scales: list[tuple[float, float]] = [(1.0, 1.0)] * config.num_layers
        """(k_scale, v_scale) per layer (global index); read only with an fp8 KV cache (set by the model runner)."""
        self.layer_attention: list[LayerAttention] = [self.attention_of(self.first_layer + j)
                                                      for j in range(len(layers))]
        """Each of `layers`' window, sinks and soft-cap, handed to the attention backend."""

    def attention_of(self, i: int) -> LayerAttention:
        """Layer i's (global index) attention options: its sliding window where config.layer_types makes it slide."""
        if self.config.is_sliding(i):
            return LayerAttention(window=self.config.sliding_window)
        return FULL_ATTENTION

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].input_norm.dtype

    def norm_qk_(self, qk: torch.Tensor, layer: LayerWeights) -> None:
        """Prepare the q and k heads [T, Hq + Hkv, D] in place before RoPE: nothing for Llama."""

    def mlp(self, h: torch.Tensor, layer: LayerWeights, ops: FusedOps | None) -> torch.Tensor:
        """The feed-forward of the post-attention-normed h: down(silu(gate) * up), SiLU*up fused with `ops`."""
        if ops is not None:
            return layer.down(ops.silu_and_mul(layer.gate_up(h)))
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.embed)
        return vocab_parallel_embedding(input_ids, self.embed, self.vocab_start, self.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor, hidden: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Run packed tokens through the model; return the logits of `logits_indices` in the model's
        dtype (the sampler widens to float32 only the rows that need it).

        kv_cache: [num_blocks, len(layers), 2, block_size, num_kv_heads, head_dim].
        A pipeline stage after the first starts from `hidden` (the residual stream [tokens, hidden_size] the
        stage before returned) instead of embedding `input_ids`; one before the last returns its own.
        """
        if self.fused is not None:
            return self._forward_fused(self.fused, input_ids, positions, kv_cache, meta, logits_indices, hidden)
        cfg = self.config
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        num_tokens = x.shape[0]
        cos, sin = self.rotary.lookup(positions)
        for j, w in enumerate(self.layers):
            i = self.first_layer + j
            h = rms_norm(x, w.input_norm, cfg.rms_norm_eps)
            qkv = w.qkv(h)
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(num_tokens, -1, cfg.head_dim)
            self.norm_qk_(qk, w)
            qk = self.rotary.apply(qk, cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            attn = self.attention.forward(q, k, v, kv_cache[:, j, 0], kv_cache[:, j, 1], meta, self.kv_scales[i],
                                          self.layer_attention[j])
            x = x + w.o_proj(attn.reshape(num_tokens, self.q_size))
            h = rms_norm(x, w.post_norm, cfg.rms_norm_eps)
            x = x + self.mlp(h, w, None)
        if self.lm_head is None:
            return x
        h = rms_norm(x[logits_indices], self.final_norm, cfg.rms_norm_eps)
        return self.lm_head(h)

    def _forward_fused(self, ops: FusedOps, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_cache: torch.Tensor, meta: AttentionMetadata, logits_indices: torch.Tensor,
                       hidden: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` with the fused CPU kernels: the same ops, rounded at the same points."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        num_tokens = positions.shape[0]
        if positions.dtype != torch.long:
            positions = positions.long()
        # The backend lets RoPE write K/V into the cache (no index_put or KV-write kernel per layer) when the ops
        # read its slots: (block, offset) pairs, or a varlen backend's flat slots (the Triton ops); an fp8 cache
        # is written by the backend, which quantizes.
        flat = meta.slot_mapping if getattr(ops, "writes_flat_slots", False) else None
        write_kv = self.attention.accepts_written_kv and (meta.slot_blocks is not None or flat is not None) \
            and kv_cache.dtype == self.dtype
        meta.kv_written = write_kv
        residual = self.embed_tokens(input_ids) if hidden is None else hidden
        h = ops.rms_norm(residual, self.layers[0].input_norm, eps)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        for j, w in enumerate(self.layers):
            i = self.first_layer + j
            qkv = w.qkv(h)
            self.norm_qk_(qkv[:, :k_end].view(num_tokens, -1, cfg.head_dim), w)
            k_cache, v_cache = kv_cache[:, j, 0], kv_cache[:, j, 1]
            if write_kv and meta.slot_blocks is None:
                ops.rope_(qkv, positions, self.rotary.cos, self.rotary.sin, cfg.num_heads, cfg.num_kv_heads,
                          k_cache, v_cache, slot_mapping=flat)
            elif write_kv:
                ops.rope_(qkv, positions, self.rotary.cos, self.rotary.sin, cfg.num_heads, cfg.num_kv_heads,
                          k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
            else:
                ops.rope_(qkv, positions, self.rotary.cos, self.rotary.sin, cfg.num_heads, cfg.num_kv_heads)
            q = qkv[:, :q_end].view(num_tokens, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_end:k_end].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, k_end:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            attn = self.attention.forward(q, k, v, k_cache, v_cache, meta, self.kv_scales[i], self.layer_attention[j])
            h = ops.add_rms_norm_(w.o_proj(attn.reshape(num_tokens, self.q_size)), residual, w.post_norm, eps)
            down = self.mlp(h, w, ops)
            if j + 1 < len(self.layers):
                h = ops.add_rms_norm_(down, residual, self.layers[j + 1].input_norm, eps)
            else:
                residual += down
        if self.lm_head is None:
            return residual
        h = ops.rms_norm(residual[logits_indices], self.final_norm, eps)
        return self.lm_head(h)


Model = LlamaModel
"""The decoder class engine/model/registry.py builds for this family."""
