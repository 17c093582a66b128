"""Paged attention with vllm-flash-attn's varlen kernel (CUDA only, optional).

vllm-flash-attn cannot be installed on our CPU machines (it pins torch 2.4 and
needs CUDA), so this backend is imported only when `attention_backend="flash"`
is configured on a GPU host. It consumes the same metadata as the torch backend.
It does not read an fp8 KV cache (`supports_fp8_kv` is False: the engine refuses
`--kv-cache-dtype fp8` with it); use the triton backend for that.

A sliding window is flash's `window_size=(window - 1, 0)` (a query at p sees p - window < j <= p;
the kernel skips the key blocks left of every window) and soft-capping its `softcap`. Attention
sinks are not computed (`supports_sinks = False`): the loader refuses a model whose layers have them.
"""
from __future__ import annotations

import torch

from engine.attention.backend import FULL_ATTENTION, AttentionBackend, AttentionMetadata, LayerAttention


class FlashPagedAttention(AttentionBackend):
    supports_sinks = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        try:
            from vllm_flash_attn import flash_attn_varlen_func
        except ImportError as exc:  # pragma: no cover - GPU hosts only
            raise RuntimeError("attention_backend='flash' needs the vllm-flash-attn package and a CUDA GPU") from exc
        self._varlen = flash_attn_varlen_func

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, kv_scales=(1.0, 1.0),
                layer: LayerAttention = FULL_ATTENTION):  # pragma: no cover
        if layer.sinks is not None:
            raise ValueError("attention_backend='flash' cannot compute attention sinks (LayerAttention.sinks); "
                             "use the triton or torch backend")
        k_cache[meta.slot_blocks, meta.slot_offsets] = k
        v_cache[meta.slot_blocks, meta.slot_offsets] = v
        cu_q, seq_lens, tables, max_q, max_k = _varlen_args(meta, q.device)
        return self._varlen(q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_q, max_seqlen_q=max_q,
                            seqused_k=seq_lens, max_seqlen_k=max_k, softmax_scale=self.scale,
                            causal=True, block_table=tables,
                            window_size=(-1, -1) if layer.window is None else (layer.window - 1, 0),
                            softcap=layer.softcap or 0.0)


def _varlen_args(meta: AttentionMetadata, device):  # pragma: no cover
    """Sequences in packed order with cumulative query lengths, as the kernel wants."""
    if "varlen" not in meta.extra:
        spans = []  # (token_start, n_query, seq_len, block_table)
        if meta.decode_token_indices is not None:
            lens = meta.decode_seq_lens
            for i, t in enumerate(meta.decode_token_indices.tolist()):
                spans.append((t, 1, int(lens[i]), meta.decode_block_tables[i]))
        for s in meta.prefills:
            n = s.token_end - s.token_start
            spans.append((s.token_start, n, s.context_len + n, s.block_table))
        spans.sort(key=lambda x: x[0])
        width = max(len(x[3]) for x in spans)
        tables = torch.zeros(len(spans), width, dtype=torch.int32, device=device)
        for i, x in enumerate(spans):
            tables[i, :len(x[3])] = x[3]
        cu = torch.tensor([0] + [x[1] for x in spans], device=device).cumsum(0).to(torch.int32)
        seq = torch.tensor([x[2] for x in spans], dtype=torch.int32, device=device)
        meta.extra["varlen"] = (cu, seq, tables, max(x[1] for x in spans), int(seq.max()))
    return meta.extra["varlen"]
