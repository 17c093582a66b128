"""KV layout descriptor and the compatibility hash used in the handshake.

The engine keeps one contiguous tensor ``kv_cache`` of shape
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
("block_major"): one block (all layers, K and V) is one contiguous byte range,
so a transfer is one descriptor per block. The device kind of the pool ("cpu"
or "cuda") is part of the layout, so a CPU pool and a CUDA pool have different
compatibility hashes and refuse each other at the handshake. So are the dtype
(an fp8 pool holds half the bytes of a bf16 one per block) and, for an fp8 pool,
a digest of its per-layer K/V scales: the same fp8 bytes mean different K/V
under different scales.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

#: Wire protocol version; bump on any incompatible change of the messages
#: (2: the layout carries the pool's device kind; 3: HMAC handshake and transfer capabilities;
#: 4: the layout carries the digest of an fp8 pool's K/V scales).
PROTOCOL_VERSION = 4

#: Bytes per element for the dtypes we accept.
DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "uint8": 1}

LAYOUTS = ("block_major",)

#: Device kinds a KV pool may live on.
DEVICES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What both ends must agree on before any byte moves."""

    model_id: str
    """Model identity (name or path + revision); different weights give different KV."""
    dtype: str
    """Element type name, e.g. ``"float32"`` or ``"bfloat16"``."""
    block_size: int
    """Tokens per KV block."""
    num_layers: int
    """Transformer layers."""
    num_kv_heads: int
    """KV heads held by this engine (after any tensor-parallel split)."""
    head_dim: int
    """Dimension of one head."""
    layout: str = "block_major"
    """Memory layout name; only ``"block_major"`` is defined."""
    device: str = "cpu"
    """Device kind of the pool: ``"cpu"`` or ``"cuda"`` (not the device index: two GPUs interoperate)."""
    kv_scales: str = ""
    """Digest of the per-layer (k_scale, v_scale) of a quantized (fp8) pool; empty when K/V are stored as is."""
    first_layer: int = 0
    """The model layer the pool's first layer is: a pipeline stage's pool holds layers
    ``[first_layer, first_layer + num_layers)`` (kv_transfer/layer_split.py), a whole model's starts at 0."""

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must be a non-empty string")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype {self.dtype!r} not one of {sorted(DTYPE_ITEMSIZE)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.first_layer, int) or self.first_layer < 0:
            raise ValueError(f"first_layer must be an int >= 0, got {self.first_layer!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} not one of {LAYOUTS}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} not one of {DEVICES}")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block (all layers, K and V)."""
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads
                * self.head_dim * self.itemsize)

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of a ``kv_cache`` tensor with ``num_blocks`` blocks."""
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @classmethod
    def of_kv_cache(cls, kv_cache: object, model_id: str,
                    kv_scales: Sequence[tuple[float, float]] | None = None) -> KVLayout:
        """Layout of an engine's ``kv_cache`` tensor (or numpy array) of shape
        ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, device kind included;
        ``kv_scales``: the per-layer (k_scale, v_scale) of an fp8 pool."""
        shape = tuple(int(d) for d in kv_cache.shape)
        if len(shape) != 6 or shape[2] != 2:
            raise ValueError(f"kv_cache shape {shape} is not [num_blocks, num_layers, 2, "
                             "block_size, num_kv_heads, head_dim]")
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        device = getattr(getattr(kv_cache, "device", None), "type", "cpu")
        return cls(model_id=model_id, dtype=dtype, block_size=shape[3], num_layers=shape[1],
                   num_kv_heads=shape[4], head_dim=shape[5], device=device, kv_scales=scales_digest(kv_scales))

    def to_dict(self) -> dict:
        """Plain dict (JSON-able)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVLayout:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)

    def compat_hash(self) -> str:
        """Stable hex digest of every field (and the protocol version)."""
        canon = json.dumps({"v": PROTOCOL_VERSION, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(canon.encode()).hexdigest()[:32]

    def mismatched_fields(self, other: KVLayout) -> list[str]:
        """Names of the fields that differ from ``other`` (what a sender may tell a peer)."""
        return [k for k, v in self.to_dict().items() if getattr(other, k) != v]

    def describe_mismatch(self, other: KVLayout) -> str:
        """Human-readable list of the fields that differ from ``other``."""
        diffs = [f"{k}: ours={v!r} peer={getattr(other, k)!r}"
                 for k, v in self.to_dict().items() if getattr(other, k) != v]
        return "; ".join(diffs) or "no field differs (hash algorithm mismatch?)"


def scales_digest(kv_scales: Sequence[tuple[float, float]] | None) -> str:
    """Short stable digest of per-layer (k_scale, v_scale) pairs; "" for none (exact float reprs hashed)."""
    if kv_scales is None:
        return ""
    canon = json.dumps([[float(k), float(v)] for k, v in kv_scales])
    return hashlib.sha256(canon.encode()).hexdigest()[:16]
