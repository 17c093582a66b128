"""Phi-3 / Phi-4 (`Phi3ForCausalLM`): the Llama decoder, loaded from fused q|k|v and gate|up tensors.

What differs from Llama, as transformers' `Phi3Attention` and `Phi3MLP` compute it:
  qkv_proj      one stored tensor, the q rows, then k's, then v's; split into its parts here so that
                each is sliced for tensor parallelism on its own (a rank needs its heads of q, of k and
                of v, not a contiguous slice of the fused rows), then merged again as Llama's q|k|v
  gate_up_proj  likewise: the gate rows, then the up rows
  rope          LongRoPE for the 128k variants, with Phi3Config's own reading of config.json (a legacy
                `su` or `yarn` type is longrope; `original_max_position_embeddings` defaults to 4096):
                `Family.config_defaults` and `rope_aliases` in engine/model/registry.py. The factor set
                is chosen per position (engine/model/rotary.py), so a key keeps its rotation once cached;
                transformers' Phi3 `generate` instead re-runs the whole sequence with the long factors
                when it first exceeds the original context (its `prepare_inputs_for_generation`), so
                from that token on its greedy output can differ from pdserve's
The rest is Llama's math (the residual dropouts are identity at inference), CPU fused path included.
Phi-4 (dense) is the same architecture. Phi-4-mini's partial rotary (partial_rotary_factor 0.75) is
refused when its config is read (engine/model/rope_scaling.py); a fused tensor with biases is refused at
load (its biases are left untaken). A `sliding_window` makes every layer slide, as transformers' Phi3 does
(engine/model/layer_types.py; Phi-3-mini-4k sets 2047, the 128k and 3.5 ones 262144, wider than they run).
"""
from __future__ import annotations

from engine.model import llama
from engine.model.llama import LayerWeights, LlamaModel
from engine.model.model_config import ModelConfig
from engine.model.quantization import checkpoint_scales
from engine.model.weights import CheckpointWeights


def load_layer(weights: CheckpointWeights, i: int, config: ModelConfig) -> LayerWeights:
    """Layer i: the fused tensors split into Llama's names, then taken as a Llama layer."""
    attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    unfuse(weights, attn + "qkv_proj", {attn + "q_proj": q_rows, attn + "k_proj": kv_rows, attn + "v_proj": kv_rows})
    ffn = config.intermediate_size
    unfuse(weights, mlp + "gate_up_proj", {mlp + "gate_proj": ffn, mlp + "up_proj": ffn})
    return llama.load_layer(weights, i, config)


def unfuse(weights: CheckpointWeights, fused: str, parts: dict[str, int]) -> None:
    """Replace `<fused>.weight` (and an fp8 checkpoint's `.weight_scale`) by its row blocks, stored under
    the names of `parts` (name -> rows, in order). ValueError if the rows do not add up."""
    weight = weights.pop(fused + ".weight")
    sizes = list(parts.values())
    if weight.shape[0] != sum(sizes):
        raise ValueError(f"{fused}.weight has {weight.shape[0]} rows; the config implies {sum(sizes)} "
                         f"({' + '.join(map(str, sizes))})")
    for name, block in zip(parts, weight.split(sizes), strict=True):
        weights.remaining[name + ".weight"] = block
    if fused + ".weight_scale" in weights:  # per tensor or per row: one per row, split as the rows
        scales = checkpoint_scales(weights.pop(fused + ".weight_scale"), weight.shape[0])
        for name, block in zip(parts, scales.split(sizes), strict=True):
            weights.remaining[name + ".weight_scale"] = block


Model = LlamaModel
"""The decoder class engine/model/registry.py builds for this family."""
