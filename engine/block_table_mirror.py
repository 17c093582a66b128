"""The block tables of the sequences being run, kept between steps as rows of one int32 array.

A step's inputs need each sequence's block table as int32. Converting every table from its Python list each
step made the host's time per step grow with context (bench/host_step_overhead.py, batch 128: 1.56 ms at 512
tokens, 2.08 ms at 2048; 1.35 and 1.43 ms with these rows), yet a table changes little between steps: a decode
sequence appends one block every block_size tokens. So the rows are kept here and brought up to date from the
KV cache manager's lists: what was appended since is copied; a table edited in another way (copy-on-write,
window release, truncation, a new table under the same id) has a new stamp (`KVCacheManager.table_stamps`) and
is copied whole. vLLM's input batch keeps its block tables the same way. No torch: numpy only.
"""
from __future__ import annotations

import numpy as np

from engine.kv_cache_manager import KVCacheManager


class BlockTableMirror:
    def __init__(self, rows: int = 256, cols: int = 64) -> None:
        self.array = np.zeros((rows, cols), dtype=np.int32)
        """Row r holds the table of the sequence given row r (entries past its length are stale)."""
        self._held: dict[str, list[int]] = {}
        """Sequence id -> [row, stamp of the table copied, entries copied]."""
        self._free_rows = list(range(rows - 1, -1, -1))

    def rows(self, kv: KVCacheManager, seq_ids: list[str]) -> np.ndarray:
        """The row of each sequence, brought up to date with its table in `kv` (a sequence without a table gets
        an empty row)."""
        out = np.empty(len(seq_ids), dtype=np.intp)
        tables, stamps = kv.block_tables, kv.table_stamps
        for i, seq_id in enumerate(seq_ids):
            held = self._held.get(seq_id)
            table = tables.get(seq_id, ())
            stamp = stamps.get(seq_id, 0)
            if held is None or held[1] != stamp:
                if held is None:
                    held = self._held[seq_id] = [self._take_row(seq_ids), stamp, 0]
                held[1], held[2] = stamp, 0
            copied = held[2]
            if copied != len(table):
                if len(table) > self.array.shape[1]:
                    self._widen(len(table))
                self.array[held[0], copied:len(table)] = table[copied:]
                held[2] = len(table)
            out[i] = held[0]
        return out

    def _take_row(self, keep: list[str]) -> int:
        """A free row; when none is, the rows of sequences not in `keep` are freed (their sequences may have
        ended), and the array grows if that is not enough."""
        if not self._free_rows:
            wanted = set(keep)
            for seq_id in [s for s in self._held if s not in wanted]:
                self._free_rows.append(self._held.pop(seq_id)[0])
        if not self._free_rows:
            rows = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _widen(self, cols: int) -> None:
        wider = np.zeros((self.array.shape[0], max(cols, 2 * self.array.shape[1])), dtype=np.int32)
        wider[:, :self.array.shape[1]] = self.array
        self.array = wider
