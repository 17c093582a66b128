"""The config.json fields only Gemma 2 and Gemma 3 read, as transformers 5 reads them (no torch).

`parse_fields` fills `ModelConfig.family_fields` for engine/model/gemma.py:

  query_pre_attn_scalar   the attention scale is query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5)
  attn_logit_softcapping  Gemma 2: scores become cap * tanh(scores / cap) (default 50). Gemma 3's
                          transformers attention never applies it, so it is None there whatever the config says
  final_logit_softcapping logits become cap * tanh(logits / cap) (Gemma 2 default 30, Gemma 3 none)
  local_rope_theta,       Gemma 3's sliding layers' RoPE: the nested `rope_parameters["sliding_attention"]`
  local_rope_scaling      (transformers 5), else the older `rope_local_base_freq` (default 10000) without
                          scaling (the older top-level `rope_scaling` applies to the full-attention layers
                          only, as ModelConfig.rope_scaling); None for Gemma 2, whose layers share one RoPE

Refused by name: an activation other than gelu_pytorch_tanh, bidirectional attention (the embedding
variants), a `vision_config` (a multimodal checkpoint's config, whose text model is not at the top).
"""
from __future__ import annotations

from engine.model.rope_scaling import is_per_layer_type, parse_rope_scaling

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
ACTIVATION = "gelu_pytorch_tanh"


def parse_fields(raw: dict, architecture: str) -> dict:
    """Gemma's own fields of config.json `raw` (see the module docstring). ValueError naming a field the
    engine does not implement."""
    if raw.get("vision_config") is not None:
        raise ValueError(f"{architecture}: config.json has a vision_config (a multimodal Gemma checkpoint); "
                         "only the text-only model is supported")
    activation = raw.get("hidden_activation") or ACTIVATION
    if activation != ACTIVATION:
        raise ValueError(f"{architecture}: hidden_activation {activation!r} is not supported (only {ACTIVATION})")
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"{architecture}: use_bidirectional_attention is not supported (causal attention only)")
    gemma3 = architecture == GEMMA3
    fields = {
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcapping": None if gemma3 else _cap(raw.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": _cap(raw.get("final_logit_softcapping", None if gemma3 else 30.0)),
        "local_rope_theta": None,
        "local_rope_scaling": None,
    }
    if gemma3:
        fields["local_rope_theta"], fields["local_rope_scaling"] = _local_rope(raw)
    return fields


def _cap(value: float | None) -> float | None:
    return None if value is None else float(value)


def _local_rope(raw: dict) -> tuple[float, dict | None]:
    """Gemma 3's sliding layers' (rope_theta, rope scaling)."""
    rope = raw.get("rope_parameters")
    if is_per_layer_type(rope):
        local = dict(rope.get("sliding_attention") or {})
        return float(local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0))), parse_rope_scaling(local, raw)
    if rope:
        raise ValueError(f"{GEMMA3}: rope_parameters must be given per layer type (full_attention, "
                         f"sliding_attention), got {sorted(rope)}")
    return float(raw.get("rope_local_base_freq", 10000.0)), None
