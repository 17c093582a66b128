"""The three layer kinds that talk across tensor-parallel ranks (see sharding.py for the slices).

Column-parallel linears (qkv, gate_up) need no collective: each rank computes its heads / its MLP
slice with a plain (or quantized) linear over its row shard. These wrap the rest.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.parallel.tp_group import TPGroup


class RowParallelLinear:
    """A linear over this rank's column shard, its partial outputs summed over the ranks; the bias (when
    there is one) is added once, after the sum."""

    def __init__(self, linear, group: TPGroup, bias: torch.Tensor | None = None) -> None:
        self.linear = linear
        self.group = group
        self.bias = bias

    def __getattr__(self, name: str):
        return getattr(self.__dict__["linear"], name)  # out_features, nbytes, ... of the shard

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


class VocabParallelHead:
    """The LM head over this rank's vocab rows; every rank gathers the full [T, V] logits."""

    def __init__(self, linear, group: TPGroup, vocab_size: int) -> None:
        self.linear = linear
        self.group = group
        self.vocab_size = vocab_size

    def __getattr__(self, name: str):
        return getattr(self.__dict__["linear"], name)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.group.all_gather(self.linear(h), dim=-1)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size].contiguous()


def vocab_parallel_embedding(input_ids: torch.Tensor, shard: torch.Tensor, vocab_start: int,
                             group: TPGroup) -> torch.Tensor:
    """Rows of tokens in [vocab_start, vocab_start + len(shard)) from this rank, zeros elsewhere, summed
    over the ranks: each token's row comes from exactly one rank."""
    local = input_ids - vocab_start
    inside = (local >= 0) & (local < shard.shape[0])
    x = F.embedding(torch.where(inside, local, 0), shard)
    x.masked_fill_(~inside.unsqueeze(-1), 0)
    return group.all_reduce(x)
