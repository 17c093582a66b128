"""The subset of a Hugging Face config.json the Llama-family decoder needs."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.config import CHECKPOINT_QUANTIZATIONS

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
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

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        kind = SUPPORTED_ARCHITECTURES[arch]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(raw.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope type {rope_type!r}")
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", kind == "mistral") else None
        if sliding is not None:
            raise ValueError("sliding-window attention is not supported")
        quantization = (raw.get("quantization_config") or {}).get("quant_method")
        if quantization is not None and quantization not in CHECKPOINT_QUANTIZATIONS:
            raise ValueError(f"checkpoint quantization {quantization!r} is not supported (supported: "
                             f"{', '.join(CHECKPOINT_QUANTIZATIONS)}; or quantize an unquantized checkpoint "
                             "at load with --quantization)")
        return cls(
            architecture=kind,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads", num_heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(raw.get("attention_bias", False)),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            quantization=quantization,
        )
