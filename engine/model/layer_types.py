"""Which layers of a config.json attend through a sliding window, read as transformers 5 reads it.

  layer_types            the per-layer list ("full_attention" / "sliding_attention"), written by
                         transformers 5 into every config it saves; taken as is when present
  sliding_window_pattern Gemma 3's older configs: layer i slides unless (i + 1) % pattern == 0
  family default         Gemma 2 and gpt-oss alternate (even layers slide), `Family.alternating_window`
  sliding_window alone   every layer slides (Mistral v0.1, Phi-3-mini-4k), unless `use_sliding_window`
                         is false (Qwen2/Qwen3, whose windowed layers are those from `max_window_layers` on)

Another layer type (Llama 4's chunked attention, linear attention) is refused by name.
"""
from __future__ import annotations

from engine.model.registry import FAMILIES

LAYER_TYPES = ("full_attention", "sliding_attention")


def parse_layer_types(raw: dict, architecture: str) -> tuple[tuple[str, ...], int | None]:
    """(each layer's type, the sliding window or None). ValueError naming the field it cannot serve."""
    num_layers = raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is None:
        types = _derived_types(raw, architecture, num_layers, window)
    types = tuple(types)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    if "sliding_attention" not in types:
        return (), None
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_attention layers need a positive sliding_window, got {window!r}")
    return types, window


def _derived_types(raw: dict, architecture: str, num_layers: int, window: int | None) -> list[str]:
    full, sliding = LAYER_TYPES
    if window is None or not raw.get("use_sliding_window", True):
        return [full] * num_layers
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        first = raw.get("max_window_layers", num_layers)
        return [sliding if i >= first else full for i in range(num_layers)]
    pattern = raw.get("sliding_window_pattern")
    if pattern:
        return [full if (i + 1) % pattern == 0 else sliding for i in range(num_layers)]
    if FAMILIES[architecture].alternating_window:
        return [sliding if i % 2 == 0 else full for i in range(num_layers)]
    return [sliding] * num_layers
