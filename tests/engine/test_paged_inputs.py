"""PagedInputBuilder: one packed step (decode tokens and prefill chunks with context) laid out as the torch
backend reads it, written into reused buffers (the second step after a bigger one still reads right)."""
import torch

from engine.kv_cache_manager import KVCacheManager
from engine.paged_inputs import PagedInputBuilder
from engine.scheduler import SchedulerOutput
from tests.engine.test_varlen_inputs import BS, scheduled


def test_mixed_step_layout():
    kv = KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=False)
    kv.allocate_slots("pad", 0, 5)  # later tables do not start at block 0
    items = [scheduled(kv, "a", list(range(100, 107)), 6, 1),     # decode: token 6
             scheduled(kv, "b", list(range(200, 211)), 3, 5),     # chunk 3..8 of 11: no sample
             scheduled(kv, "d", list(range(400, 410)), 9, 1),     # decode: token 9, three blocks
             scheduled(kv, "c", list(range(300, 303)), 0, 3)]     # whole prompt
    builder = PagedInputBuilder(BS, torch.device("cpu"), capacity=8)  # too small: grows
    for _ in range(3):  # buffers alternate and are reused: each build reads the same
        step = builder.build(SchedulerOutput(scheduled=items), kv)
        meta = step.meta
        assert step.input_ids.tolist() == [106, 203, 204, 205, 206, 207, 409, 300, 301, 302]
        assert step.positions.tolist() == [6, 3, 4, 5, 6, 7, 9, 0, 1, 2]
        where = [("a", 6), ("b", 3), ("b", 4), ("b", 5), ("b", 6), ("b", 7), ("d", 9), ("c", 0), ("c", 1), ("c", 2)]
        assert meta.slot_blocks.tolist() == [kv.block_table(r)[p // BS] for r, p in where]
        assert meta.slot_offsets.tolist() == [p % BS for _, p in where]
        assert step.logits_indices.tolist() == [0, 6, 9]  # b's chunk does not end its prompt
        assert meta.decode_token_indices.tolist() == [0, 6]
        assert meta.decode_seq_lens.tolist() == [7, 10]
        assert meta.decode_block_tables.tolist() == [kv.block_table("a")[:2] + [0], kv.block_table("d")[:3]]
        assert [(s.token_start, s.token_end, s.context_len, s.block_table.tolist()) for s in meta.prefills] == [
            (1, 6, 3, kv.block_table("b")[:2]), (7, 10, 0, kv.block_table("c")[:1])]
        for t in (step.input_ids, step.positions, meta.slot_blocks, meta.decode_block_tables):
            assert t.dtype == torch.int64
        small = builder.build(SchedulerOutput(scheduled=items[:1]), kv)  # decode only: no prefill spans
        assert small.input_ids.tolist() == [106] and not small.meta.prefills
        assert small.meta.decode_block_tables.tolist() == [kv.block_table("a")[:2]]
