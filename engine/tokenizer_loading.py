"""Load a checkpoint's transformers tokenizer, remembering which class AutoTokenizer chose.

AutoTokenizer decides the class from the model's config, and loading that config imports the model family's
modules, which import torch: ~2.5 CPU-seconds per process, most of a router's start. The class it picks
depends only on the checkpoint's files and the transformers version, so the first load records the choice
under the pdserve cache and later loads of the same files call that class directly (same object, same
encodings; the class itself imports no torch). Anything unexpected falls back to AutoTokenizer.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from engine.model_files import cache_root

logger = logging.getLogger(__name__)

_KEY_FILES = ("config.json", "tokenizer_config.json")
"""Read whole into the key: AutoTokenizer's choice reads them (model type, tokenizer class, auto_map)."""
_STAT_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")
"""Keyed by size and mtime: large, and only a byte-level check of tokenizer.json reads them."""


def load_hf_tokenizer(path: Path):
    """The transformers tokenizer of checkpoint directory `path`, as AutoTokenizer would build it."""
    import transformers

    key = _choice_key(path, transformers.__version__)
    name = _read_choices().get(key)
    cls = getattr(transformers, name, None) if name else None
    if cls is not None:
        return cls.from_pretrained(str(path), local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    chosen = type(tokenizer)
    if getattr(transformers, chosen.__name__, None) is chosen:  # a library class, not remote code
        _record_choice(key, chosen.__name__)
    return tokenizer


def choices_file() -> Path:
    return cache_root() / "tokenizer-classes.json"


def _choice_key(path: Path, transformers_version: str) -> str:
    digest = hashlib.sha256(f"{transformers_version}\0{path.resolve()}".encode())
    for name in _KEY_FILES:
        file = path / name
        digest.update(b"\0" + name.encode() + b"\0" + (file.read_bytes() if file.is_file() else b"-"))
    for name in _STAT_FILES:
        file = path / name
        stat = file.stat() if file.is_file() else None
        digest.update(f"\0{name}:{stat.st_size}:{stat.st_mtime_ns}".encode() if stat else f"\0{name}:-".encode())
    return digest.hexdigest()


def _read_choices() -> dict[str, str]:
    try:
        choices = json.loads(choices_file().read_text())
    except (OSError, ValueError):
        return {}
    return choices if isinstance(choices, dict) else {}


def _record_choice(key: str, class_name: str) -> None:
    """Add one entry, written whole and renamed into place (processes starting together race harmlessly:
    at worst one's entry is lost and recorded again next time)."""
    target = choices_file()
    choices = _read_choices()
    choices[key] = class_name
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tokenizer-classes.")
        with os.fdopen(fd, "w") as f:
            json.dump(choices, f)
        os.replace(tmp, target)
    except OSError as e:  # a read-only cache only costs the next start its speed
        logger.debug("could not record the tokenizer class: %s", e)
