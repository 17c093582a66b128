"""Per-layer K/V scales of an fp8 KV cache, read from the checkpoint when it has them.

A checkpoint calibrated for an fp8 KV cache (llm-compressor, the vLLM convention)
holds float32 scalars `model.layers.N.self_attn.k_scale` / `v_scale`; K is stored
as K / k_scale in float8_e4m3 and read back as fp8 * k_scale. Without them every
scale is 1.0, which suits models whose K/V stay well inside e4m3's ±448. Kept
apart from loader.py: only the fp8 cache needs these two tensors.
"""
from __future__ import annotations

import re
from pathlib import Path

from safetensors import safe_open

_SCALE_KEY = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


def load_kv_scales(path: str | Path, num_layers: int) -> list[tuple[float, float]]:
    """(k_scale, v_scale) of each layer: the checkpoint's where present, else 1.0."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                match = _SCALE_KEY.match(key)
                if match and int(match.group(1)) < num_layers:
                    value = float(f.get_tensor(key).float().reshape(-1)[0])
                    if not value > 0:
                        raise ValueError(f"{key} = {value}: a KV scale must be > 0")
                    scales[int(match.group(1))][match.group(2) == "v"] = value
    return [(k, v) for k, v in scales]
