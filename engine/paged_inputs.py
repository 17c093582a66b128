"""Step inputs for the per-kind attention backends (torch, flash), written into preallocated buffers.

Every integer array a step needs — token ids, positions, the block and offset of each
new token's KV slot, the rows to sample, decode rows with their padded block tables
and lengths, each prefill chunk's block table — is written with numpy into one int64
host buffer (grown when a step needs more), and the model reads torch views of it
(on CUDA, of its single copy on the device). Python work per step scales with the
number of sequences, not tokens. Two buffers alternate, so a step's views stay valid
while the next step's inputs are written.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata, PrefillSpan
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import PENDING_TOKEN, SchedulerOutput


@dataclass
class PagedStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor


class PagedInputBuilder:
    def __init__(self, block_size: int, device: torch.device, capacity: int = 1 << 15) -> None:
        self.block_size = block_size
        self.device = device
        self._buffers = [np.empty(capacity, dtype=np.int64) for _ in range(2)]
        self._turn = 0

    def _buffer(self, size: int) -> np.ndarray:
        self._turn ^= 1
        if self._buffers[self._turn].shape[0] < size:
            self._buffers[self._turn] = np.empty(max(size, 2 * self._buffers[self._turn].shape[0]), dtype=np.int64)
        return self._buffers[self._turn]

    def build(self, out: SchedulerOutput, kv: KVCacheManager) -> PagedStep:
        bs = self.block_size
        scheduled = out.scheduled
        tables = [kv.block_table(item.request.request_id) for item in scheduled]
        used = [-(-(item.request.num_computed_tokens + item.num_new_tokens) // bs) for item in scheduled]
        decode = [s for s, item in enumerate(scheduled) if item.num_new_tokens == 1]
        num_tokens = sum(item.num_new_tokens for item in scheduled)
        num_logits = sum(item.num_logits for item in scheduled)
        width = max((used[s] for s in decode), default=0)
        prefill_blocks = sum(used[s] for s, item in enumerate(scheduled) if item.num_new_tokens > 1)
        lengths = (num_tokens, num_tokens, num_tokens, num_tokens, num_logits, len(decode), len(decode) * width,
                   len(decode), prefill_blocks)
        offsets = np.cumsum((0, *lengths))
        flat = self._buffer(int(offsets[-1]))
        ids, pos, blocks, slots, logits, dec_idx, dec_tables, dec_lens, pre_tables = (
            flat[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True))
        dec_tables = dec_tables.reshape(len(decode), width)
        dec_tables.fill(0)
        spans: list[tuple[int, int, int, int, int]] = []  # token start/end, context, table start/end
        t = r = d = p = 0
        for item, table, n_used in zip(scheduled, tables, used, strict=True):
            req = item.request
            start, n = req.num_computed_tokens, item.num_new_tokens
            if n == 1:
                ids[t] = req.all_token_ids[start] if start < len(req.all_token_ids) else PENDING_TOKEN
                pos[t] = start
                blocks[t] = table[start // bs]
                slots[t] = start % bs
                dec_idx[d] = t
                dec_tables[d, :n_used] = table[:n_used]
                dec_lens[d] = start + 1
                d += 1
            else:
                ids[t:t + n] = item.input_token_ids()
                pos[t:t + n] = np.arange(start, start + n)
                own = np.asarray(table[:n_used], dtype=np.int64)
                blocks[t:t + n] = own[pos[t:t + n] // bs]
                slots[t:t + n] = pos[t:t + n] % bs
                pre_tables[p:p + n_used] = own
                spans.append((t, t + n, start, p, p + n_used))
                p += n_used
            t += n
            if item.num_logits:
                logits[r:r + item.num_logits] = np.arange(t - item.num_logits, t)
                r += item.num_logits
        dev = torch.from_numpy(flat[:int(offsets[-1])])
        if self.device.type != "cpu":
            dev = dev.to(self.device)  # one copy (from pageable memory: done before the buffer is reused)
        ids_d, pos_d, blocks_d, slots_d, logits_d, dec_idx_d, dec_tables_d, dec_lens_d, pre_tables_d = (
            dev[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True))
        meta = AttentionMetadata(slot_blocks=blocks_d, slot_offsets=slots_d,
                                 prefills=[PrefillSpan(s, e, ctx, pre_tables_d[a:b]) for s, e, ctx, a, b in spans])
        if decode:
            meta.decode_token_indices = dec_idx_d
            meta.decode_block_tables = dec_tables_d.view(len(decode), width)
            meta.decode_seq_lens = dec_lens_d
        return PagedStep(ids_d, pos_d, meta, logits_d)
