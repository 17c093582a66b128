"""Launch tiles of the Triton paged-attention kernel, tuned on a device once and remembered in a JSON file.

The kernel's tiles (BLOCK_M query rows per program, TILE keys per loop step, and the launch's num_warps /
num_stages) decide how close prefill gets to the tensor cores' peak, and the best ones differ by GPU, dtype,
head size and grouping. `bench/tune_attention_tiles.py` times the candidates on the device (each checked
against the default tiles' output first) and stores the fastest here; engines on that device then launch
with them. Without an entry the defaults run: 16 x 32 tiles for decode-only steps (the tensor-core minimum of
rows), 64 x 64 for steps with prefill chunks, Triton's default warps and stages.

The file is PDSERVE_ATTENTION_TILES, else ~/.cache/pdserve/attention-tiles.json; entries are keyed by the
device's name, the step kind (decode or prefill), dtype, head_dim and query heads per KV head. Only CUDA
devices look it up (the interpreter's timings mean nothing). An unreadable file is warned about once and the
defaults run.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tiles:
    block_m: int
    """Query rows per program (query tokens x the query heads of one KV head); a power of two >= 16."""
    tile: int
    """Keys per step of the KV loop; a power of two >= 16."""
    num_warps: int | None = None
    """None: Triton's default."""
    num_stages: int | None = None
    """None: Triton's default."""

    def __post_init__(self) -> None:
        for name in ("block_m", "tile"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_warps is not None and (self.num_warps < 1 or self.num_warps & (self.num_warps - 1)):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")

    def launch_options(self) -> dict[str, int]:
        """The kernel launch's num_warps / num_stages keywords (those set)."""
        return {k: v for k, v in (("num_warps", self.num_warps), ("num_stages", self.num_stages)) if v is not None}


DEFAULT_TILES = {"decode": Tiles(16, 32), "prefill": Tiles(64, 64)}

_loaded: dict[str, dict[str, Tiles]] = {}
"""Path -> its entries, read once per process."""


def table_path() -> Path:
    return Path(os.environ.get("PDSERVE_ATTENTION_TILES") or Path.home() / ".cache/pdserve/attention-tiles.json")


def tile_key(device_name: str, kind: str, dtype: torch.dtype, head_dim: int, group: int) -> str:
    return f"{device_name}|{kind}|{str(dtype).removeprefix('torch.')}|d{head_dim}|g{group}"


@functools.lru_cache(maxsize=256)  # once per layer per step otherwise; cleared by save_tiles
def tiles_for(device: torch.device, kind: str, dtype: torch.dtype, head_dim: int, group: int) -> Tiles:
    """The tuned tiles for a step of `kind` ("decode": every sequence one query token; "prefill": any other),
    else the defaults; the block_m is at least `group`'s power of two (a program holds a whole KV group)."""
    tiles = None
    if device.type == "cuda":
        tiles = _entries(table_path()).get(tile_key(torch.cuda.get_device_name(device), kind, dtype, head_dim,
                                                    group))
    return fit_group(tiles or DEFAULT_TILES[kind], group)


def min_block_m(group: int) -> int:
    """The fewest query rows a program may have: a whole KV group's query heads, to a power of two."""
    return 1 << max(0, group - 1).bit_length()


def fit_group(tiles: Tiles, group: int) -> Tiles:
    """`tiles` with block_m raised to `min_block_m(group)` where it is below."""
    if tiles.block_m >= min_block_m(group):
        return tiles
    return Tiles(min_block_m(group), tiles.tile, tiles.num_warps, tiles.num_stages)


def _entries(path: Path) -> dict[str, Tiles]:
    key = str(path)
    if key not in _loaded:
        entries = {}
        if path.exists():
            try:
                entries = {k: Tiles(**v) for k, v in json.loads(path.read_text()).items()}
            except (OSError, ValueError, TypeError) as exc:
                logger.warning("attention tiles file %s unreadable (%s): default tiles", path, exc)
        _loaded[key] = entries
    return _loaded[key]


def save_tiles(path: Path, key: str, tiles: Tiles) -> None:
    """Add or replace one entry of the file (the others kept)."""
    entries = {}
    if path.exists():
        entries = json.loads(path.read_text())
    entries[key] = asdict(tiles)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    _loaded.pop(str(path), None)
    tiles_for.cache_clear()
