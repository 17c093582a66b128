"""RoPE scaling variants as transformers 5.x defines them (`modeling_rope_utils`), without torch.

`parse_rope_scaling` reads a config's RoPE fields, refusing what the engine does not implement
(`rope_parameters` picks one layer type's where they nest per type, as Gemma 3's do);
`attention_factor` is the scale transformers applies to cos and sin. The inverse frequencies of
each type are computed in `engine/model/rotary.py`:

  default   theta ** (-2i / d)
  linear    default / factor                                  (position interpolation)
  llama3    low frequencies / factor, high kept, smooth ramp between
  yarn      interpolation (/ factor) blended with extrapolation by a ramp over dimensions
            [beta_fast, beta_slow] rotations; attention factor from factor, mscale, mscale_all_dim
  longrope  per-frequency short_factor (positions < original_max_position_embeddings) or
            long_factor (positions from there on); attention factor sqrt(1 + ln f / ln original)

LongRoPE switches per position here (see `RotaryEmbedding`), not per forward pass as transformers does.
"""
from __future__ import annotations

import math

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
"""The `rope_type` values the engine implements."""


def is_per_layer_type(rope: object) -> bool:
    """Whether a `rope_parameters` value nests one dict per layer type (transformers 5's Gemma 3:
    {"full_attention": {...}, "sliding_attention": {...}})."""
    return isinstance(rope, dict) and any(isinstance(value, dict) for value in rope.values())


def rope_parameters(raw: dict, layer_type: str | None = None) -> tuple[float, dict]:
    """(rope_theta, RoPE parameter dict) of config.json `raw`: `rope_parameters` (transformers 5) or the
    legacy `rope_scaling` beside a top-level `rope_theta` (default 10000). With `layer_type` (a family
    whose RoPE differs per layer type), a nested `rope_parameters` gives that type's entry, its own
    rope_theta first; without it a nested dict comes back whole, for `parse_rope_scaling` to refuse."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if layer_type is not None and is_per_layer_type(rope):
        rope = dict(rope.get(layer_type) or {})
        return float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))), rope
    return float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))), rope


def parse_rope_scaling(rope: dict, raw: dict) -> dict | None:
    """The scaling parameters of one RoPE parameter dict (`rope_parameters` or legacy `rope_scaling`),
    with the fields transformers fills from the rest of the config (`raw`) filled the same way;
    None for plain RoPE. Raises ValueError naming the field the engine does not implement."""
    nested = sorted(key for key, value in rope.items() if isinstance(value, dict))
    if nested:
        raise ValueError(f"per-layer-type rope_parameters ({', '.join(nested)}) are not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only full-head rotary)")
    if rope_type == "default":
        return None
    scaling = dict(rope, rope_type=rope_type)
    if rope_type in ("yarn", "longrope"):
        # Phi-3 keeps the pretraining length at the top level, and transformers prefers it there.
        max_len = raw.get("max_position_embeddings", 2048)
        original = int(raw.get("original_max_position_embeddings")
                       or rope.get("original_max_position_embeddings") or max_len)
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None:
            scaling["factor"] = max_len / original
    return scaling


def attention_factor(scaling: dict | None) -> float:
    """The factor transformers multiplies cos and sin by (1.0 but for yarn and longrope)."""
    kind = scaling["rope_type"] if scaling else "default"
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if kind == "longrope":
        original = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def long_factor_start(scaling: dict | None) -> int | None:
    """The first position that uses longrope's long factors; None for every other type."""
    if not scaling or scaling["rope_type"] != "longrope":
        return None
    return scaling["original_max_position_embeddings"]


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
