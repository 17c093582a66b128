"""The attention backend interface and the metadata one step hands it.

The KV cache of one layer is seen as two views `k_cache`, `v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim] (strided views into the
engine's block-major KV tensor). A backend writes the step's new K/V into the
slots of `slot_mapping`, then attends each query token to its sequence's
context. Tokens of a step are packed: decode tokens (one per sequence) and
prefill chunks. The torch backend reads them per kind (`slot_blocks`,
`decode_*`, `prefills`); varlen backends (triton) read one sequence after
another (`slot_mapping`, `cu_q`, `seq_lens`, `block_tables`), built in one
copy by engine/varlen_inputs.py.

Each layer's attention has its own options (`LayerAttention`): a sliding window, attention-sink
logits (gpt-oss), logit soft-capping (Gemma 2); the default is plain causal attention over the
whole context. The softmax scale is the backend's (`make_backend(scale=...)`, head_dim ** -0.5
unless the family says otherwise, e.g. Gemma's `query_pre_attn_scalar`).

An fp8 KV cache (float8_e4m3fn views) holds K/V divided by the layer's
`kv_scales` (engine/attention/fp8_kv.py); backends that cannot read it say so
with `supports_fp8_kv = False` and the engine refuses the combination.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class LayerAttention:
    """What one layer's attention computes beyond plain causal softmax(q k^T * scale) v."""

    window: int | None = None
    """Sliding window: a query at position p sees the keys at positions p - window < j <= p (transformers'
    `sliding_window`); None: every earlier key."""
    sinks: torch.Tensor | None = None
    """[Hq] float32 per-head sink logits (gpt-oss): one more softmax column per head whose value is zero,
    so the weights of the real keys sum to less than one. This rank's heads with tensor parallelism."""
    softcap: float | None = None
    """Logit soft-capping (Gemma 2 `attn_logit_softcapping`): scores become softcap * tanh(scores / softcap)
    after the scale, before the mask."""

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must be at least 1 token, got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention soft-capping must be positive, got {self.softcap}")

    @property
    def is_plain(self) -> bool:
        return self.window is None and self.sinks is None and self.softcap is None


FULL_ATTENTION = LayerAttention()
"""Plain causal attention over the whole context."""


@dataclass
class PrefillSpan:
    """A sequence computing several tokens this step (a prompt or a chunk of one)."""

    token_start: int
    token_end: int
    context_len: int
    """Tokens of this sequence whose KV was already cached before this step."""
    block_table: torch.Tensor
    """Block ids covering context_len + (token_end - token_start) tokens."""
    mask: torch.Tensor | None = None
    """Causal mask over context + chunk, built once per step by the backend that needs it."""


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor | None = None
    """[T] block id holding each new token's KV."""
    slot_offsets: torch.Tensor | None = None
    """[T] offset inside that block."""
    decode_token_indices: torch.Tensor | None = None
    """[B] packed token index of each single-token sequence (0..B-1 in a step without prefills)."""
    decode_block_tables: torch.Tensor | None = None
    """[B, max_blocks] block tables (padded with 0)."""
    decode_seq_lens: torch.Tensor | None = None
    """[B] context length of each single-token sequence, the new token included."""
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Varlen form: sequences packed in order.
    slot_mapping: torch.Tensor | None = None
    """[T] int32 cache slot (block * block_size + offset) of each new token; < 0 writes nothing."""
    cu_q: torch.Tensor | None = None
    """[S+1] int32 cumulative query lengths."""
    seq_lens: torch.Tensor | None = None
    """[S] int32 context length of each sequence, this step's tokens included."""
    block_tables: torch.Tensor | None = None
    """[S, W] int32 block tables (entries past a sequence's length are never read)."""
    max_query_len: int = 0
    kv_written: bool = False
    """Set by the model when its fused RoPE already wrote the step's K/V into the cache slots
    (only for backends with `accepts_written_kv`): the backend then skips its own write."""
    # Filled by backends that need more (e.g. cumulative lengths for flash-attn).
    extra: dict = field(default_factory=dict)


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes attention."""

    varlen: bool = False
    """True when the backend reads the varlen form of the metadata."""
    accepts_written_kv: bool = False
    """True when the backend honours `AttentionMetadata.kv_written` (the model wrote K/V into the slots the
    metadata names: slot_blocks/slot_offsets, or a varlen backend's slot_mapping)."""
    supports_fp8_kv: bool = False
    """True when the backend writes and reads a float8_e4m3fn cache (with per-layer scales)."""
    supports_sinks: bool = True
    """False when the backend cannot add attention-sink logits (`LayerAttention.sinks`): `check_layers`
    refuses a model whose layers have them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def check_layers(self, layers: list[LayerAttention], backend_name: str) -> None:
        """Raise ValueError, naming the option, when a layer needs what this backend cannot compute."""
        if not self.supports_sinks and any(layer.sinks is not None for layer in layers):
            raise ValueError(f"attention_backend={backend_name!r} cannot compute attention sinks "
                             f"(the layers' `sinks`); use attention_backend='triton' or 'torch'")

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, kv_scales: tuple[float, float] = (1.0, 1.0),
                layer: LayerAttention = FULL_ATTENTION) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; returns [T, Hq, D]. kv_scales (k_scale, v_scale) apply only
        to an fp8 cache; `layer` is this layer's window, sinks and soft-cap."""


def make_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None) -> AttentionBackend:
    """The backend `name` for this rank's heads; `scale` defaults to head_dim ** -0.5."""
    scale = head_dim ** -0.5 if scale is None else scale
    if name == "torch":
        from engine.attention.torch_paged import TorchPagedAttention
        return TorchPagedAttention(num_heads, num_kv_heads, head_dim, scale)
    if name == "triton":
        from engine.attention.triton_paged import TritonPagedAttention
        return TritonPagedAttention(num_heads, num_kv_heads, head_dim, scale)
    if name == "flash":
        from engine.attention.flash_paged import FlashPagedAttention
        return FlashPagedAttention(num_heads, num_kv_heads, head_dim, scale)
    raise ValueError(f"unknown attention backend {name!r}")
