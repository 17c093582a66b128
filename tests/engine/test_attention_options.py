"""Sliding windows, attention sinks and logit soft-capping in every attention backend, against a naive reference.

Each backend — torch with the C++ decode kernel (built for this CPU, and for x86-64-v3: its portable
paths), torch without it (gathered SDPA / explicit softmax), Triton under its interpreter — attends a
packed step (decode tokens, prompts without context, chunks with cached context, mixed) over a
shuffled, strided paged cache, and must equal a dense float64 reference. Blocks wholly before a
window are pointed at a block of NaN, as a freed and reused block would be: a backend that reads
them, even to mask them, returns NaN.
"""
from __future__ import annotations

import os
import platform
from dataclasses import fields, replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import cpu_kernels  # noqa: E402
from engine.attention import AttentionMetadata, LayerAttention, PrefillSpan, fp8_kv  # noqa: E402
from engine.attention.flash_paged import FlashPagedAttention  # noqa: E402
from engine.attention.torch_paged import TorchPagedAttention  # noqa: E402

H, HKV, D, BS = 8, 2, 64, 16
SCALE = D ** -0.5
POISON = 1
"""The block every table entry wholly before a window points at: all NaN (block 0 stays finite: decode
tables are padded with it)."""
X86 = platform.machine() in ("x86_64", "AMD64")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Compiled Triton reads device memory only: on a GPU host the Triton backend's steps move there."""

CASES = {
    # name: (query lens, context lens)
    "decode": ([1, 1, 1, 1], [0, 16, 39, 130]),
    "prefill": ([7, 40], [0, 0]),
    "chunk": ([21], [45]),
    "mixed": ([1, 20, 1, 5, 1], [47, 13, 0, 64, 15]),
}
SINKS = torch.linspace(-1.5, 3.0, H)
OPTIONS = {
    "plain": {},
    "window5": dict(window=5),        # inside one block
    "window20": dict(window=20),      # across blocks
    "window1": dict(window=1),        # the token itself
    "window1000": dict(window=1000),  # wider than every context
    "sinks": dict(sinks=SINKS),
    "softcap": dict(softcap=1.5),
    "window5+sinks": dict(window=5, sinks=SINKS),
    "window20+softcap": dict(window=20, softcap=1.5),
    "window20+sinks+softcap": dict(window=20, sinks=SINKS, softcap=1.5),
    "sinks+softcap": dict(sinks=SINKS, softcap=2.0),
}


def reference(q, keys, values, context_len, layer: LayerAttention):
    """q [n, Hq, D] at positions context_len.. over keys/values [context_len + n, Hkv, D], float64."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    if layer.softcap is not None:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    q_pos = context_len + torch.arange(q.shape[0])
    k_pos = torch.arange(keys.shape[0])
    visible = k_pos[None, :] <= q_pos[:, None]
    if layer.window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - layer.window
    scores = scores.masked_fill(~visible, float("-inf"))
    if layer.sinks is not None:
        sinks = layer.sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


class Step:
    """A packed step over a shuffled paged cache (strided per-layer views), in both metadata forms."""

    def __init__(self, query_lens, context_lens, window, dtype, heads=H, kv_heads=HKV, kv_scales=None, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.query_lens, self.context_lens = query_lens, context_lens
        totals = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
        need = [-(-t // BS) for t in totals]
        num_blocks = sum(need) + 2
        cache_dtype = fp8_kv.FP8_DTYPE if kv_scales else dtype
        self.kv_scales = kv_scales or (1.0, 1.0)
        kv = torch.randn(num_blocks, 2, 2, BS, kv_heads, D, generator=gen).to(cache_dtype)  # [blocks, layers, K/V..]
        kv[POISON] = float("nan")
        self.k_cache, self.v_cache = kv[:, 1, 0], kv[:, 1, 1]
        perm = (torch.randperm(num_blocks - 2, generator=gen) + 2).tolist()
        self.tables, self.keys, self.values, self.poisoned = [], [], [], 0
        q_rows, k_rows, v_rows, slots = [], [], [], []
        for c, n, total, blocks in zip(context_lens, query_lens, totals, need, strict=True):
            table, perm = perm[:blocks], perm[blocks:]
            keys = (torch.randn(total, kv_heads, D, generator=gen) * 1.5).to(dtype)
            values = torch.randn(total, kv_heads, D, generator=gen).to(dtype)
            if kv_scales:  # what the cache holds, read back
                keys = fp8_kv.dequantize(fp8_kv.quantize(keys, self.kv_scales[0]), self.kv_scales[0], dtype)
                values = fp8_kv.dequantize(fp8_kv.quantize(values, self.kv_scales[1]), self.kv_scales[1], dtype)
            first_seen = 0 if window is None else max(0, c - window + 1)  # the first query's first key
            for j in range(first_seen // BS):  # freed behind the window: now another block's data
                table[j] = POISON
                self.poisoned += 1
            for t in range(c):
                if table[t // BS] != POISON:
                    self.k_cache[table[t // BS], t % BS] = self._stored(keys[t], 0)
                    self.v_cache[table[t // BS], t % BS] = self._stored(values[t], 1)
            slots += [(table[p // BS], p % BS) for p in range(c, total)]
            q_rows.append((torch.randn(n, heads, D, generator=gen) * 2).to(dtype))
            k_rows.append(keys[c:])
            v_rows.append(values[c:])
            self.tables.append(table)
            self.keys.append(keys)
            self.values.append(values)
        self.q = torch.cat(q_rows)
        self.new_k, self.new_v = torch.cat(k_rows), torch.cat(v_rows)
        self.slots = slots

    def _stored(self, x, which):
        return fp8_kv.quantize(x, self.kv_scales[which]) if fp8_kv.is_fp8(self.k_cache) else x

    def meta(self) -> AttentionMetadata:
        """Both forms: per kind (torch) and varlen (triton)."""
        starts = torch.tensor([0] + self.query_lens).cumsum(0).tolist()
        decode = [i for i, n in enumerate(self.query_lens) if n == 1]
        meta = AttentionMetadata(slot_blocks=torch.tensor([b for b, _ in self.slots]),
                                 slot_offsets=torch.tensor([o for _, o in self.slots]))
        if decode:
            width = max(len(self.tables[i]) for i in decode)
            meta.decode_token_indices = torch.tensor([starts[i] for i in decode])
            meta.decode_block_tables = torch.tensor([self.tables[i] + [0] * (width - len(self.tables[i]))
                                                     for i in decode])
            meta.decode_seq_lens = torch.tensor([self.context_lens[i] + 1 for i in decode])
        meta.prefills = [PrefillSpan(starts[i], starts[i + 1], c, torch.tensor(self.tables[i]))
                         for i, c in enumerate(self.context_lens) if self.query_lens[i] > 1]
        width = max(map(len, self.tables)) + 1
        meta.slot_mapping = torch.tensor([b * BS + o for b, o in self.slots])
        meta.cu_q = torch.tensor(starts, dtype=torch.int32)
        meta.seq_lens = torch.tensor([c + n for c, n in zip(self.context_lens, self.query_lens, strict=True)],
                                     dtype=torch.int32)
        meta.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        meta.max_query_len = max(self.query_lens)
        return meta

    def check(self, out, layer: LayerAttention, tol: float) -> None:
        assert torch.isfinite(out).all(), "a NaN leaked in: a block before the window was read"
        start = 0
        for c, n, keys, values in zip(self.context_lens, self.query_lens, self.keys, self.values, strict=True):
            want = reference(self.q[start:start + n], keys, values, c, layer)
            torch.testing.assert_close(out[start:start + n].double(), want, atol=tol, rtol=tol)
            start += n


@pytest.fixture(scope="module")
def avx2_kernel():
    """The C++ kernel built for x86-64-v3 (AVX2, no AVX-512); x86-64-v2 on an x86 CPU without AVX2."""
    if not X86:
        pytest.skip("x86 target")
    module = cpu_kernels.build("x86-64-v3" if torch.cpu._is_avx2_supported() else "x86-64-v2")
    assert not module.avx512
    return module


def torch_backend(kind, avx2_kernel_fixture=None, heads=H, kv_heads=HKV):
    backend = TorchPagedAttention(heads, kv_heads, D, SCALE, use_cpu_kernel=kind == "kernel")
    if kind == "kernel":
        assert backend.kernel is not None, "the C++ kernel must build on our CPU machines"
    if kind == "kernel-avx2":
        backend.kernel = avx2_kernel_fixture
    return backend


def run(backend, step: Step, layer: LayerAttention, device: str = "cpu"):
    """The backend's output for the step, computed on `device` (returned on the CPU)."""
    meta = step.meta()
    if device != "cpu":
        for f in fields(meta):
            if isinstance(getattr(meta, f.name), torch.Tensor):
                setattr(meta, f.name, getattr(meta, f.name).to(device))
        meta.prefills = [replace(span, block_table=span.block_table.to(device)) for span in meta.prefills]
        if layer.sinks is not None:
            layer = replace(layer, sinks=layer.sinks.to(device))
    q, k, v, k_cache, v_cache = (t.to(device) for t in (step.q, step.new_k, step.new_v, step.k_cache, step.v_cache))
    return backend.forward(q, k, v, k_cache, v_cache, meta, step.kv_scales, layer).cpu()


TORCH_KINDS = ["kernel", "kernel-avx2", "sdpa"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_torch_backend_matches_reference(kind, case, option, dtype, request):
    layer = LayerAttention(**OPTIONS[option])
    backend = torch_backend(kind, request.getfixturevalue("avx2_kernel") if kind == "kernel-avx2" else None)
    step = Step(*CASES[case], layer.window, dtype, seed=len(case) + len(option))
    if layer.window is not None and layer.window < 40 and case != "prefill":
        assert step.poisoned, "the step must have freed blocks before its windows"
    step.check(run(backend, step, layer), layer, 1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("option", ["window5", "window20+sinks+softcap", "sinks", "softcap"])
@pytest.mark.parametrize("case", ["decode", "mixed"])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_torch_backend_with_fp8_cache(kind, case, option, request):
    layer = LayerAttention(**OPTIONS[option])
    backend = torch_backend(kind, request.getfixturevalue("avx2_kernel") if kind == "kernel-avx2" else None)
    step = Step(*CASES[case], layer.window, torch.bfloat16, kv_scales=(0.02, 0.015), seed=3)
    assert fp8_kv.is_fp8(step.k_cache)
    step.check(run(backend, step, layer), layer, 3e-2)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (16, 2), (6, 3)])
@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_torch_backend_other_head_groupings(kind, heads, kv_heads, request):
    """Multi-head (no grouping), 8 query heads per KV head (the AVX-512 path's most), an odd group."""
    layer = LayerAttention(window=20, sinks=torch.linspace(-1, 2, heads), softcap=1.5)
    backend = torch_backend(kind, request.getfixturevalue("avx2_kernel") if kind == "kernel-avx2" else None,
                            heads, kv_heads)
    for dtype in (torch.float32, torch.bfloat16):
        step = Step(*CASES["mixed"], layer.window, dtype, heads=heads, kv_heads=kv_heads, seed=heads)
        step.check(run(backend, step, layer), layer, 1e-4 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("kind", TORCH_KINDS)
def test_layers_with_different_options_share_one_step(kind, request):
    """Layers alternate windows within a step: each gets its own masks and tables, not the previous layer's."""
    backend = torch_backend(kind, request.getfixturevalue("avx2_kernel") if kind == "kernel-avx2" else None)
    step = Step(*CASES["mixed"], None, torch.float32, seed=9)
    meta = step.meta()
    for layer in [LayerAttention(window=5), LayerAttention(), LayerAttention(window=20), LayerAttention(window=5),
                  LayerAttention(sinks=SINKS), LayerAttention(window=20, softcap=1.5), LayerAttention()]:
        out = backend.forward(step.q, step.new_k, step.new_v, step.k_cache, step.v_cache, meta, (1.0, 1.0), layer)
        step.check(out, layer, 1e-4)


def test_options_change_the_result():
    """Each option bites on these inputs (so the reference comparisons above test something)."""
    step = Step(*CASES["mixed"], None, torch.float32, seed=4)
    plain = run(torch_backend("sdpa"), step, LayerAttention())
    for option in ("window20", "sinks", "softcap"):
        out = run(torch_backend("sdpa"), step, LayerAttention(**OPTIONS[option]))
        assert (out - plain).abs().max() > 0.05, option


def test_prefill_in_bounded_chunks(monkeypatch):
    """A long prompt under sinks/soft-capping is attended in query chunks, each over only the keys it sees."""
    from engine.attention import torch_options
    monkeypatch.setattr(torch_options, "SCORES_PER_CHUNK", 16 * H * 40)  # chunks of 16 queries
    for option in ("window20+sinks+softcap", "sinks+softcap"):
        layer = LayerAttention(**OPTIONS[option])
        step = Step([100, 37], [0, 50], layer.window, torch.float32, seed=11)
        step.check(run(torch_backend("sdpa"), step, layer), layer, 1e-4)


def test_kernel_rejects_bad_sinks():
    kernel = cpu_kernels.load()
    step = Step(*CASES["decode"], None, torch.float32)
    meta = step.meta()
    with pytest.raises(RuntimeError, match="sinks must be"):
        kernel.paged_decode_attention(step.q, step.k_cache, step.v_cache, meta.decode_block_tables,
                                      meta.decode_seq_lens, SCALE, 1.0, 1.0, 0, torch.zeros(H + 1), 0.0)


def test_a_backend_without_sinks_refuses_them_by_name():
    assert FlashPagedAttention.supports_sinks is False and TorchPagedAttention.supports_sinks
    flash = object.__new__(FlashPagedAttention)  # its constructor needs a GPU; the check does not
    flash.check_layers([LayerAttention(window=4), LayerAttention(softcap=30.0)], "flash")
    with pytest.raises(ValueError, match=r"attention_backend='flash' cannot compute attention sinks .*`sinks`"):
        flash.check_layers([LayerAttention(window=4), LayerAttention(sinks=SINKS)], "flash")


TRITON_OPTIONS = ["plain", "window5", "window20", "window1", "window1000", "window5+sinks", "window20+softcap",
                  "window20+sinks+softcap", "sinks+softcap"]


@pytest.fixture(scope="module")
def triton_backend():
    pytest.importorskip("triton", reason="the triton wheel is part of the test install")
    from engine.attention.triton_paged import TritonPagedAttention
    return TritonPagedAttention


@pytest.mark.parametrize("option", TRITON_OPTIONS)
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case, option, triton_backend):
    layer = LayerAttention(**OPTIONS[option])
    step = Step(*CASES[case], layer.window, torch.float32, seed=len(case) + len(option))
    step.check(run(triton_backend(H, HKV, D, SCALE), step, layer, TRITON_DEVICE), layer, 1e-4)


@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_triton_bf16_and_mha(case, triton_backend):
    for heads, kv_heads in ((H, HKV), (4, 4)):
        layer = LayerAttention(window=20, sinks=torch.linspace(-1, 2, heads), softcap=1.5)
        step = Step(*CASES[case], layer.window, torch.bfloat16, heads=heads, kv_heads=kv_heads, seed=heads)
        step.check(run(triton_backend(heads, kv_heads, D, SCALE), step, layer, TRITON_DEVICE), layer, 3e-2)


@pytest.mark.parametrize("option", ["plain", "window5", "window20+sinks+softcap", "sinks+softcap"])
def test_triton_split_kv_decode_with_every_option(option, triton_backend, monkeypatch):
    """Decode attention split into 4 shares of keys (flash-decoding): windows, sinks (counted by one share) and
    soft-capping give what the reference does."""
    from engine.attention import triton_kernels
    monkeypatch.setattr(triton_kernels, "decode_kv_splits", lambda *args: 4)
    layer = LayerAttention(**OPTIONS[option])
    step = Step(*CASES["decode"], layer.window, torch.float32, seed=len(option))
    step.check(run(triton_backend(H, HKV, D, SCALE), step, layer, TRITON_DEVICE), layer, 1e-4)
