"""Paged attention through our Triton kernels (engine/attention/triton_kernels.py).

One launch writes the step's K/V into the cache by slot mapping (unless the model's fused RoPE wrote them:
`kv_written`), one launch attends all of the step's tokens; both per layer. On a GPU the kernels are
compiled; without one they run under Triton's interpreter (set here before
triton is first imported), which is slow but exact — for tests; there it
refuses an fp8 cache (see `supports_fp8_kv`). A layer's window, sinks and soft-cap
(`LayerAttention`) are the attention kernel's compile-time switches: plain layers run it unchanged.
"""
from __future__ import annotations

import os

import torch

from engine.attention.backend import FULL_ATTENTION, AttentionBackend, AttentionMetadata, LayerAttention


class TritonPagedAttention(AttentionBackend):
    varlen = True
    accepts_written_kv = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            from engine.attention import triton_kernels
        except ImportError as exc:
            raise RuntimeError("attention_backend='triton' needs the triton package") from exc
        self._kernels = triton_kernels
        # An fp8 cache on GPUs only: Triton's interpreter (triton 3.x) rounds float32 -> e4m3 wrongly where
        # rounding up crosses a power of two (127.3 -> 64), so the KV write would be wrong on CPU.
        self.supports_fp8_kv = torch.cuda.is_available()

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, kv_scales=(1.0, 1.0),
                layer: LayerAttention = FULL_ATTENTION) -> torch.Tensor:
        if not meta.kv_written:
            self._kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, *kv_scales)
        return self._kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_q,
                                             meta.max_query_len, self.scale, k_scale=kv_scales[0],
                                             v_scale=kv_scales[1], window=layer.window, sinks=_sinks(layer, q),
                                             softcap=layer.softcap)


def _sinks(layer: LayerAttention, q: torch.Tensor) -> torch.Tensor | None:
    """The layer's sink logits as the kernel reads them: float32, contiguous, on q's device."""
    if layer.sinks is None:
        return None
    return layer.sinks.to(device=q.device, dtype=torch.float32).contiguous()
