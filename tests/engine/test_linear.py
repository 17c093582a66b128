"""Linear: the oneDNN-packed bf16 path computes what F.linear computes, at every batch size."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.linear import Linear


@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_linear_matches_f_linear(with_bias):
    torch.manual_seed(0)
    weight = torch.randn(320, 192).to(torch.bfloat16)
    bias = torch.randn(320).to(torch.bfloat16) if with_bias else None
    linear = Linear(weight, bias)
    assert linear.packed is not None, "bf16 weights on CPU are packed for oneDNN"
    assert linear.weight is None  # the packed copy replaces the plain one
    for rows in (1, 3, 16, 64, 300):
        x = torch.randn(rows, 192).to(torch.bfloat16)
        got = linear(x)
        want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        assert got.shape == (rows, 320) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=6e-2)


def test_float32_keeps_f_linear_exactly(monkeypatch):
    weight = torch.randn(64, 32)
    linear = Linear(weight)
    assert linear.packed is None
    x = torch.randn(5, 32)
    assert torch.equal(linear(x), F.linear(x, weight))


def test_packing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "0")
    weight = torch.randn(64, 32).to(torch.bfloat16)
    linear = Linear(weight)
    assert linear.packed is None and linear.weight is weight
