"""Load a Hugging Face safetensors checkpoint into the decoder of its family (engine/model/registry.py)."""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention import make_backend
from engine.model.linear import Linear
from engine.model.llama import LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.registry import family_module
from engine.model.weights import CheckpointWeights
from engine.parallel.layers import VocabParallelHead
from engine.parallel.pipeline import PipelineStage
from engine.parallel.sharding import shard_config, shard_vocab
from engine.parallel.tp_group import TPGroup

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LEFT_ON_PURPOSE = ("self_attn.k_scale", "self_attn.v_scale", "rotary_emb.inv_freq", ".input_scale")
"""Layer tensors (name suffixes) no decoder takes: an fp8 KV cache's scales (read by kv_scales.py), stale
RoPE buffers, and fp8 static activation scales (activations are quantized with dynamic scales)."""


def resolve_dtype(requested: str, config: ModelConfig) -> torch.dtype:
    """`auto` means the checkpoint's own dtype."""
    name = config.torch_dtype if requested == "auto" else requested
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}")
    return _DTYPES[name]


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def read_tensors(path: Path, layers: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors; with `layers` ([start, end): a pipeline stage's), no other layer's is read."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                layer = _LAYER_NAME.match(name) if layers is not None else None
                if layer is None or layers[0] <= int(layer.group(1)) < layers[1]:
                    tensors[name] = f.get_tensor(name)
    return tensors


def resolve_quantization(requested: str | None, config: ModelConfig) -> str | None:
    """The weight format to run the linears in: the checkpoint's own when it has one (a request for another is
    an error: re-quantizing quantized weights compounds the rounding), else the requested one. An mxfp4
    checkpoint's linears are unquantized (only gpt-oss's experts are MXFP4, dequantised by engine/model/mxfp4.py)."""
    if config.quantization is not None and requested not in (None, config.quantization):
        raise ValueError(f"the checkpoint is already quantized ({config.quantization}); "
                         f"cannot load it as {requested}")
    if config.quantization == "mxfp4":
        return None
    return config.quantization or requested


def load_model(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               attention_backend: str, max_positions: int, quantization: str | None = None,
               tp: TPGroup | None = None, stage: PipelineStage | None = None) -> LlamaModel:
    """The decoder of `config.architecture`'s family (engine/model/registry.py) on `device` in `dtype`;
    with `quantization` (see `resolve_quantization`) the linears of each layer run on quantized weights
    (the embedding and LM head stay in `dtype`). With `tp`, only this rank's shard of each weight
    (engine/parallel/sharding.py), sliced before it is moved, cast or quantized; the model then computes
    with this rank's heads. With `stage` (pipeline parallelism), only that stage's layers, the embedding on
    the first stage and the final norm and LM head on the last (engine/parallel/pipeline.py).
    A layer tensor the family did not take is an error (it would be ignored)."""
    family = family_module(config.architecture)
    first, end = (stage.start, stage.end) if stage is not None else (0, config.num_layers)
    weights = CheckpointWeights(read_tensors(path, (first, end) if stage is not None else None), str(path), dtype,
                                device, resolve_quantization(quantization, config), config.quantization, tp)
    layers = [family.load_layer(weights, i, config) for i in range(first, end)]
    tied = config.tie_word_embeddings or "lm_head.weight" not in weights
    embed = weights.pop("model.embed_tokens.weight")
    lm_head = embed if tied else weights.pop("lm_head.weight")
    if stage is not None:  # what this stage does not run is dropped before it is moved or cast
        embed = embed if stage.is_first else None
        lm_head = lm_head if stage.is_last else None
    if tp is not None:
        embed = shard_vocab(embed, tp.rank, tp.world_size) if embed is not None else None
        if lm_head is not None:
            lm_head = embed if tied and embed is not None else shard_vocab(lm_head, tp.rank, tp.world_size)
    embed = embed.to(device=device, dtype=dtype).contiguous() if embed is not None else None
    if lm_head is not None:
        lm_head = embed if tied and embed is not None else lm_head.to(device=device, dtype=dtype).contiguous()
    head = None
    if lm_head is not None:
        head = Linear(lm_head) if tp is None else VocabParallelHead(Linear(lm_head), tp, config.vocab_size)
    final_norm = weights.take("model.norm.weight") if head is not None else None
    _check_all_taken(weights, config)
    local = config if tp is None else shard_config(config, tp.world_size, tp.expert_parallel)
    scale = family.attention_scale(config) if hasattr(family, "attention_scale") else None  # Gemma's own
    attention = make_backend(attention_backend, local.num_heads, local.num_kv_heads, local.head_dim, scale)
    model = family.Model(local, embed, layers, final_norm, head, attention, max_positions, tp, stage)
    attention.check_layers(model.layer_attention, attention_backend)  # e.g. sinks on a backend without them
    return model


def _check_all_taken(weights: CheckpointWeights, config: ModelConfig) -> None:
    """Raise ValueError if a layer tensor is left that the family's decoder would silently not apply."""
    unused = sorted(name for name in weights.remaining
                    if name.startswith("model.layers.") and not name.endswith(_LEFT_ON_PURPOSE))
    if unused:
        raise ValueError(f"{config.architecture}: the checkpoint has {len(unused)} layer tensors its decoder "
                         f"does not use (e.g. {unused[0]}); refusing rather than computing without them")
