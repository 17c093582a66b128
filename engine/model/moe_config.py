"""The Mixture-of-Experts fields of a config.json (Mixtral, Qwen3-MoE, gpt-oss), read and checked without torch.

  Mixtral    num_local_experts, num_experts_per_tok; each expert's width is `intermediate_size`; every
             layer is sparse; the top-k weights are always renormalised.
  Qwen3-MoE  num_experts (transformers 5 writes it as num_local_experts), num_experts_per_tok,
             moe_intermediate_size, norm_topk_prob (default false), and the dense layers: those in
             mlp_only_layers or where (i + 1) % decoder_sparse_step != 0 run a dense MLP of
             `intermediate_size`, as transformers' Qwen3MoeDecoderLayer decides.
  gpt-oss    num_local_experts, num_experts_per_tok (transformers ignores the original `experts_per_token`,
             and so do we), each expert `intermediate_size` wide, every layer sparse; routing top-k of the
             logits then softmax over the k ("topk_softmax"); the clamped SwiGLU of `swiglu_limit` and
             `swiglu_alpha`; the defaults of omitted fields are the family's `config_defaults` (registry.py).
Shared experts (Qwen2-MoE's `shared_expert_intermediate_size`, DeepSeek's `n_shared_experts`) are not
implemented and are refused by field name.
"""
from __future__ import annotations

from dataclasses import dataclass

_UNSUPPORTED = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    """E, the experts of each sparse layer."""
    top_k: int
    """Experts each token is routed to (`num_experts_per_tok`)."""
    intermediate_size: int
    """Each expert's intermediate width (with tensor parallelism: this rank's slice of it)."""
    renormalize: bool
    """Divide the top-k routing weights by their sum (Mixtral always; Qwen3-MoE's `norm_topk_prob`)."""
    dense_layers: tuple[int, ...] = ()
    """Layers that run a dense MLP (config.intermediate_size) instead of the experts."""
    scoring: str = "softmax_topk"
    """engine.model.moe.MoeSpec's routing: "softmax_topk" (Mixtral, Qwen3-MoE) or "topk_softmax" (gpt-oss)."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped SwiGLU limit; None: plain SwiGLU."""
    swiglu_alpha: float = 1.702
    """gpt-oss's SwiGLU sigmoid slope (read only with swiglu_limit)."""

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts, got {self.top_k} of "
                             f"{self.num_experts} experts")
        if self.intermediate_size < 1:
            raise ValueError(f"the experts' intermediate size must be positive, got {self.intermediate_size}")

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer` runs the experts (else a dense MLP)."""
        return layer not in self.dense_layers


def parse_moe(raw: dict, family: str | None, num_layers: int) -> MoeConfig | None:
    """The MoE config of a config.json whose architecture uses `family`'s MoE names (registry.Family.moe);
    None for a dense family. ValueError naming the field for what the engine does not implement."""
    if family is None:
        return None
    for field in _UNSUPPORTED:
        if raw.get(field):
            raise ValueError(f"shared experts are not supported ({field}={raw[field]})")
    num_experts = raw.get("num_experts", raw.get("num_local_experts"))
    if num_experts is None:
        raise ValueError("an MoE config.json needs num_experts (or num_local_experts)")
    if family == "gpt_oss":
        return MoeConfig(num_experts, raw["num_experts_per_tok"], raw["intermediate_size"], renormalize=False,
                         scoring="topk_softmax", swiglu_limit=float(raw["swiglu_limit"]),
                         swiglu_alpha=float(raw["swiglu_alpha"]))
    if family == "mixtral":
        return MoeConfig(num_experts, raw["num_experts_per_tok"], raw["intermediate_size"], renormalize=True)
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    mlp_only = set(raw.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step)
    return MoeConfig(num_experts, raw["num_experts_per_tok"], raw["moe_intermediate_size"],
                     renormalize=bool(raw.get("norm_topk_prob", False)), dense_layers=dense)
