"""Sliding windows, attention sinks and logit soft-capping for the torch backend's gathered paths.

Helpers for engine/attention/torch_paged.py when a layer is not plain (`LayerAttention`):

  window   only the blocks holding keys some query can see are gathered (`window_decode_tables`,
           `first_window_block`): blocks wholly before a window may already be freed and reused
           by another sequence, so they are never read, not merely masked (0 * NaN is NaN)
  sinks    one more softmax column per head, logit = the head's sink, value zero
  softcap  scores = softcap * tanh(scores / softcap), after the scale, before the mask

A window alone still goes through SDPA with a boolean mask; sinks or soft-capping take `attend`,
an explicit float32 softmax (SDPA has neither), over query chunks of bounded size in a prefill.
"""
from __future__ import annotations

import torch

from engine.attention.backend import LayerAttention

SCORES_PER_CHUNK = 1 << 24
"""At most this many float32 scores materialized at once by `attend_prefill` (64 MiB)."""


def window_decode_tables(tables: torch.Tensor, lens: torch.Tensor, window: int,
                         block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode block tables [B, W] cut to the blocks of each sequence's window: ([B, W'] tables, [B] key
    position of column 0). Column j of row b is table column first_b + j, first_b being the block of
    key max(0, len_b - window); columns past the table's width repeat its last one (masked: past len)."""
    width = min(tables.shape[1], (window + block_size - 2) // block_size + 1)
    first = (lens - window).clamp_(min=0) // block_size
    cols = (first[:, None] + torch.arange(width, device=tables.device)).clamp_(max=tables.shape[1] - 1)
    return tables.gather(1, cols), first * block_size


def decode_visible(lens: torch.Tensor, first_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """[B, 1, 1, num_keys] True where key column j (position first_pos + j) is in the sequence's window."""
    pos = first_pos[:, None] + torch.arange(num_keys, device=lens.device)[None, :]
    visible = pos < lens[:, None]
    if window is not None:
        visible &= pos >= (lens - window)[:, None]
    return visible[:, None, None, :]


def first_window_block(context_len: int, window: int | None, block_size: int) -> int:
    """The first block a chunk starting at position `context_len` reads: its first query sees keys
    from context_len - window + 1 on."""
    return 0 if window is None else max(0, context_len - window + 1) // block_size


def prefill_visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[n, L] True where the query at query_pos[i] sees the key at key_pos[j]: p - window < j <= p."""
    visible = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        visible &= key_pos[None, :] > (query_pos - window)[:, None]
    return visible


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float,
           layer: LayerAttention) -> torch.Tensor:
    """query [B, Hq, n, D] over keys/values [B, Hkv, L, D] (query heads grouped per KV head), visible
    broadcastable to [B, Hq, n, L] (every row sees at least one key); float32 softmax with the layer's
    soft-cap and sinks. Returns [B, Hq, n, D] in query's dtype."""
    batch, num_heads, n, dim = query.shape
    num_kv_heads, num_keys = keys.shape[1], keys.shape[2]
    rows = query.reshape(batch, num_kv_heads, num_heads // num_kv_heads * n, dim).float()
    scores = torch.matmul(rows, keys.float().transpose(-1, -2)).mul_(scale)
    scores = scores.view(batch, num_heads, n, num_keys)
    if layer.softcap is not None:
        scores = scores.div_(layer.softcap).tanh_().mul_(layer.softcap)
    scores.masked_fill_(~visible, float("-inf"))
    if layer.sinks is not None:
        sinks = layer.sinks.to(device=scores.device, dtype=torch.float32).view(1, num_heads, 1, 1)
        scores = torch.cat([scores, sinks.expand(batch, num_heads, n, 1)], dim=-1)
        probs = scores.softmax(-1)[..., :num_keys]
    else:
        probs = scores.softmax(-1)
    probs = probs.reshape(batch, num_kv_heads, -1, num_keys)
    out = torch.matmul(probs, values.float()).view(batch, num_heads, n, dim)
    return out.to(query.dtype)


def attend_prefill(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_query_key: int,
                   scale: float, layer: LayerAttention) -> torch.Tensor:
    """query [1, Hq, n, D], query i at key index first_query_key + i of keys/values [1, Hkv, L, D];
    causal within `layer.window`. `attend` over chunks of queries, each with only the keys it sees."""
    num_heads, n = query.shape[1], query.shape[2]
    num_keys = keys.shape[2]
    chunk = max(16, SCORES_PER_CHUNK // (num_heads * num_keys))
    device = query.device
    out = torch.empty_like(query)
    for i0 in range(0, n, chunk):
        i1 = min(n, i0 + chunk)
        last = first_query_key + i1  # one past the last key the chunk sees
        lo = 0 if layer.window is None else max(0, first_query_key + i0 - layer.window + 1)
        visible = prefill_visible(torch.arange(first_query_key + i0, last, device=device),
                                  torch.arange(lo, last, device=device), layer.window)
        out[:, :, i0:i1] = attend(query[:, :, i0:i1], keys[:, :, lo:last], values[:, :, lo:last], visible,
                                  scale, layer)
    return out
