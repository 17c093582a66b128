"""Expert parallelism (`--enable-expert-parallel`): each rank of the group holds whole experts.

Placement. The E experts of a sparse layer are split into `world_size` contiguous runs, E / world_size
each (E must divide; refused by name otherwise): rank r holds experts [r * E/N, (r + 1) * E/N), whole,
gate/up/down (and gpt-oss's biases) sliced out of the checkpoint before they are cast or moved. The
router stays whole on every rank. `expert_map` is vLLM's convention (`determine_expert_map` in its
fused_moe/layer.py): an [E] table of this rank's local index for each global expert, -1 for the others.

Tokens. Attention stays tensor-parallel, so after its all-reduce every rank holds every token of the
step. Each rank therefore routes all tokens (same router, same input: the same choice on every rank),
computes only the (token, expert) pairs of its own experts, writes zeros for the rest, and one
all-reduce (sum) of the partial outputs gives every rank the layer's output: the same collective the
tensor-parallel MoE (each rank a slice of every expert) already ends with. With data-parallel attention
(each rank its own tokens; not built here) this would instead be an all-to-all dispatch of each token to
the ranks of its experts and an all-to-all combine back, as vLLM's all2all backends and DeepEP do.

Counts. Every rank routes every token, so the per-expert counts kept on rank 0 cover all experts.

  ExpertPlacement        which experts a rank holds, and its `expert_map`; `expert_placement(tp, E)` the
                         one of a TPGroup's rank (None without expert parallelism)
  check_expert_parallel  ValueError naming `enable_expert_parallel` for a dense model or an E that the
                         ranks do not split
  shard_expert_weights   a layer's MoeWeights cut to this rank's experts (router whole)
  local_experts_forward  the CPU experts half (engine/model/moe.py's `experts_forward`) over this rank's
                         experts only; CUDA runs engine/model/moe_triton.py's `fused_moe` with `expert_map`
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.model_config import ModelConfig
from engine.model.moe import MoeOutput, MoeSpec, MoeWeights, sort_by_expert


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int
    """E, the experts of a sparse layer over all ranks."""
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.num_experts % self.world_size:
            raise ValueError(f"enable_expert_parallel: {self.world_size} ranks must divide the model's "
                             f"{self.num_experts} experts (whole experts per rank)")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    @property
    def num_local(self) -> int:
        """Experts this rank holds."""
        return self.num_experts // self.world_size

    @property
    def start(self) -> int:
        """The first (global) expert this rank holds."""
        return self.rank * self.num_local

    @property
    def end(self) -> int:
        """One past the last (global) expert this rank holds."""
        return self.start + self.num_local

    def expert_map(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[E] int32: this rank's local index of each global expert, -1 for experts other ranks hold."""
        table = torch.full((self.num_experts,), -1, dtype=torch.int32)
        table[self.start:self.end] = torch.arange(self.num_local, dtype=torch.int32)
        return table.to(device)


def expert_placement(tp, num_experts: int) -> ExpertPlacement | None:
    """This rank's placement when `tp` (a TPGroup, or None) splits whole experts; None otherwise."""
    if tp is None or not tp.expert_parallel:
        return None
    return ExpertPlacement(num_experts, tp.rank, tp.world_size)


def check_expert_parallel(world_size: int, config: ModelConfig) -> None:
    """Raise ValueError unless `world_size` ranks can hold the model's experts whole, E / world_size each."""
    if config.moe is None:
        raise ValueError(f"enable_expert_parallel needs a Mixture-of-Experts model; {config.architecture} "
                         "has no experts")
    if world_size < 2:
        raise ValueError("enable_expert_parallel needs tensor_parallel_size > 1 (the ranks the experts are "
                         f"split over), got {world_size}")
    ExpertPlacement(config.moe.num_experts, 0, world_size)  # raises when E does not split


def shard_expert_weights(weights: MoeWeights, placement: ExpertPlacement) -> MoeWeights:
    """This rank's experts, whole (w13, w2 and the biases b13, b2 when present); the router stays whole."""
    mine = slice(placement.start, placement.end)

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if t.shape[0] != placement.num_experts:
            raise ValueError(f"expected {placement.num_experts} experts along dim 0, got shape {tuple(t.shape)}")
        return t[mine]

    return MoeWeights(weights.router, cut(weights.w13), cut(weights.w2), weights.router_bias, cut(weights.b13),
                      cut(weights.b2))


def local_experts_forward(hidden: torch.Tensor, weights: MoeWeights, spec: MoeSpec, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, placement: ExpertPlacement) -> MoeOutput:
    """`experts_forward` over this rank's experts: `weights` holds only them (`shard_expert_weights`),
    `topk_ids` are global. Sorted by global expert, this rank's pairs are one contiguous run; one GEMM pair
    per active local expert over its rows, each row scaled by its routing weight (cast to the activations'
    dtype, as `experts_forward` does) and added into its token. Tokens routed to no local expert get zeros.
    The counts returned cover all E experts (every rank routes every token)."""
    order, counts = sort_by_expert(topk_ids, spec.num_experts)
    mine = counts[placement.start:placement.end].tolist()
    first = int(counts[:placement.start].sum())
    pairs = order[first:first + sum(mine)]
    tokens = pairs // spec.top_k
    x = hidden.index_select(0, tokens)
    y = torch.empty_like(x)
    start = 0
    for e, n in enumerate(mine):
        if n == 0:
            continue
        rows = slice(start, start + n)
        y[rows] = weights.expert_mlp(e, x[rows], spec)
        start += n
    y = y * topk_weights.flatten()[pairs].to(y.dtype).unsqueeze(-1)
    out = torch.zeros_like(hidden)
    out.index_add_(0, tokens, y)
    return MoeOutput(out, counts)

