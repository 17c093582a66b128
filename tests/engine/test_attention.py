"""Attention backends agree: the C++ decode kernel, the torch SDPA path, and a dense reference.

The kernel is checked as built for this CPU and as built for x86-64-v3 (AVX2, no AVX-512), so its
portable paths are tested on every x86 machine, AVX-512 or not.
"""
import os
import platform

import pytest
import torch

from engine import cpu_kernels
from engine.attention import AttentionMetadata, PrefillSpan
from engine.attention.torch_paged import TorchPagedAttention

H, HKV, D, BS, NB = 9, 3, 64, 16, 40
X86 = platform.machine() in ("x86_64", "AMD64")


@pytest.fixture(scope="module")
def kernel_without_avx512():
    """The kernel compiled for x86-64-v3 (AVX2 and FMA, which every AVX-512 machine also has; x86-64-v2
    on the rare x86 machine without AVX2)."""
    module = cpu_kernels.build("x86-64-v3" if torch.cpu._is_avx2_supported() else "x86-64-v2")
    assert not module.avx512, "a build for x86-64-v3 has no AVX-512 paths"
    return module


def dense_reference(q, keys, values, scale):
    """q: [Hq, D] attending keys/values [L, Hkv, D] (GQA by repetition), float64."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_decode_over_scattered_blocks(dtype, use_kernel):
    if use_kernel:
        kernel = cpu_kernels.load()
        assert kernel is not None, "the C++ kernel must build on our CPU machines"
        if os.environ.get("PDSERVE_CPU_KERNELS_MARCH", "native") == "native":  # AVX-512 paths iff this CPU has it
            assert kernel.avx512 == torch.cpu._is_avx512_supported(), "built for this CPU (-march=native)"
    backend = TorchPagedAttention(H, HKV, D, D ** -0.5, use_cpu_kernel=use_kernel)
    assert (backend.kernel is not None) == use_kernel
    check_decode_over_scattered_blocks(backend, dtype)


@pytest.mark.skipif(not X86, reason="x86 target")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_built_without_avx512(dtype, kernel_without_avx512):
    backend = TorchPagedAttention(H, HKV, D, D ** -0.5, use_cpu_kernel=False)
    backend.kernel = kernel_without_avx512
    check_decode_over_scattered_blocks(backend, dtype)


def check_decode_over_scattered_blocks(backend, dtype):
    """GQA decode of sequences ending in partial blocks, through scattered blocks of a strided cache."""
    torch.manual_seed(0)
    kv = torch.randn(NB, 2, 2, BS, HKV, D).to(dtype)  # [blocks, layers, K/V, ...]: strided views
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    lens = [1, 17, 40, 130]
    perm = torch.randperm(NB).tolist()
    tables, start = [], 0
    for n in lens:
        need = -(-n // BS)
        tables.append(perm[start:start + need])
        start += need
    width = max(map(len, tables))
    q = torch.randn(len(lens), H, D).to(dtype)
    new_k = torch.randn(len(lens), HKV, D).to(dtype)
    new_v = torch.randn(len(lens), HKV, D).to(dtype)
    slots = [(t[(n - 1) // BS], (n - 1) % BS) for t, n in zip(tables, lens, strict=True)]
    meta = AttentionMetadata(
        slot_blocks=torch.tensor([b for b, _ in slots]), slot_offsets=torch.tensor([o for _, o in slots]),
        decode_token_indices=torch.arange(len(lens)),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_seq_lens=torch.tensor(lens))
    out = backend.forward(q, new_k, new_v, k_cache, v_cache, meta)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):
        keys = k_cache[table].reshape(-1, HKV, D)[:n]
        values = v_cache[table].reshape(-1, HKV, D)[:n]
        assert torch.equal(keys[-1], new_k[i]) and torch.equal(values[-1], new_v[i])  # written in place
        ref = dense_reference(q[i], keys, values, D ** -0.5)
        torch.testing.assert_close(out[i].double(), ref, atol=tol, rtol=tol)


def test_prefill_chunk_with_cached_context():
    torch.manual_seed(1)
    kv = torch.zeros(NB, 1, 2, BS, HKV, D)
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]
    ctx, n = 20, 7
    table = [5, 9]
    keys_all = torch.randn(ctx + n, HKV, D)
    values_all = torch.randn(ctx + n, HKV, D)
    for t in range(ctx):
        k_cache[table[t // BS], t % BS] = keys_all[t]
        v_cache[table[t // BS], t % BS] = values_all[t]
    q = torch.randn(n, H, D)
    pos = range(ctx, ctx + n)
    meta = AttentionMetadata(slot_blocks=torch.tensor([table[p // BS] for p in pos]),
                             slot_offsets=torch.tensor([p % BS for p in pos]),
                             prefills=[PrefillSpan(0, n, ctx, torch.tensor(table))])
    out = TorchPagedAttention(H, HKV, D, D ** -0.5).forward(q, keys_all[ctx:], values_all[ctx:],
                                                             k_cache, v_cache, meta)
    for i in range(n):
        ref = dense_reference(q[i], keys_all[:ctx + i + 1], values_all[:ctx + i + 1], D ** -0.5)
        torch.testing.assert_close(out[i].double(), ref, atol=1e-4, rtol=1e-4)
