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
from engine.parallel.layers import RowParallelLinear, VocabParallelHead
from engine.parallel.sharding import shard_cols, shard_config, shard_rows, shard_vocab
from engine.parallel.tp_group import TPGroup

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
               attention_backend: str, max_positions: int, quantization: str | None = None,
               tp: TPGroup | None = None) -> LlamaModel:
    """The decoder on `device` in `dtype`; with `quantization` (see `resolve_quantization`) the four
    linears of each layer run on quantized weights (the embedding and LM head stay in `dtype`).
    With `tp`, only this rank's shard of each weight (engine/parallel/sharding.py), sliced before it is
    moved, cast or quantized; the model then computes with this rank's heads."""
    raw = read_tensors(path)
    quantization = resolve_quantization(quantization, config)
    rank, world = (tp.rank, tp.world_size) if tp is not None else (0, 1)

    def pop(name: str) -> torch.Tensor:
        if name not in raw:
            raise KeyError(f"checkpoint {path} lacks tensor {name}")
        return raw.pop(name)

    def take(name: str) -> torch.Tensor:
        return pop(name).to(device=device, dtype=dtype).contiguous()

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t if tp is None else shard_rows(t, rank, world)

    def linear(prefixes: list[str], bias: bool = False, row_parallel: bool = False):
        """Column-parallel (each part's row shard, merged) unless `row_parallel` (a column shard, whose
        outputs the ranks sum)."""
        def cut(t: torch.Tensor) -> torch.Tensor:
            if tp is None:
                return t
            return shard_cols(t, rank, world) if row_parallel else shard_rows(t, rank, world)

        b = torch.cat([rows(pop(p + ".bias")) for p in prefixes]).to(device=device, dtype=dtype) if bias else None
        if config.quantization == "fp8":  # stored in fp8: its own scales, per tensor or per channel
            parts = [pop(p + ".weight") for p in prefixes]
            q = torch.cat([cut(w.view(torch.uint8)) for w in parts]).view(FP8_DTYPE).to(device)
            scales = [checkpoint_scales(pop(p + ".weight_scale"), w.shape[0])
                      for p, w in zip(prefixes, parts, strict=True)]  # per row of the whole weight
            scales = torch.cat([s if row_parallel else rows(s) for s in scales]).to(device)
            return _parallel(QUANTIZED_LINEARS["fp8"](q.contiguous(), scales, b, dtype), tp, row_parallel)
        weight = torch.cat([cut(pop(p + ".weight")) for p in prefixes]).to(device)
        if quantization is None:
            return _parallel(Linear(weight.to(dtype).contiguous(), b), tp, row_parallel)
        q, scales = QUANTIZERS[quantization](weight)
        return _parallel(QUANTIZED_LINEARS[quantization](q, scales, b, dtype), tp, row_parallel)

    layers = []
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        layers.append(LayerWeights(
            input_norm=take(f"model.layers.{i}.input_layernorm.weight"),
            qkv=linear([attn + f"{n}_proj" for n in "qkv"], bias=config.qkv_bias),
            o_proj=linear([attn + "o_proj"], row_parallel=True),
            post_norm=take(f"model.layers.{i}.post_attention_layernorm.weight"),
            gate_up=linear([mlp + "gate_proj", mlp + "up_proj"]),
            down=linear([mlp + "down_proj"], row_parallel=True),
        ))
    tied = config.tie_word_embeddings or "lm_head.weight" not in raw
    embed = pop("model.embed_tokens.weight")
    lm_head = embed if tied else pop("lm_head.weight")
    if tp is not None:
        embed = shard_vocab(embed, rank, world)
        lm_head = embed if tied else shard_vocab(lm_head, rank, world)
    embed = embed.to(device=device, dtype=dtype).contiguous()
    lm_head = embed if tied else lm_head.to(device=device, dtype=dtype).contiguous()
    head = Linear(lm_head) if tp is None else VocabParallelHead(Linear(lm_head), tp, config.vocab_size)
    local = config if tp is None else shard_config(config, world)
    attention = make_backend(attention_backend, local.num_heads, local.num_kv_heads, local.head_dim)
    return LlamaModel(local, embed, layers, take("model.norm.weight"), head, attention, max_positions, tp)


def _parallel(linear, tp: TPGroup | None, row_parallel: bool):
    """A row-parallel linear sums its ranks' outputs; the others are used as they are."""
    return RowParallelLinear(linear, tp) if tp is not None and row_parallel else linear
