"""What must match for a disk tier's blocks to be this engine's KV: written into the tier's header."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch


def layout_key(model_path, shards: list[torch.Tensor], kv_scales=None) -> str:
    """A digest of the model (its config and weight files' names and sizes), the KV dtype, the per-rank
    block shape (layers, K/V, tokens, heads, head dim: the tensor-parallel split) and fp8 scales."""
    model_dir = Path(model_path)
    weights = sorted((p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors"))
    config = (model_dir / "config.json").read_bytes() if (model_dir / "config.json").exists() else b""
    canon = json.dumps({"config": hashlib.sha256(config).hexdigest(), "weights": weights,
                        "dtype": str(shards[0].dtype), "blocks": [list(s.shape[1:]) for s in shards],
                        "kv_scales": [list(map(float, pair)) for pair in kv_scales or []]}, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()[:32]
