"""y = x @ W^T + b, with W prepacked for oneDNN when that is faster.

On CPU, torch's `F.linear` hands oneDNN (bf16) or MKL (float32) a plain row-major
weight, re-laid out or blocked on every call; at decode batch sizes that costs more
than the multiply. Packing once at load time (what torch.compile's CPU freezing and
vLLM's CPU engine do) makes bf16 linears 1.3-3x faster; in float32 on an AVX2 EPYC
(`bench/linear_shapes.py`) the LM head 1.5-4x at 1-64 rows and the layer linears up to
1.35x at 2-64 rows, about equal at 256-2,048 rows; decode-heavy runs 1.37x end to end.
Packed results differ from `F.linear` by summation order only (float32: ~1e-6).
CUDA keeps `F.linear`. If packing is unavailable (oneDNN runs bf16 only on CPUs with
AVX-512 BW/VL/DQ or AVX-NE-CONVERT, so not on AVX2-only ones) or its probe disagrees
with `F.linear`, the plain path is used. PDSERVE_PACKED_LINEAR=0 turns packing off.

On a CPU where oneDNN has no bf16 GEMM (AVX2-only: `_is_mkldnn_bf16_supported()`
is False), torch's bf16 `F.linear` runs at ~2 GFLOP/s against ~15-60 for float32
here. There a bf16 weight is kept as its (exact) float32 copy, packed like any float32
weight, and the multiply runs in float32: x widened exactly, the product rounded to bf16
once, which is what a bf16 GEMM with float32 accumulation computes (up to summation
order). Twice the weight memory, for those CPUs only. PDSERVE_BF16_UPCAST=0 turns it off.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)
_PACKED_DTYPES = (torch.bfloat16, torch.float32)


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.upcast = _upcast_bf16(weight)
        """True when this bf16 linear multiplies in float32 (a CPU without bf16 GEMM)."""
        if self.upcast:
            weight = weight.float()
            bias = None if bias is None else bias.float()
        self.bias = bias
        self.weight_dtype = weight.dtype
        self.packed = _pack(weight, bias)
        self.weight = None if self.packed is not None else weight
        """The plain weight, kept only when it is what runs (the packed copy replaces it)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as kept (float32 where upcast; a packed copy counts as its plain size)."""
        itemsize = torch.empty((), dtype=self.weight_dtype).element_size()
        return self.out_features * self.in_features * itemsize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast:
            return self._multiply(x.float()).to(x.dtype)
        return self._multiply(x)

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _upcast_bf16(weight: torch.Tensor) -> bool:
    """Whether this bf16 CPU weight should multiply in float32 (oneDNN has no bf16 GEMM on this CPU)."""
    if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu"
            or os.environ.get("PDSERVE_BF16_UPCAST", "1") == "0"):
        return False
    return not bf16_gemm_supported()


def bf16_gemm_supported() -> bool:
    """True when oneDNN multiplies bf16 natively on this CPU (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else True
    except Exception:  # noqa: BLE001 - cannot tell: keep bf16
        return True


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    if (os.environ.get("PDSERVE_PACKED_LINEAR", "1") == "0" or weight.device.type != "cpu"
            or weight.dtype not in _PACKED_DTYPES or not torch.backends.mkldnn.is_available()):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
        want = F.linear(probe, weight, bias)
        if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
            raise ValueError("packed result differs from F.linear")
        return packed
    except Exception as exc:  # noqa: BLE001 - any failure means: use F.linear
        logger.info("oneDNN weight packing unavailable (%s); using F.linear", exc)
        return None
