"""Load a Hugging Face safetensors checkpoint into the Llama-family decoder."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention import make_backend
from engine.model.linear import Linear
from engine.model.llama import LayerWeights, LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.quantization import FP8_DTYPE, QUANTIZERS, checkpoint_scales
from engine.model.quantized_linear import QUANTIZED_LINEARS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, config: ModelConfig) -> torch.dtype:
    """`auto` means the checkpoint's own dtype."""
    name = config.torch_dtype if requested == "auto" else requested
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}")
    return _DTYPES[name]


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def resolve_quantization(requested: str | None, config: ModelConfig) -> str | None:
    """The weight format to run: the checkpoint's own when it has one (a request for another is an
    error: re-quantizing quantized weights compounds the rounding), else the requested one."""
    if config.quantization is not None and requested not in (None, config.quantization):
        raise ValueError(f"the checkpoint is already quantized ({config.quantization}); "
                         f"cannot load it as {requested}")
    return config.quantization or requested


def load_model(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               attention_backend: str, max_positions: int, quantization: str | None = None) -> LlamaModel:
    """The decoder on `device` in `dtype`; with `quantization` (see `resolve_quantization`) the four
    linears of each layer run on quantized weights (the embedding and LM head stay in `dtype`)."""
    raw = read_tensors(path)
    quantization = resolve_quantization(quantization, config)

    def pop(name: str) -> torch.Tensor:
        if name not in raw:
            raise KeyError(f"checkpoint {path} lacks tensor {name}")
        return raw.pop(name)

    def take(name: str) -> torch.Tensor:
        return pop(name).to(device=device, dtype=dtype).contiguous()

    def linear(prefixes: list[str], bias: bool = False) -> Linear:
        b = torch.cat([take(p + ".bias") for p in prefixes]) if bias else None
        if config.quantization == "fp8":  # stored in fp8: its own scales, per tensor or per channel
            parts = [pop(p + ".weight") for p in prefixes]
            q = torch.cat([w.view(torch.uint8) for w in parts]).view(FP8_DTYPE).to(device)
            scales = torch.cat([checkpoint_scales(pop(p + ".weight_scale"), w.shape[0])
                                for p, w in zip(prefixes, parts, strict=True)]).to(device)
            return QUANTIZED_LINEARS["fp8"](q, scales, b, dtype)
        weight = torch.cat([pop(p + ".weight") for p in prefixes]).to(device)
        if quantization is None:
            return Linear(weight.to(dtype).contiguous(), b)
        q, scales = QUANTIZERS[quantization](weight)
        return QUANTIZED_LINEARS[quantization](q, scales, b, dtype)

    layers = []
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        layers.append(LayerWeights(
            input_norm=take(f"model.layers.{i}.input_layernorm.weight"),
            qkv=linear([attn + f"{n}_proj" for n in "qkv"], bias=config.qkv_bias),
            o_proj=linear([attn + "o_proj"]),
            post_norm=take(f"model.layers.{i}.post_attention_layernorm.weight"),
            gate_up=linear([mlp + "gate_proj", mlp + "up_proj"]),
            down=linear([mlp + "down_proj"]),
        ))
    embed = take("model.embed_tokens.weight")
    if config.tie_word_embeddings or "lm_head.weight" not in raw:
        lm_head = embed
    else:
        lm_head = take("lm_head.weight")
    attention = make_backend(attention_backend, config.num_heads, config.num_kv_heads, config.head_dim)
    return LlamaModel(config, embed, layers, take("model.norm.weight"), Linear(lm_head), attention, max_positions)
