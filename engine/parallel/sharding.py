"""Which slice of each weight a tensor-parallel rank holds (pure functions: no processes, no groups).

As vLLM shards a Llama-family layer over N ranks:

  column-parallel  qkv, gate_up   rank r holds rows r/N of each merged part: its q heads, its kv heads
                                  (q, k, v sliced by heads), its slice of gate and of up; biases alike
  row-parallel     o_proj, down   rank r holds columns r/N (the inputs its column-parallel half made);
                                  the ranks' outputs are summed (all-reduce)
  vocab-parallel   embedding,     rank r holds the contiguous vocab rows [start, end), padded with zero
                   LM head        rows to ceil(V/N) so every rank's slice has one size
  expert-sliced    MoE w13, w2    rank r holds r/N of every expert's intermediate dimension: its gate and
                                  up rows, its down columns (`shard_experts`); the ranks' outputs are
                                  summed like down's
  expert-parallel  MoE experts    with `enable_expert_parallel`, rank r holds whole experts instead: E/N of
                                  them (expert_parallel.py); the ranks' outputs are summed alike

so every rank's attention works on num_heads/N query and num_kv_heads/N KV heads (`shard_config`).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from engine.model.model_config import ModelConfig


def check_tp_size(world_size: int, config: ModelConfig, expert_parallel: bool = False) -> None:
    """Raise ValueError unless `world_size` ranks can split the model's heads and MLP evenly (with
    `expert_parallel` the experts stay whole: expert_parallel.py checks that their number splits)."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if config.num_heads % world_size or config.num_kv_heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the model's {config.num_heads} attention "
                         f"heads and {config.num_kv_heads} KV heads")
    if config.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the model's intermediate size "
                         f"{config.intermediate_size}")
    if config.moe is not None and not expert_parallel and config.moe.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the experts' intermediate size "
                         f"{config.moe.intermediate_size}")


def shard_config(config: ModelConfig, world_size: int, expert_parallel: bool = False) -> ModelConfig:
    """The shapes one rank computes with: its heads and its MLP slice, its slice of every expert's (vocab,
    hidden size and the experts stay whole); with `expert_parallel` each expert's width stays whole."""
    check_tp_size(world_size, config, expert_parallel)
    moe = config.moe
    if moe is not None and not expert_parallel:
        moe = replace(moe, intermediate_size=moe.intermediate_size // world_size)
    return replace(config, num_heads=config.num_heads // world_size,
                   num_kv_heads=config.num_kv_heads // world_size,
                   intermediate_size=config.intermediate_size // world_size, moe=moe)


def shard_rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/world_size of dim 0 (a column-parallel weight, bias or scales)."""
    if t.shape[0] % world_size:
        raise ValueError(f"{t.shape[0]} rows do not split into {world_size} equal shards")
    size = t.shape[0] // world_size
    return t[rank * size:(rank + 1) * size]


def shard_cols(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/world_size of dim 1 (a row-parallel weight)."""
    if t.shape[1] % world_size:
        raise ValueError(f"{t.shape[1]} columns do not split into {world_size} equal shards")
    size = t.shape[1] // world_size
    return t[:, rank * size:(rank + 1) * size]


def shard_merged(parts: list[torch.Tensor], rank: int, world_size: int) -> torch.Tensor:
    """A merged column-parallel weight (q|k|v or gate|up): each part's row shard, concatenated."""
    return torch.cat([shard_rows(p, rank, world_size) for p in parts])


def shard_experts(w13: torch.Tensor, w2: torch.Tensor, rank: int,
                  world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slice of every expert's intermediate dimension: of w13 [E, 2I, H] its gate rows and its
    up rows (column-parallel, merged like gate_up), of w2 [E, H, I] its columns (row-parallel)."""
    gate, up = w13.chunk(2, dim=1)  # [E, I, H] each: dim 1 is the intermediate one
    w13 = torch.cat([shard_cols(gate, rank, world_size), shard_cols(up, rank, world_size)], dim=1)
    return w13, shard_cols(w2.transpose(1, 2), rank, world_size).transpose(1, 2).contiguous()


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the vocab rows rank `rank` holds (ceil(V/N) each; the last may hold fewer)."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


def shard_vocab(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rows [start, end) of an embedding / LM head weight, padded with zero rows to ceil(V/N)."""
    vocab_size = weight.shape[0]
    start, end = vocab_range(vocab_size, rank, world_size)
    per_rank = -(-vocab_size // world_size)
    shard = weight[start:end]
    if end - start < per_rank:
        shard = torch.cat([shard, shard.new_zeros(per_rank - (end - start), *weight.shape[1:])])
    return shard
