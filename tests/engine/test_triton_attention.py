"""Triton paged-attention and KV-write kernels match a dense float64 reference.

On CPU they run under Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported); on a GPU host the same tests run the compiled kernels.
Steps mix decode tokens and prefill chunks with cached context, over
non-contiguous block tables with partial last blocks.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="the triton wheel is part of the test install")

from engine.attention.triton_kernels import paged_attention, write_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 64


def dense_reference(q, keys, values, context_len, scale):
    """q [n, Hq, D] at positions context_len.. over keys/values [context_len + n, Hkv, D], causal, float64."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    n, total = q.shape[0], keys.shape[0]
    visible = torch.arange(total)[None, :] <= (context_len + torch.arange(n))[:, None]
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_step(query_lens, context_lens, heads, kv_heads, block_size, dtype, seed=0):
    """A packed step over a shuffled paged cache; returns everything the kernels and the reference need."""
    gen = torch.Generator().manual_seed(seed)
    totals = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    need = [-(-t // block_size) for t in totals]
    num_blocks = sum(need) + 5
    # [blocks, layers, K/V, block, heads, dim]: the per-layer views are strided like the engine's.
    kv = torch.randn(num_blocks, 2, 2, block_size, kv_heads, D, generator=gen).to(dtype).to(DEVICE)
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    width = max(need) + 2
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, heads, D, generator=gen).to(dtype).to(DEVICE)
    new_kv = torch.randn(num_tokens, heads + 2 * kv_heads, D, generator=gen).to(dtype).to(DEVICE)
    new_k, new_v = new_kv[:, heads:heads + kv_heads], new_kv[:, heads + kv_heads:]  # strided, as in the model
    slots = []
    for table, c, n in zip(tables, context_lens, query_lens, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
    cu_q = torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).to(torch.int32)
    return dict(k_cache=k_cache, v_cache=v_cache, tables=tables, block_tables=block_tables, q=q, new_k=new_k,
                new_v=new_v, slots=torch.tensor(slots, device=DEVICE), cu_q=cu_q,
                seq_lens=torch.tensor(totals, dtype=torch.int32, device=DEVICE))


CASES = [
    # (query lens, context lens): decode only; prefill only; mixed decode + chunks with context
    ([1, 1, 1, 1], [0, 16, 39, 130]),
    ([7, 33], [0, 0]),
    ([1, 20, 1, 5, 1], [47, 13, 0, 64, 15]),
]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (10, 2), (16, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_attention_matches_dense_reference(heads, kv_heads, block_size, case):
    query_lens, context_lens = CASES[case]
    dtype = torch.float32 if case != 2 else torch.bfloat16
    step = make_step(query_lens, context_lens, heads, kv_heads, block_size, dtype, seed=case)
    write_kv(step["new_k"], step["new_v"], step["k_cache"], step["v_cache"], step["slots"])
    scale = D ** -0.5
    out = paged_attention(step["q"], step["k_cache"], step["v_cache"], step["block_tables"], step["seq_lens"],
                          step["cu_q"], max(query_lens), scale)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    start = 0
    for table, c, n in zip(step["tables"], context_lens, query_lens, strict=True):
        keys = step["k_cache"][table].reshape(-1, kv_heads, D)[:c + n]
        values = step["v_cache"][table].reshape(-1, kv_heads, D)[:c + n]
        # the new tokens' K/V landed in their slots
        torch.testing.assert_close(keys[c:], step["new_k"][start:start + n], rtol=0, atol=0)
        torch.testing.assert_close(values[c:], step["new_v"][start:start + n], rtol=0, atol=0)
        ref = dense_reference(step["q"][start:start + n], keys, values, c, scale)
        torch.testing.assert_close(out[start:start + n].double(), ref, atol=tol, rtol=tol)
        start += n


@pytest.mark.parametrize("tiles", [(16, 16, 2, 1), (32, 128, 8, 3), (128, 32, 4, 2)], ids=str)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (10, 2)])
def test_tuning_candidates_match_the_dense_reference(tiles, heads, kv_heads):
    """Tiles other than the defaults (what bench/tune_attention_tiles.py tries and the tile table may hold):
    smaller and larger query blocks and key tiles over a mixed step of decode tokens and chunks with context."""
    from engine.attention.tile_table import Tiles
    query_lens, context_lens = CASES[2]
    step = make_step(query_lens, context_lens, heads, kv_heads, 16, torch.float32, seed=11)
    write_kv(step["new_k"], step["new_v"], step["k_cache"], step["v_cache"], step["slots"])
    scale = D ** -0.5
    out = paged_attention(step["q"], step["k_cache"], step["v_cache"], step["block_tables"], step["seq_lens"],
                          step["cu_q"], max(query_lens), scale, tiles=Tiles(*tiles))
    start = 0
    for table, c, n in zip(step["tables"], context_lens, query_lens, strict=True):
        keys = step["k_cache"][table].reshape(-1, kv_heads, D)[:c + n]
        values = step["v_cache"][table].reshape(-1, kv_heads, D)[:c + n]
        ref = dense_reference(step["q"][start:start + n], keys, values, c, scale)
        torch.testing.assert_close(out[start:start + n].double(), ref, atol=2e-4, rtol=2e-4)
        start += n


def test_write_kv_skips_negative_slots():
    step = make_step([3], [0], 4, 2, 16, torch.float32)
    before = step["k_cache"].clone()
    slots = step["slots"].clone()
    slots[1] = -1
    write_kv(step["new_k"], step["new_v"], step["k_cache"], step["v_cache"], slots)
    changed = (step["k_cache"] != before).any(dim=(2, 3)).nonzero().tolist()
    written = sorted([divmod(int(s), 16) for s in slots if s >= 0])
    assert sorted(map(tuple, changed)) == written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_written_scaled_and_read_back(dtype):
    """An fp8 cache: the write stores K / k_scale saturated as the torch backend does (checked on GPUs);
    attention over it matches the dense reference over the dequantized cache."""
    from engine.attention import fp8_kv
    query_lens, context_lens = CASES[2]
    step = make_step(query_lens, context_lens, 6, 2, 16, dtype, seed=3)
    k_cache = step["k_cache"].float().to(torch.float8_e4m3fn)
    v_cache = step["v_cache"].float().to(torch.float8_e4m3fn)
    k_scale, v_scale = 0.02, 0.005  # the new K reach 5 / 0.02 = 250; some V saturate at 448
    blocks, offsets = step["slots"] // 16, step["slots"] % 16
    if DEVICE == "cuda":
        write_kv(step["new_k"], step["new_v"], k_cache, v_cache, step["slots"], k_scale, v_scale)
        assert torch.equal(k_cache[blocks, offsets].view(torch.uint8),
                           fp8_kv.quantize(step["new_k"], k_scale).view(torch.uint8))
        assert torch.equal(v_cache[blocks, offsets].view(torch.uint8),
                           fp8_kv.quantize(step["new_v"], v_scale).view(torch.uint8))
    else:  # the interpreter rounds float32 -> e4m3 wrongly across a binade (127.3 -> 64): reads only here
        k_cache[blocks, offsets] = fp8_kv.quantize(step["new_k"], k_scale)
        v_cache[blocks, offsets] = fp8_kv.quantize(step["new_v"], v_scale)
    scale = D ** -0.5
    out = paged_attention(step["q"], k_cache, v_cache, step["block_tables"], step["seq_lens"], step["cu_q"],
                          max(query_lens), scale, k_scale=k_scale, v_scale=v_scale)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    start = 0
    for table, c, n in zip(step["tables"], context_lens, query_lens, strict=True):
        keys = fp8_kv.dequantize(k_cache[table], k_scale, torch.float64).reshape(-1, 2, D)[:c + n]
        values = fp8_kv.dequantize(v_cache[table], v_scale, torch.float64).reshape(-1, 2, D)[:c + n]
        ref = dense_reference(step["q"][start:start + n], keys, values, c, scale)
        torch.testing.assert_close(out[start:start + n].double(), ref, atol=tol, rtol=tol)
        start += n


@pytest.mark.parametrize("kv_splits", [2, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (10, 2)])
def test_split_kv_decode_matches_dense_reference(kv_splits, heads, kv_heads):
    """Decode attention with each sequence's keys cut into shares and merged after (flash-decoding) equals the
    dense reference, whatever the split count: contexts of 1 token (most shares empty) to several tiles."""
    query_lens, context_lens = [1, 1, 1, 1, 1], [0, 5, 31, 130, 300]
    step = make_step(query_lens, context_lens, heads, kv_heads, 16, torch.float32, seed=kv_splits)
    write_kv(step["new_k"], step["new_v"], step["k_cache"], step["v_cache"], step["slots"])
    scale = D ** -0.5
    out = paged_attention(step["q"], step["k_cache"], step["v_cache"], step["block_tables"], step["seq_lens"],
                          step["cu_q"], 1, scale, kv_splits=kv_splits)
    whole = paged_attention(step["q"], step["k_cache"], step["v_cache"], step["block_tables"], step["seq_lens"],
                            step["cu_q"], 1, scale, kv_splits=1)
    for i, (table, c) in enumerate(zip(step["tables"], context_lens, strict=True)):
        keys = step["k_cache"][table].reshape(-1, kv_heads, D)[:c + 1]
        values = step["v_cache"][table].reshape(-1, kv_heads, D)[:c + 1]
        ref = dense_reference(step["q"][i:i + 1], keys, values, c, scale)
        torch.testing.assert_close(out[i:i + 1].double(), ref, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)


def test_split_count_fills_the_device_only_for_small_batches(monkeypatch):
    from engine.attention import triton_kernels
    assert triton_kernels.decode_kv_splits(1, 8, torch.device("cpu")) == 1  # off CUDA: one share

    class Props:
        multi_processor_count = 132  # an H100

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    cuda = torch.device("cuda")
    monkeypatch.delenv("PDSERVE_SPLIT_KV", raising=False)
    assert triton_kernels.decode_kv_splits(4, 8, cuda) == 1  # opt-in until measured on a GPU
    monkeypatch.setenv("PDSERVE_SPLIT_KV", "1")
    assert triton_kernels.decode_kv_splits(128, 8, cuda) == 1  # 1,024 programs already
    assert triton_kernels.decode_kv_splits(4, 8, cuda) == 16  # 32 programs: 264 / 32 -> 9 -> 16
    assert triton_kernels.decode_kv_splits(16, 8, cuda) == 4  # 128: 264 / 128 -> 3 -> 4
