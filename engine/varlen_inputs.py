"""Step inputs for varlen attention backends, built in pinned host memory and sent in one copy.

Every integer array a step needs (token ids, positions, KV slots, which rows
to sample, cumulative query lengths, context lengths, block tables) is
written with numpy into one preallocated int32 host buffer, then moved to the
device with a single non-blocking copy; the model reads views of the device
buffer. Two host buffers alternate, so filling step N+1's inputs never
touches memory a copy of step N may still be reading.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.block_table_mirror import BlockTableMirror
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import PENDING_TOKEN, SchedulerOutput


@dataclass
class VarlenStep:
    """Device views of one step's inputs."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    meta: AttentionMetadata
    num_decode_only: int
    """The step's sequence count when every sequence computes and samples one token (a decode batch), else 0."""


class VarlenInputBuilder:
    def __init__(self, block_size: int, device: torch.device, capacity: int = 1 << 16) -> None:
        self.block_size = block_size
        self.device = device
        self.pin = device.type == "cuda"
        self._capacity = 0
        self._turn = 0
        self._grow(capacity)
        self._tables = BlockTableMirror()

    def _grow(self, capacity: int) -> None:
        self._capacity = capacity
        self._host = [torch.empty(capacity, dtype=torch.int32, pin_memory=self.pin) for _ in range(2)]
        self._device = torch.empty(capacity, dtype=torch.int32, device=self.device)

    def build(self, out: SchedulerOutput, kv: KVCacheManager) -> VarlenStep:
        bs = self.block_size
        scheduled = out.scheduled
        num_seqs = len(scheduled)
        num_tokens = sum(item.num_new_tokens for item in scheduled)
        table_rows = self._tables.rows(kv, [item.request.request_id for item in scheduled])
        width = max(-(-(item.request.num_computed_tokens + item.num_new_tokens) // bs) for item in scheduled)
        num_logits = sum(item.num_logits for item in scheduled)
        lengths = (num_tokens, num_tokens, num_tokens, num_logits, num_seqs + 1, num_seqs, num_seqs * width)
        # Each array starts 16-byte aligned: Triton specializes kernels on pointer alignment, and
        # unaligned views would compile new variants mid-run.
        sizes = [-(-n // 4) * 4 for n in lengths]
        total = sum(sizes)
        if total > self._capacity:
            self._grow(max(total, 2 * self._capacity))
        host = self._host[self._turn]
        self._turn ^= 1
        flat = host.numpy()
        ids, pos, slots, logits, cu_q, seq_lens, block_tables = (
            part[:n] for part, n in zip(np.split(flat[:total], np.cumsum(sizes)[:-1]), lengths, strict=True))
        tables = self._tables.array[table_rows, :width]  # entries past a table's used length are stale
        block_tables.reshape(num_seqs, width)[:] = tables
        if num_tokens == num_seqs == num_logits:  # a decode batch: one token each, every one sampled
            self._fill_decode(scheduled, tables, ids, pos, slots, logits, cu_q, seq_lens)
            return self._send(host, total, sizes, lengths, num_seqs, width, 1, num_seqs)
        t = r = 0
        cu_q[0] = 0
        max_query_len = 0
        for s, (item, table) in enumerate(zip(scheduled, tables, strict=True)):
            req = item.request
            start = req.num_computed_tokens
            n = item.num_new_tokens
            end = start + n
            if n == 1:
                ids[t] = req.all_token_ids[start] if start < len(req.all_token_ids) else PENDING_TOKEN
                pos[t] = start
                slots[t] = table[start // bs] * bs + start % bs
            else:
                ids[t:t + n] = item.input_token_ids()
                p = np.arange(start, end, dtype=np.int32)
                pos[t:t + n] = p
                slots[t:t + n] = table[p // bs] * bs + p % bs
            t += n
            cu_q[s + 1] = t
            seq_lens[s] = end
            max_query_len = max(max_query_len, n)
            rows = item.num_logits
            if rows == 1:
                logits[r] = t - 1
                r += 1
            elif rows:
                logits[r:r + rows] = np.arange(t - rows, t, dtype=np.int32)
                r += rows
        decode_only = max_query_len == 1 and num_logits == num_seqs  # one token each, every one sampled
        return self._send(host, total, sizes, lengths, num_seqs, width, max_query_len, num_seqs if decode_only else 0)

    def _fill_decode(self, scheduled, tables, ids, pos, slots, logits, cu_q, seq_lens) -> None:
        """`build`'s arrays for a decode batch (but the block tables, written already), each written whole."""
        bs = self.block_size
        starts = [item.request.num_computed_tokens for item in scheduled]
        ids[:] = [tokens[s] if s < len(tokens) else PENDING_TOKEN
                  for tokens, s in ((item.request.all_token_ids, s) for item, s in zip(scheduled, starts, strict=True))]
        start = np.asarray(starts, dtype=np.int32)
        pos[:] = start
        slots[:] = tables[np.arange(len(starts)), start // bs] * bs + start % bs
        seq_lens[:] = start + 1
        cu_q[:] = np.arange(len(starts) + 1, dtype=np.int32)
        logits[:] = cu_q[:-1]

    def _send(self, host, total, sizes, lengths, num_seqs, width, max_query_len, num_decode_only) -> VarlenStep:
        """Copy the filled host buffer to the device in one non-blocking copy; the step's views of it."""
        dev = self._device[:total]
        dev.copy_(host[:total], non_blocking=True)
        ids_d, pos_d, slots_d, logits_d, cu_q_d, seq_lens_d, tables_d = (
            part[:n] for part, n in zip(torch.split(dev, sizes), lengths, strict=True))
        meta = AttentionMetadata(slot_mapping=slots_d, cu_q=cu_q_d, seq_lens=seq_lens_d,
                                 block_tables=tables_d.view(num_seqs, width), max_query_len=max_query_len)
        return VarlenStep(ids_d, pos_d, logits_d, meta, num_decode_only)
