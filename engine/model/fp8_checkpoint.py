"""Write an unquantized checkpoint as an fp8 one in the format vLLM's `fp8` method loads.

Each linear of each layer (q/k/v/o, gate/up/down; Phi-3's fused qkv and gate_up) becomes a float8_e4m3fn
`weight` and a float32 `weight_scale` (one per tensor, shape [], what vLLM's `fp8` reads; our loader also
takes one per output channel); embeddings, norms and the LM head stay in the checkpoint's dtype. config.json gains
`"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}`. The other files
(tokenizer, generation config, chat template) are copied as they are.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from engine.model.loader import read_tensors
from engine.model.quantization import quantize_fp8

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.qkv_proj", "mlp.gate_up_proj")


def save_fp8_checkpoint(src: Path, dst: Path) -> Path:
    """Write `src` (an unquantized Llama-family checkpoint directory) to `dst` in fp8."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = read_tensors(src)
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.removesuffix(".weight").endswith(LINEARS):
            out[name], out[name + "_scale"] = quantize_fp8(tensor, per_channel=False)
        else:
            out[name] = tensor.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json",
                                                                                    "model.safetensors.index.json"):
            shutil.copy2(extra, dst / extra.name)
    return dst
