"""VarlenInputBuilder: one packed step (decode tokens and prefill chunks with context) laid out as the
Triton kernels read it, every array 16-byte aligned (Triton specializes kernels on pointer alignment:
unaligned views made it compile new variants mid-run, a third of the GPU throughput)."""
import torch

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.varlen_inputs import VarlenInputBuilder

BS = 4


def scheduled(kv, rid, tokens, computed, new, pending=0):
    request = Request(rid, tokens[:], SamplingParams())
    request.num_computed_tokens = computed
    request.num_pending_tokens = pending
    assert kv.allocate_slots(rid, 0, computed + new) is not None
    return ScheduledRequest(request, new)


def test_mixed_step_layout_and_alignment():
    kv = KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=False)
    kv.allocate_slots("pad", 0, 5)  # later tables do not start at block 0
    items = [scheduled(kv, "a", list(range(100, 107)), 6, 1),     # decode: token 6
             scheduled(kv, "b", list(range(200, 211)), 3, 5),     # chunk 3..8 of 11: no sample
             scheduled(kv, "c", list(range(300, 303)), 0, 3)]     # whole prompt
    for num_decode in (0, 1):  # step sizes that would misalign packed arrays
        builder = VarlenInputBuilder(BS, torch.device("cpu"))
        step = builder.build(SchedulerOutput(scheduled=items[num_decode:] if num_decode else items), kv)
        meta = step.meta
        for t in (step.input_ids, step.positions, step.logits_indices, meta.slot_mapping, meta.cu_q,
                  meta.seq_lens, meta.block_tables):
            assert t.data_ptr() % 16 == 0 and t.dtype == torch.int32
    step = VarlenInputBuilder(BS, torch.device("cpu")).build(SchedulerOutput(scheduled=items), kv)
    meta = step.meta
    assert step.input_ids.tolist() == [106, 203, 204, 205, 206, 207, 300, 301, 302]
    assert step.positions.tolist() == [6, 3, 4, 5, 6, 7, 0, 1, 2]
    slots = [kv.block_table(r)[p // BS] * BS + p % BS for r, p in
             [("a", 6), ("b", 3), ("b", 4), ("b", 5), ("b", 6), ("b", 7), ("c", 0), ("c", 1), ("c", 2)]]
    assert meta.slot_mapping.tolist() == slots
    assert meta.cu_q.tolist() == [0, 1, 6, 9] and meta.seq_lens.tolist() == [7, 8, 3]
    assert step.logits_indices.tolist() == [0, 8]  # b's chunk does not end its prompt
    for row, rid, n in zip(meta.block_tables.tolist(), "abc", (2, 2, 1), strict=True):
        assert row[:n] == kv.block_table(rid)[:n]
    assert meta.max_query_len == 5 and step.num_decode_only == 0
    decode = VarlenInputBuilder(BS, torch.device("cpu")).build(SchedulerOutput(scheduled=items[:1]), kv)
    assert decode.num_decode_only == 1  # a decode batch: eligible for the CUDA graphs


def test_decode_batch_layout_with_a_pending_token():
    """A decode batch (written array by array): each sequence's last token, or PENDING_TOKEN for a token its
    step before sampled that is known only on the device (async scheduling)."""
    from engine.scheduler import PENDING_TOKEN
    kv = KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=False)
    kv.allocate_slots("pad", 0, 3)
    items = [scheduled(kv, "a", list(range(100, 107)), 6, 1),  # decodes token 6
             scheduled(kv, "b", list(range(200, 208)), 7, 1),  # decodes token 7, the last of its block
             scheduled(kv, "c", list(range(300, 305)), 5, 1, pending=1)]  # its token at position 5 is pending
    step = VarlenInputBuilder(BS, torch.device("cpu")).build(SchedulerOutput(scheduled=items), kv)
    meta = step.meta
    assert step.input_ids.tolist() == [106, 207, PENDING_TOKEN]
    assert step.positions.tolist() == [6, 7, 5]
    assert meta.slot_mapping.tolist() == [kv.block_table(r)[p // BS] * BS + p % BS for r, p in
                                          [("a", 6), ("b", 7), ("c", 5)]]
    assert meta.cu_q.tolist() == [0, 1, 2, 3] and meta.seq_lens.tolist() == [7, 8, 6]
    assert step.logits_indices.tolist() == [0, 1, 2] and meta.max_query_len == 1 and step.num_decode_only == 3
    for row, rid in zip(meta.block_tables.tolist(), "abc", strict=True):
        assert row[:2] == kv.block_table(rid)[:2]
