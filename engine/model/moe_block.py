"""The sparse feed-forward of a Mixture-of-Experts decoder layer, as the family modules load and run it.

  load_sparse_mlp  layer i's router and stacked experts (engine/model/moe.py's `read_moe_weights` names),
                   with tensor parallelism this rank's slice of every expert's intermediate dimension
                   (engine/parallel/sharding.py's `shard_experts`); None on a dense layer
  SparseMlp        route -> only the chosen experts (torch grouped loop on CPU, the Triton fused MoE on
                   CUDA) -> with TP, one all-reduce, as the dense MLP's down projection; per-expert
                   token counts summed over every call. With expert parallelism (`placement`) this rank
                   holds whole experts, computes only the pairs routed to them (zeros elsewhere) and the
                   same all-reduce sums the ranks' parts (engine/parallel/expert_parallel.py)
  MoeDecoder       the decoder mixin that runs a layer's SparseMlp in place of the dense MLP (`mlp`), in
                   the unfused and the fused CPU path alike: the fused kernels run the rest of the layer,
                   the experts' SwiGLU is engine/model/moe.py's torch one (same math, float32 equal)

The router stays whole on every rank (all ranks route alike, so each rank's counts are the whole
layer's, with expert parallelism too).
The expert weights are not quantized: --quantization and fp8 checkpoints are refused for MoE families;
gpt-oss's MXFP4 experts are dequantised at load (engine/model/mxfp4.py). gpt-oss's expert biases: b13 is
sliced like w13, b2 added on rank 0 only (it must count once in the sum).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model.fused import FusedOps
from engine.model.llama import LayerWeights
from engine.model.model_config import ModelConfig
from engine.model.moe import MoeSpec, MoeWeights, experts_forward, pack_experts, read_moe_weights, route
from engine.model.mxfp4 import dequantizing_reader
from engine.model.weights import CheckpointWeights
from engine.parallel.expert_parallel import (
    ExpertPlacement,
    expert_placement,
    local_experts_forward,
    shard_expert_weights,
)
from engine.parallel.sharding import shard_cols, shard_experts
from engine.parallel.tp_group import TPGroup


@dataclass
class SparseMlp:
    weights: MoeWeights
    """This rank's experts: every expert, its slice of each one's intermediate dimension; with `placement`,
    its E / N experts whole."""
    spec: MoeSpec
    tp: TPGroup | None
    counts: torch.Tensor
    """[E] int64: the tokens routed to each expert (all E, on every rank), summed over every call since load
    (with CUDA decode graphs, their capture and padding rows are counted too: unrun, no GPU here)."""
    placement: ExpertPlacement | None = None
    """Expert parallelism: which experts this rank holds whole (None: a slice of every expert, or one rank)."""
    expert_map: torch.Tensor | None = field(init=False, default=None)
    """[E] int32 on the device: each global expert's local index here, -1 elsewhere (with `placement`)."""

    def __post_init__(self) -> None:
        if self.placement is not None:
            self.expert_map = self.placement.expert_map(self.counts.device)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """[T, H] normed hidden -> [T, H] the weighted sum of each token's top-k experts (summed over ranks)."""
        topk_weights, topk_ids = route(h, self.weights, self.spec)
        if h.is_cuda:
            from engine.model.moe_triton import fused_moe  # triton is imported only where CUDA runs
            out = fused_moe(h, self.weights, self.spec, topk_weights, topk_ids, self.expert_map)
        elif self.placement is not None:
            out = local_experts_forward(h, self.weights, self.spec, topk_weights, topk_ids, self.placement)
        else:
            out = experts_forward(h, self.weights, self.spec, topk_weights, topk_ids)
        self.counts += out.expert_counts
        return out.hidden if self.tp is None else self.tp.all_reduce(out.hidden)


def load_sparse_mlp(weights: CheckpointWeights, i: int, config: ModelConfig, family: str) -> SparseMlp | None:
    """Layer i's experts under `family`'s checkpoint names, or None when config.moe makes the layer dense."""
    moe = config.moe
    if moe is None or not moe.is_sparse(i):
        return None
    if weights.quantization is not None:
        raise ValueError(f"{config.architecture}: quantized weights ({weights.quantization}) are not supported "
                         "for Mixture-of-Experts models (the experts would run unquantized)")
    take = weights.pop
    if weights.checkpoint_quantization == "mxfp4":  # gpt-oss's experts, dequantised here on the CPU
        take = dequantizing_reader(weights.pop, weights.__contains__, weights.dtype)
    raw = read_moe_weights(take, f"model.layers.{i}.", family, moe.num_experts)
    placement = expert_placement(weights.tp, moe.num_experts)
    if placement is not None:  # whole experts, E / N of them, cut before the cast and move
        raw = shard_expert_weights(raw, placement)
    w13, w2, b13, b2 = raw.w13, raw.w2, raw.b13, raw.b2
    if weights.tp is not None and placement is None:
        w13, w2 = shard_experts(w13, w2, weights.rank, weights.world)
        b13, b2 = _shard_expert_biases(b13, b2, weights.rank, weights.world)
    cast = {"device": weights.device, "dtype": weights.dtype}
    stacked = MoeWeights(*(None if t is None else t.to(**cast).contiguous()
                           for t in (raw.router, w13, w2, raw.router_bias, b13, b2)))
    if stacked.w13.device.type == "cpu":  # prepacked per-expert linears (engine/model/moe.py `pack_experts`)
        stacked = pack_experts(stacked)
    spec = MoeSpec(moe.num_experts, moe.top_k, moe.scoring, moe.renormalize, moe.swiglu_limit, moe.swiglu_alpha)
    counts = torch.zeros(moe.num_experts, dtype=torch.long, device=weights.device)
    return SparseMlp(stacked, spec, weights.tp, counts, placement)


def _shard_expert_biases(b13: torch.Tensor | None, b2: torch.Tensor | None, rank: int,
                         world: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """gpt-oss's expert biases beside `shard_experts`' slices: of b13 [E, 2I] this rank's gate and up entries;
    b2 [E, H] must count once in the ranks' sum, so rank 0 keeps it and the others add zeros."""
    if b13 is None or b2 is None:
        return b13, b2
    gate, up = b13.chunk(2, dim=1)
    b13 = torch.cat([shard_cols(gate, rank, world), shard_cols(up, rank, world)], dim=1)
    return b13, b2 if rank == 0 else torch.zeros_like(b2)


class MoeDecoder:
    """Mixin before a decoder class whose layers carry `moe: SparseMlp | None` (see the module docstring)."""

    def mlp(self, h: torch.Tensor, layer: LayerWeights, ops: FusedOps | None) -> torch.Tensor:
        """The layer's experts on a sparse layer, the dense MLP of the decoder otherwise."""
        if layer.moe is None:
            return super().mlp(h, layer, ops)
        return layer.moe(h)

    def expert_token_counts(self) -> dict[int, torch.Tensor]:
        """{layer index: [E] int64 tokens routed to each expert} over every step since load, sparse layers only."""
        return {self.first_layer + j: layer.moe.counts.clone() for j, layer in enumerate(self.layers)
                if layer.moe is not None}
