"""Linear: bf16 weights are packed for oneDNN exactly where this CPU lets oneDNN run bf16, multiply in
float32 where it does not (AVX2-only CPUs), and whichever path runs computes what F.linear computes,
at every batch size."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.model.linear import Linear

ROWS = (1, 3, 16, 64, 300)


def onednn_runs_bf16() -> bool:
    """Asked of torch, not of Linear: oneDNN is built in and this CPU runs its bf16 kernels (avx512bw/vl/dq
    or avx_ne_convert; the check oneDNN's bf16 weight reorder makes). avx512_bf16 is not required."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_case(with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(0)
    weight = torch.randn(320, 192).to(torch.bfloat16)
    bias = torch.randn(320).to(torch.bfloat16) if with_bias else None
    return weight, bias


def assert_matches_f_linear(linear: Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for rows in ROWS:
        x = torch.randn(rows, weight.shape[1]).to(torch.bfloat16)
        got = linear(x)
        want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        assert got.shape == (rows, weight.shape[0]) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=6e-2)


@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_is_packed_where_onednn_runs_bf16_and_matches_f_linear(with_bias, monkeypatch):
    monkeypatch.delenv("PDSERVE_PACKED_LINEAR", raising=False)
    weight, bias = bf16_case(with_bias)
    linear = Linear(weight, bias)
    if onednn_runs_bf16():
        assert linear.packed is not None, "this CPU runs oneDNN bf16, so bf16 weights are packed"
        assert linear.weight is None  # the packed copy replaces the plain one
    else:
        assert linear.upcast, "this CPU cannot run oneDNN bf16, so the (packed) float32 path is used"
    assert_matches_f_linear(linear, weight, bias)


@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_multiplies_in_float32_where_onednn_has_no_bf16_gemm(with_bias, monkeypatch):
    """Upcast: the exact float32 copy of the weight, x widened, the product rounded to bf16 once."""
    monkeypatch.delenv("PDSERVE_BF16_UPCAST", raising=False)
    monkeypatch.setattr("engine.model.linear.bf16_gemm_supported", lambda: False)
    weight, bias = bf16_case(with_bias)
    linear = Linear(weight, bias)
    assert linear.upcast and linear.weight_dtype == torch.float32
    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "0")  # unpacked: exactly F.linear in float32, rounded once
    plain = Linear(weight, bias)
    for rows in ROWS:
        x = torch.randn(rows, 192).to(torch.bfloat16)
        want = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).bfloat16()
        assert torch.equal(plain(x), want)
    monkeypatch.delenv("PDSERVE_PACKED_LINEAR")
    assert_matches_f_linear(linear, weight, bias)
    monkeypatch.setenv("PDSERVE_BF16_UPCAST", "0")
    assert not Linear(weight, bias).upcast


def _reorder_refused(weight):
    raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, "
                       "avx512vl and avx512dq")


def _wrong_result(x, packed, bias, *args):
    return torch.zeros(x.shape[0], packed.shape[0], dtype=x.dtype)


@pytest.mark.parametrize("failure", ["no_mkldnn", "reorder_refused", "probe_disagrees"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_plain_path_when_packing_fails_gives_f_linear(failure, with_bias, monkeypatch):
    """Every way packing can be unavailable falls back to F.linear itself, on any CPU."""
    monkeypatch.delenv("PDSERVE_PACKED_LINEAR", raising=False)
    monkeypatch.setenv("PDSERVE_BF16_UPCAST", "0")
    if failure == "no_mkldnn":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    elif failure == "reorder_refused":
        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", _reorder_refused)
    else:  # packing "works" on any CPU, but the packed multiply is wrong
        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda weight: weight.clone())
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", _wrong_result)
    weight, bias = bf16_case(with_bias)
    linear = Linear(weight, bias)
    assert linear.packed is None and linear.weight is weight
    for rows in ROWS:
        x = torch.randn(rows, 192).to(torch.bfloat16)
        assert torch.equal(linear(x), F.linear(x, weight, bias))
    assert_matches_f_linear(linear, weight, bias)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ONEDNN_MAX_CPU_ISA=AVX2 is x86-only")
def test_cpu_without_onednn_bf16_uses_the_plain_path():
    """A CPU without AVX-512 (oneDNN capped at AVX2 here, whatever this CPU has): the real refusal is handled."""
    script = """if True:
        import torch, torch.nn.functional as F
        from engine.model.linear import Linear
        assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        weight, bias = torch.randn(96, 64).to(torch.bfloat16), torch.randn(96).to(torch.bfloat16)
        linear = Linear(weight, bias)
        assert linear.packed is None and linear.weight is weight
        x = torch.randn(5, 64).to(torch.bfloat16)
        assert torch.equal(linear(x), F.linear(x, weight, bias))
        print("plain path ok")
    """
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PDSERVE_BF16_UPCAST": "0"}
    env.pop("PDSERVE_PACKED_LINEAR", None)
    done = subprocess.run([sys.executable, "-c", script], check=False, env=env, cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "plain path ok" in done.stdout, done.stderr


def test_float32_is_packed_and_matches_f_linear(monkeypatch):
    """float32 weights are packed where oneDNN is built in (MKL re-blocks a plain weight every call), and
    the packed multiply differs from F.linear by summation order only, at every batch size."""
    monkeypatch.delenv("PDSERVE_PACKED_LINEAR", raising=False)
    torch.manual_seed(0)
    weight, bias = torch.randn(320, 192), torch.randn(320)
    linear = Linear(weight, bias)
    assert (linear.packed is not None) == torch.backends.mkldnn.is_available()
    for rows in ROWS:
        x = torch.randn(rows, 192)
        torch.testing.assert_close(linear(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "0")
    plain = Linear(weight, bias)
    x = torch.randn(5, 192)
    assert plain.packed is None and torch.equal(plain(x), F.linear(x, weight, bias))


def test_packing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "0")
    monkeypatch.setenv("PDSERVE_BF16_UPCAST", "0")
    weight = torch.randn(64, 32).to(torch.bfloat16)
    linear = Linear(weight)
    assert linear.packed is None and linear.weight is weight
