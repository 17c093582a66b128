"""A checkpoint's tensors as a family module takes them: this rank's shard, on the device, cast or quantized.

A family module (engine/model/registry.py) names the tensors of its layers; `CheckpointWeights` applies
what every family shares: tensor-parallel slicing (engine/parallel/sharding.py) before the tensor is
moved or cast, the merged column-parallel linears (q|k|v, gate|up) and the row-parallel ones whose
outputs the ranks sum, and the weight format (unquantized, quantized at load, or an fp8 checkpoint's
own weights and scales). Tensors nobody took are left in `remaining` for the loader to check.
"""
from __future__ import annotations

import torch

from engine.model.linear import Linear
from engine.model.quantization import FP8_DTYPE, QUANTIZERS, checkpoint_scales
from engine.model.quantized_linear import QUANTIZED_LINEARS
from engine.parallel.layers import RowParallelLinear
from engine.parallel.sharding import shard_cols, shard_rows
from engine.parallel.tp_group import TPGroup


class CheckpointWeights:
    def __init__(self, tensors: dict[str, torch.Tensor], source: str, dtype: torch.dtype, device: torch.device,
                 quantization: str | None, checkpoint_quantization: str | None, tp: TPGroup | None) -> None:
        self.remaining = tensors
        """The checkpoint's tensors not taken yet (each is popped as it is taken)."""
        self.source = source
        self.dtype = dtype
        self.device = device
        self.quantization = quantization
        """The format the linears run in (None: the model dtype)."""
        self.checkpoint_quantization = checkpoint_quantization
        """The format the linears are stored in (`fp8`: float8 weights with their scales; None: unquantized)."""
        self.tp = tp
        self.rank, self.world = (tp.rank, tp.world_size) if tp is not None else (0, 1)

    def __contains__(self, name: str) -> bool:
        return name in self.remaining

    def pop(self, name: str) -> torch.Tensor:
        """The tensor as stored (whole, on the CPU)."""
        if name not in self.remaining:
            raise KeyError(f"checkpoint {self.source} lacks tensor {name}")
        return self.remaining.pop(name)

    def take(self, name: str) -> torch.Tensor:
        """A tensor every rank holds whole (a norm's weight), on the device in the model dtype."""
        return self.pop(name).to(device=self.device, dtype=self.dtype).contiguous()

    def linear(self, prefixes: list[str], bias: bool = False, row_parallel: bool = False):
        """One linear over the weights `<prefix>.weight` (and `.bias`) merged in order: column-parallel (each
        part's row shard, merged) unless `row_parallel` (a column shard, whose outputs the ranks sum; its bias
        is whole, added once after the sum)."""
        b = None
        if bias:
            parts = [self.pop(p + ".bias") for p in prefixes]
            b = torch.cat(parts if row_parallel else [self._rows(t) for t in parts]).to(self.device, self.dtype)
        if row_parallel and self.tp is not None:
            return RowParallelLinear(self._linear(prefixes, True, None), self.tp, b)
        return self._linear(prefixes, row_parallel, b)

    def _linear(self, prefixes: list[str], row_parallel: bool, b: torch.Tensor | None):
        """This rank's part of the merged weights (rows, or columns if `row_parallel`), in the format it runs in."""
        cut = self._cols if row_parallel else self._rows
        if self.checkpoint_quantization == "fp8":  # stored in fp8: its own scales, per tensor or per channel
            parts = [self.pop(p + ".weight") for p in prefixes]
            q = torch.cat([cut(w.view(torch.uint8)) for w in parts]).view(FP8_DTYPE).to(self.device)
            scales = [checkpoint_scales(self.pop(p + ".weight_scale"), w.shape[0])
                      for p, w in zip(prefixes, parts, strict=True)]  # per row of the whole weight
            scales = torch.cat([s if row_parallel else self._rows(s) for s in scales]).to(self.device)
            return QUANTIZED_LINEARS["fp8"](q.contiguous(), scales, b, self.dtype)
        weight = torch.cat([cut(self.pop(p + ".weight")) for p in prefixes]).to(self.device)
        if self.quantization is None:
            return Linear(weight.to(self.dtype).contiguous(), b)
        q, scales = QUANTIZERS[self.quantization](weight)
        return QUANTIZED_LINEARS[self.quantization](q, scales, b, self.dtype)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.tp is None else shard_rows(t, self.rank, self.world)

    def _cols(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.tp is None else shard_cols(t, self.rank, self.world)
