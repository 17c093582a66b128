"""The sparse feed-forward of a Mixture-of-Experts decoder layer, as the family modules load and run it.

  load_sparse_mlp  layer i's router and stacked experts (engine/model/moe.py's `read_moe_weights` names),
                   with tensor parallelism this rank's slice of every expert's intermediate dimension
                   (engine/parallel/sharding.py's `shard_experts`); None on a dense layer
  SparseMlp        route -> only the chosen experts (torch grouped loop on CPU, the Triton fused MoE on
                   CUDA) -> with TP, one all-reduce, as the dense MLP's down projection; per-expert
                   token counts summed over every call
  MoeDecoder       the decoder mixin that runs a layer's SparseMlp in place of the dense MLP (`mlp`), in
                   the unfused and the fused CPU path alike: the fused kernels run the rest of the layer,
                   the experts' SwiGLU is engine/model/moe.py's torch one (same math, float32 equal)

The router stays whole on every rank (all ranks route alike, so each rank's counts are the whole
layer's). Expert parallelism (whole experts per rank, tokens exchanged all-to-all) is not implemented.
The expert weights are not quantized: --quantization and fp8 checkpoints are refused for MoE families.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.fused import FusedOps
from engine.model.llama import LayerWeights
from engine.model.model_config import ModelConfig
from engine.model.moe import MoeSpec, MoeWeights, experts_forward, read_moe_weights, route
from engine.model.weights import CheckpointWeights
from engine.parallel.sharding import shard_experts
from engine.parallel.tp_group import TPGroup


@dataclass
class SparseMlp:
    weights: MoeWeights
    """This rank's experts (every expert, its slice of each one's intermediate dimension)."""
    spec: MoeSpec
    tp: TPGroup | None
    counts: torch.Tensor
    """[E] int64: the tokens routed to each expert, summed over every call since load (with CUDA decode
    graphs, their capture and padding rows are counted too: unrun, no GPU here)."""

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """[T, H] normed hidden -> [T, H] the weighted sum of each token's top-k experts (summed over ranks)."""
        topk_weights, topk_ids = route(h, self.weights, self.spec)
        if h.is_cuda:
            from engine.model.moe_triton import fused_moe  # triton is imported only where CUDA runs
            out = fused_moe(h, self.weights, self.spec, topk_weights, topk_ids)
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
    raw = read_moe_weights(weights.pop, f"model.layers.{i}.", family, moe.num_experts)
    w13, w2 = raw.w13, raw.w2
    if weights.tp is not None:
        w13, w2 = shard_experts(w13, w2, weights.rank, weights.world)
    cast = {"device": weights.device, "dtype": weights.dtype}
    stacked = MoeWeights(raw.router.to(**cast), w13.to(**cast).contiguous(), w2.to(**cast).contiguous())
    spec = MoeSpec(moe.num_experts, moe.top_k, renormalize=moe.renormalize)
    counts = torch.zeros(moe.num_experts, dtype=torch.long, device=weights.device)
    return SparseMlp(stacked, spec, weights.tp, counts)


class MoeDecoder:
    """Mixin before a decoder class whose layers carry `moe: SparseMlp | None` (see the module docstring)."""

    def mlp(self, h: torch.Tensor, layer: LayerWeights, ops: FusedOps | None) -> torch.Tensor:
        """The layer's experts on a sparse layer, the dense MLP of the decoder otherwise."""
        if layer.moe is None:
            return super().mlp(h, layer, ops)
        return layer.moe(h)

    def expert_token_counts(self) -> dict[int, torch.Tensor]:
        """{layer index: [E] int64 tokens routed to each expert} over every step since load, sparse layers only."""
        return {i: layer.moe.counts.clone() for i, layer in enumerate(self.layers) if layer.moe is not None}
