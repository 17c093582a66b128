"""Paged attention in plain torch: runs on CPU (and on CUDA, slower than a kernel).

Decode tokens on CPU go through a small C++ kernel that reads K/V in place
through the block tables (`cpu_kernels`, built on first use). Without it (or on
CUDA), decode tokens of all sequences are attended in one batched SDPA call
over their gathered, padded context; the query heads of one KV group act as the
query rows, so grouped-query attention needs no K/V repetition. Prefill chunks
are attended one sequence at a time; a chunk with no earlier context uses its
own fresh K/V with a causal mask, without touching the cache.

An fp8 cache is written quantized (index_put: CPU torch has no fp8 index_copy_);
the C++ decode kernel reads it in place (times the scales), the gathered paths
dequantize the blocks they gather to the compute dtype.

A layer with a sliding window, attention sinks or soft-capping (`LayerAttention`) takes the
C++ kernel with those options, or the gathered paths of engine/attention/torch_options.py:
only the blocks holding keys inside a window are read; a window alone is an SDPA mask,
sinks and soft-capping an explicit float32 softmax. Plain layers run the code below unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.attention import fp8_kv, torch_options
from engine.attention.backend import FULL_ATTENTION, AttentionBackend, AttentionMetadata, LayerAttention


class TorchPagedAttention(AttentionBackend):
    accepts_written_kv = True
    supports_fp8_kv = True

    def __init__(self, *args, use_cpu_kernel: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kernel = cpu_kernels.load() if use_cpu_kernel else None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, kv_scales=(1.0, 1.0),
                layer: LayerAttention = FULL_ATTENTION):
        if not meta.kv_written:
            fp8 = fp8_kv.is_fp8(k_cache)
            k_cache[meta.slot_blocks, meta.slot_offsets] = fp8_kv.quantize(k, kv_scales[0]) if fp8 else k
            v_cache[meta.slot_blocks, meta.slot_offsets] = fp8_kv.quantize(v, kv_scales[1]) if fp8 else v
        idx = meta.decode_token_indices
        if not meta.prefills and idx is not None and self._use_kernel(q):
            # A decode-only step: its tokens are the decode tokens, in order; no gather or scatter.
            return self._kernel_decode(q.contiguous(), k_cache, v_cache, meta, kv_scales, layer)
        out = torch.empty_like(q)
        if idx is not None:
            self._decode(q, k_cache, v_cache, meta, out, kv_scales, layer)
        k_cache, v_cache = _readable(k_cache, kv_scales[0], q.dtype), _readable(v_cache, kv_scales[1], q.dtype)
        for span in meta.prefills:
            if layer.is_plain:
                self._prefill(q, k, v, k_cache, v_cache, span, out)
            else:
                self._prefill_with_options(q, k, v, k_cache, v_cache, span, out, meta, layer)
        return out

    def _use_kernel(self, q) -> bool:
        return self.kernel is not None and q.device.type == "cpu"

    def _kernel_decode(self, q, k_cache, v_cache, meta, kv_scales, layer: LayerAttention) -> torch.Tensor:
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        if layer.is_plain:
            return self.kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens, self.scale, *kv_scales)
        sinks = None if layer.sinks is None else layer.sinks.to(torch.float32).contiguous()
        return self.kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens, self.scale, *kv_scales,
                                                  layer.window or 0, sinks, layer.softcap or 0.0)

    def _decode(self, q, k_cache, v_cache, meta, out, kv_scales, layer: LayerAttention) -> None:
        idx = meta.decode_token_indices
        if self._use_kernel(q):
            out[idx] = self._kernel_decode(q[idx], k_cache, v_cache, meta, kv_scales, layer)
            return
        if not layer.is_plain:
            self._decode_with_options(q, k_cache, v_cache, meta, out, kv_scales, layer)
            return
        k_cache, v_cache = _readable(k_cache, kv_scales[0], q.dtype), _readable(v_cache, kv_scales[1], q.dtype)
        batch = idx.shape[0]
        group = self.num_heads // self.num_kv_heads
        tables = meta.decode_block_tables
        keys = _gather(k_cache, tables).transpose(1, 2)      # [B, Hkv, L, D]
        values = _gather(v_cache, tables).transpose(1, 2)
        query = q[idx].view(batch, self.num_kv_heads, group, self.head_dim)
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=_decode_mask(meta, keys.shape[2]),
                                              scale=self.scale)
        out[idx] = attn.reshape(batch, self.num_heads, self.head_dim)

    def _prefill(self, q, k, v, k_cache, v_cache, span, out) -> None:
        s, e = span.token_start, span.token_end
        query = q[s:e].transpose(0, 1).unsqueeze(0)          # [1, Hq, n, D]
        if span.context_len == 0:
            keys = k[s:e].transpose(0, 1).unsqueeze(0)
            values = v[s:e].transpose(0, 1).unsqueeze(0)
            attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                                  scale=self.scale, enable_gqa=True)
        else:
            total = span.context_len + (e - s)
            table = span.block_table.unsqueeze(0)
            keys = _gather(k_cache, table)[:, :total].transpose(1, 2)
            values = _gather(v_cache, table)[:, :total].transpose(1, 2)
            if span.mask is None:  # the same for every layer of this step
                query_pos = torch.arange(span.context_len, total, device=q.device)
                span.mask = torch.arange(total, device=q.device)[None, :] <= query_pos[:, None]
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=span.mask,
                                                  scale=self.scale, enable_gqa=True)
        out[s:e] = attn.squeeze(0).transpose(0, 1)

    def _decode_with_options(self, q, k_cache, v_cache, meta, out, kv_scales, layer: LayerAttention) -> None:
        """The gathered decode path for a window, sinks or soft-cap: only the window's blocks are read."""
        idx = meta.decode_token_indices
        key = ("decode_window", layer.window)
        if key not in meta.extra:  # the same for every layer with this window, this step
            tables, lens = meta.decode_block_tables, meta.decode_seq_lens
            first = torch.zeros_like(lens)
            if layer.window is not None:
                tables, first = torch_options.window_decode_tables(tables, lens, layer.window, k_cache.shape[1])
            visible = torch_options.decode_visible(lens, first, tables.shape[1] * k_cache.shape[1], layer.window)
            meta.extra[key] = tables, visible
        tables, visible = meta.extra[key]
        k_cache, v_cache = _readable(k_cache, kv_scales[0], q.dtype), _readable(v_cache, kv_scales[1], q.dtype)
        keys = _gather(k_cache, tables).transpose(1, 2)      # [B, Hkv, L, D]
        values = _gather(v_cache, tables).transpose(1, 2)
        batch = idx.shape[0]
        if layer.sinks is None and layer.softcap is None:
            group = self.num_heads // self.num_kv_heads
            query = q[idx].view(batch, self.num_kv_heads, group, self.head_dim)
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=self.scale)
        else:
            attn = torch_options.attend(q[idx].unsqueeze(2), keys, values, visible, self.scale, layer)
        out[idx] = attn.reshape(batch, self.num_heads, self.head_dim)

    def _prefill_with_options(self, q, k, v, k_cache, v_cache, span, out, meta, layer: LayerAttention) -> None:
        """A prefill chunk under a window, sinks or soft-cap; with cached context, only the blocks from the
        first one its first query sees are gathered."""
        s, e = span.token_start, span.token_end
        query = q[s:e].transpose(0, 1).unsqueeze(0)          # [1, Hq, n, D]
        ctx, total = span.context_len, span.context_len + (e - s)
        if ctx == 0:
            first = 0
            keys = k[s:e].transpose(0, 1).unsqueeze(0)
            values = v[s:e].transpose(0, 1).unsqueeze(0)
        else:
            block_size = k_cache.shape[1]
            first_block = torch_options.first_window_block(ctx, layer.window, block_size)
            first = first_block * block_size
            table = span.block_table[first_block:-(-total // block_size)].unsqueeze(0)
            keys = _gather(k_cache, table)[:, :total - first].transpose(1, 2)
            values = _gather(v_cache, table)[:, :total - first].transpose(1, 2)
        if layer.sinks is not None or layer.softcap is not None:
            attn = torch_options.attend_prefill(query, keys, values, ctx - first, self.scale, layer)
        else:
            key = ("prefill_window", s, layer.window)
            if key not in meta.extra:  # the same for every layer with this window, this step
                meta.extra[key] = torch_options.prefill_visible(torch.arange(ctx, total, device=q.device),
                                                                torch.arange(first, total, device=q.device),
                                                                layer.window)
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=meta.extra[key],
                                                  scale=self.scale, enable_gqa=True)
        out[s:e] = attn.squeeze(0).transpose(0, 1)


def _decode_mask(meta: AttentionMetadata, width: int) -> torch.Tensor:
    """[B, 1, 1, width] True for valid key positions (built once per step)."""
    if "decode_mask" not in meta.extra:
        lens = meta.decode_seq_lens
        valid = torch.arange(width, device=lens.device)[None, :] < lens[:, None]
        meta.extra["decode_mask"] = valid[:, None, None, :]
    return meta.extra["decode_mask"]


class _Fp8View:
    """An fp8 cache with its scale and compute dtype: what `_gather` needs to hand back real K/V."""

    def __init__(self, cache: torch.Tensor, scale: float, dtype: torch.dtype) -> None:
        self.cache, self.scale, self.dtype = cache, scale, dtype
        self.shape = cache.shape


def _readable(cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor | _Fp8View:
    """The cache as `_gather` takes it: an fp8 one together with its scale and the compute dtype."""
    return _Fp8View(cache, scale, dtype) if fp8_kv.is_fp8(cache) else cache


def _gather(cache: torch.Tensor | _Fp8View, tables: torch.Tensor) -> torch.Tensor:
    """[N, bs, H, D] cache, [B, nb] tables -> [B, nb * bs, H, D] (dequantized from an fp8 cache)."""
    if isinstance(cache, _Fp8View):
        blocks = fp8_kv.dequantize(torch.index_select(cache.cache, 0, tables.reshape(-1)), cache.scale, cache.dtype)
    else:
        blocks = torch.index_select(cache, 0, tables.reshape(-1))
    return blocks.view(tables.shape[0], -1, cache.shape[2], cache.shape[3])
