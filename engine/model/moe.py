"""Mixture-of-Experts feed-forward that computes only the experts each token is routed to.

One call: router logits -> top-k experts and weights per token -> the T*k (token, expert) pairs
sorted by expert -> for each active expert one gate/up GEMM, the activation and one down GEMM
over its contiguous run of pairs -> each pair's output scaled by its weight and summed back into
its token. Work grows with T*k, never T*E; experts no token chose are not touched.
The per-expert pair counts come back with the output, for load-balance metrics.

Routing, `MoeSpec.scoring`:
  "softmax_topk"  Mixtral, Qwen3-MoE: softmax over all E logits in float32, top-k, and, when
                  `renormalize` (Mixtral always, Qwen3-MoE's `norm_topk_prob`), the k weights divided
                  by their sum.
  "topk_softmax"  gpt-oss: top-k of the logits (router bias included), softmax over the k chosen.
Activation: SwiGLU `silu(gate) * up`; with `swiglu_limit` set, gpt-oss's clamped form
`(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, `g = clamp(gate, max=limit)`.

Weight layout (`MoeWeights`, stacked per layer; each expert's matrices are `[out, in]` as `Linear`'s):
  router [E, H] (+ router_bias [E]), w13 [E, 2I, H] (rows :I gate, I: up), w2 [E, H, I]
  (+ b13 [E, 2I], b2 [E, H]). `read_moe_weights` maps the checkpoints' names (prefix `model.layers.N.`):
  mixtral    block_sparse_moe.gate.weight; block_sparse_moe.experts.{e}.w1 (gate, [I, H]), .w3 (up),
             .w2 (down, [H, I]) .weight, one tensor per expert.
  qwen3_moe  mlp.gate.weight; mlp.experts.{e}.gate_proj / up_proj / down_proj.weight. Layers in
             `mlp_only_layers` or off `decoder_sparse_step` are dense MLPs (mlp.gate_proj etc.).
  gpt_oss    mlp.router.weight / .bias; mlp.experts.gate_up_proj [E, H, 2I] (gate in the even columns,
             up in the odd), gate_up_proj_bias [E, 2I] interleaved alike, down_proj [E, I, H],
             down_proj_bias [E, H]. The published checkpoints store the two expert matrices as MXFP4
             (`gate_up_proj_blocks` / `_scales`, `down_proj_*`): dequantise them before this step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from engine.model.linear import Linear

Scoring = Literal["softmax_topk", "topk_softmax"]


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    """E, the experts of the layer (all ranks together)."""
    top_k: int
    """Experts each token is routed to."""
    scoring: Scoring = "softmax_topk"
    """"softmax_topk" (Mixtral, Qwen3-MoE) or "topk_softmax" (gpt-oss); see the module docstring."""
    renormalize: bool = True
    """With "softmax_topk": divide the k weights by their sum (Mixtral; Qwen3-MoE's `norm_topk_prob`)."""
    swiglu_limit: float | None = None
    """gpt-oss's `swiglu_limit`: use its clamped SwiGLU; None: plain `silu(gate) * up`."""
    swiglu_alpha: float = 1.702
    """gpt-oss's `swiglu_alpha`, the sigmoid's slope; only read with `swiglu_limit`."""

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        if self.scoring not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"unknown MoE scoring {self.scoring!r}")


@dataclass
class MoeWeights:
    router: torch.Tensor
    """[E, H] router (gate) weight."""
    w13: torch.Tensor
    """[E, 2I, H]: each expert's gate rows then its up rows."""
    w2: torch.Tensor
    """[E, H, I]: each expert's down projection."""
    router_bias: torch.Tensor | None = None
    """[E] (gpt-oss)."""
    b13: torch.Tensor | None = None
    """[E, 2I] gate then up biases (gpt-oss)."""
    b2: torch.Tensor | None = None
    """[E, H] down biases (gpt-oss)."""
    linears: list[tuple[Linear, Linear]] | None = None
    """On CPU (`pack_experts`): each expert's gate|up and down as a `Linear` (prepacked for oneDNN; float32
    multiplies on CPUs without a bf16 GEMM, where a bf16 `F.linear` crawls). The stacked w13 / w2 are then
    dropped (None), so the experts are held once."""

    def expert_mlp(self, e: int, x: torch.Tensor, spec: MoeSpec) -> torch.Tensor:
        """Expert e (local index) on its rows x [n, H] -> [n, H]: down(swiglu(gate_up(x)))."""
        if self.linears is not None:
            gate_up, down = self.linears[e]
            return down(swiglu(gate_up(x), spec))
        gate_up = F.linear(x, self.w13[e], None if self.b13 is None else self.b13[e])
        return F.linear(swiglu(gate_up, spec), self.w2[e], None if self.b2 is None else self.b2[e])


def pack_experts(weights: MoeWeights) -> MoeWeights:
    """The CPU form of `weights`: each expert's matrices as `Linear`s (see `MoeWeights.linears`)."""
    linears = [(Linear(weights.w13[e], None if weights.b13 is None else weights.b13[e]),
                Linear(weights.w2[e], None if weights.b2 is None else weights.b2[e]))
               for e in range(weights.w13.shape[0])]
    return MoeWeights(weights.router, None, None, weights.router_bias, weights.b13, weights.b2, linears)


@dataclass
class MoeOutput:
    hidden: torch.Tensor
    """[T, H] the layer's output."""
    expert_counts: torch.Tensor
    """[E] int64: the (token, expert) pairs each expert computed this call."""


def route(hidden: torch.Tensor, weights: MoeWeights, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] -> (weights [T, k] float32, expert ids [T, k] int64), as `spec.scoring` says."""
    logits = F.linear(hidden, weights.router, weights.router_bias)
    if spec.scoring == "topk_softmax":
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return top.softmax(dim=-1, dtype=torch.float32), ids
    top, ids = torch.topk(logits.softmax(dim=-1, dtype=torch.float32), spec.top_k, dim=-1)
    if spec.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, ids


def swiglu(gate_up: torch.Tensor, spec: MoeSpec) -> torch.Tensor:
    """[n, 2I] rows of (gate, up) -> [n, I]; plain or gpt-oss's clamped SwiGLU (`spec.swiglu_limit`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if spec.swiglu_limit is None:
        return F.silu(gate) * up
    limit = spec.swiglu_limit
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] expert ids -> (pair indices into the flattened [T*k] sorted by expert (stable: tokens in
    order within an expert), pairs per expert [E] int64)."""
    flat = expert_ids.flatten()
    return flat.argsort(stable=True), torch.bincount(flat, minlength=num_experts)


def moe_forward(hidden: torch.Tensor, weights: MoeWeights, spec: MoeSpec) -> MoeOutput:
    """[T, H] -> the weighted sum of each token's top-k experts, computing only those (module docstring)."""
    return experts_forward(hidden, weights, spec, *route(hidden, weights, spec))


def experts_forward(hidden: torch.Tensor, weights: MoeWeights, spec: MoeSpec, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> MoeOutput:
    """The experts half of `moe_forward` for given routing: one GEMM pair per active expert over its
    contiguous run of the expert-sorted pairs. The routing weights are cast to the activations' dtype
    before scaling (Qwen3-MoE's rounding; Mixtral scales in float32: equal in float32)."""
    order, counts = sort_by_expert(topk_ids, spec.num_experts)
    tokens = order // spec.top_k
    x = hidden.index_select(0, tokens)  # [T*k, H], each expert's rows contiguous
    y = torch.empty_like(x)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = slice(start, start + n)
        y[rows] = weights.expert_mlp(e, x[rows], spec)
        start += n
    per_pair = torch.empty_like(y)
    per_pair[order] = y  # back to [token, k] order: a permutation, so no scatter-add
    per_pair = per_pair.view(hidden.shape[0], spec.top_k, y.shape[1]) * topk_weights.to(y.dtype).unsqueeze(-1)
    return MoeOutput(per_pair.sum(dim=1), counts)


def stack_experts(gate: list[torch.Tensor], up: list[torch.Tensor],
                  down: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert checkpoint matrices (Mixtral w1/w3/w2, Qwen3-MoE gate/up/down_proj) -> (w13, w2)."""
    w13 = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
    return w13, torch.stack(down)


def from_gpt_oss(gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                 down_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """gpt-oss's interleaved, transposed expert tensors -> (w13, b13, w2, b2) in this module's layout."""
    w13 = torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], dim=2).transpose(1, 2).contiguous()
    b13 = torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1)
    return w13, b13, down.transpose(1, 2).contiguous(), down_bias


def read_moe_weights(take: Callable[[str], torch.Tensor], prefix: str, family: str,
                     num_experts: int) -> MoeWeights:
    """One layer's MoE tensors from a checkpoint, by the names `family` (module docstring) gives them;
    `take(name)` returns the tensor (e.g. the loader's `pop`), `prefix` is "model.layers.N."."""
    if family == "gpt_oss":
        p = prefix + "mlp."
        w13, b13, w2, b2 = from_gpt_oss(take(p + "experts.gate_up_proj"), take(p + "experts.gate_up_proj_bias"),
                                        take(p + "experts.down_proj"), take(p + "experts.down_proj_bias"))
        return MoeWeights(take(p + "router.weight"), w13, w2, take(p + "router.bias"), b13, b2)
    names = {"mixtral": ("block_sparse_moe.", "w1", "w3", "w2"),
             "qwen3_moe": ("mlp.", "gate_proj", "up_proj", "down_proj")}
    if family not in names:
        raise ValueError(f"no MoE weight names for family {family!r}")
    block, *projections = names[family]
    gate, up, down = ([take(f"{prefix}{block}experts.{e}.{proj}.weight") for e in range(num_experts)]
                      for proj in projections)
    return MoeWeights(take(prefix + block + "gate.weight"), *stack_experts(gate, up, down))
