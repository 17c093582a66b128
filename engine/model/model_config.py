"""The subset of a Hugging Face config.json the decoders need (engine/model/registry.py names which)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.config import CHECKPOINT_QUANTIZATIONS
from engine.model.moe_config import MoeConfig, parse_moe
from engine.model.registry import FAMILIES, find_architecture
from engine.model.rope_scaling import parse_rope_scaling


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    """The Hugging Face architecture name (a key of engine.model.registry.FAMILIES)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None
    quantization: str | None = None
    """The checkpoint's own weight format (`quantization_config.quant_method`), None when unquantized."""
    moe: MoeConfig | None = None
    """The experts of a Mixture-of-Experts family (engine/model/moe_config.py); None for a dense one."""

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        arch = find_architecture(raw.get("architectures") or [])
        raw = {**dict(FAMILIES[arch].config_defaults), **raw}
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        alias = dict(FAMILIES[arch].rope_aliases).get(rope.get("rope_type", rope.get("type")))
        if alias is not None:
            rope["rope_type"] = alias
        rope_theta = float(raw.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope_scaling = parse_rope_scaling(rope, raw)
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        layer_types = set(raw.get("layer_types") or ["full_attention"])
        if sliding is not None or layer_types != {"full_attention"}:
            raise ValueError(f"sliding-window attention is not supported (sliding_window={sliding}, "
                             f"layer_types {sorted(layer_types)})")
        quantization = (raw.get("quantization_config") or {}).get("quant_method")
        if quantization is not None and quantization not in CHECKPOINT_QUANTIZATIONS:
            raise ValueError(f"checkpoint quantization {quantization!r} is not supported (supported: "
                             f"{', '.join(CHECKPOINT_QUANTIZATIONS)}; or quantize an unquantized checkpoint "
                             "at load with --quantization)")
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads", num_heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=FAMILIES[arch].qkv_bias or bool(raw.get("attention_bias", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            quantization=quantization,
            moe=parse_moe(raw, FAMILIES[arch].moe, raw["num_hidden_layers"]),
        )
