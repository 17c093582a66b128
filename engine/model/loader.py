"""Load a Hugging Face safetensors checkpoint into the Llama-family decoder."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention import make_backend
from engine.model.linear import Linear
from engine.model.llama import LayerWeights, LlamaModel
from engine.model.model_config import ModelConfig

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


def load_model(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               attention_backend: str, max_positions: int) -> LlamaModel:
    raw = read_tensors(path)

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise KeyError(f"checkpoint {path} lacks tensor {name}")
        return raw.pop(name).to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        bias = None
        if config.qkv_bias:
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=Linear(qkv, bias),
            o_proj=Linear(take(p + "self_attn.o_proj.weight")),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=Linear(gate_up),
            down=Linear(take(p + "mlp.down_proj.weight")),
        ))
    embed = take("model.embed_tokens.weight")
    if config.tie_word_embeddings or "lm_head.weight" not in raw:
        lm_head = embed
    else:
        lm_head = take("lm_head.weight")
    attention = make_backend(attention_backend, config.num_heads, config.num_kv_heads, config.head_dim)
    return LlamaModel(config, embed, layers, take("model.norm.weight"), Linear(lm_head), attention, max_positions)
