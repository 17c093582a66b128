"""The subset of a Hugging Face config.json the decoders need (engine/model/registry.py names which)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import CHECKPOINT_QUANTIZATIONS
from engine.model.layer_types import parse_layer_types
from engine.model.moe_config import MoeConfig, parse_moe
from engine.model.registry import FAMILIES, family_fields, find_architecture
from engine.model.rope_scaling import parse_rope_scaling, rope_parameters


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
    """The window of the layers whose type is "sliding_attention" (None when no layer has one)."""
    layer_types: tuple[str, ...] = ()
    """Each layer's attention: "full_attention" or "sliding_attention" (`layer_types` in transformers 5
    configs; derived as transformers derives it where a config omits it). Empty means all full."""
    quantization: str | None = None
    """The checkpoint's own weight format (`quantization_config.quant_method`), None when unquantized."""
    moe: MoeConfig | None = None
    """The experts of a Mixture-of-Experts family (engine/model/moe_config.py); None for a dense one."""
    family_fields: dict = field(default_factory=dict)
    """Fields only one family reads, parsed by its `Family.fields` module (e.g. engine/model/gemma_config.py)."""

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def all_sliding(self) -> bool:
        """Every layer windowed (Mistral v0.1, Phi-3-mini-4k): tokens older than the window are never read again."""
        return bool(self.layer_types) and all(t == "sliding_attention" for t in self.layer_types)

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        arch = find_architecture(raw.get("architectures") or [])
        raw = {**dict(FAMILIES[arch].config_defaults), **raw}
        rope_theta, rope = rope_parameters(raw, "full_attention" if FAMILIES[arch].layer_type_rope else None)
        alias = dict(FAMILIES[arch].rope_aliases).get(rope.get("rope_type", rope.get("type")))
        if alias is not None:
            rope["rope_type"] = alias
        rope_scaling = parse_rope_scaling(rope, raw)
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        layer_types, sliding = parse_layer_types(raw, arch)
        quantization = (raw.get("quantization_config") or {}).get("quant_method")
        if quantization is not None and quantization not in CHECKPOINT_QUANTIZATIONS:
            raise ValueError(f"checkpoint quantization {quantization!r} is not supported (supported: "
                             f"{', '.join(CHECKPOINT_QUANTIZATIONS)}; or quantize an unquantized checkpoint "
                             "at load with --quantization)")
        if quantization == "mxfp4" and FAMILIES[arch].moe != "gpt_oss":
            raise ValueError(f"{arch}: mxfp4 checkpoints are supported for gpt-oss (GptOssForCausalLM) only")
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
            sliding_window=sliding,
            layer_types=layer_types,
            quantization=quantization,
            moe=parse_moe(raw, FAMILIES[arch].moe, raw["num_hidden_layers"]),
            family_fields=family_fields(raw, arch),
        )
