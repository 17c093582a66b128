"""The KV pool of a tensor-parallel worker (every block's heads split across ranks), or of a
pipeline-parallel one (every block's layers split across stages: ``axis="layers"``, the same way).

Rank r of a worker with N ranks holds KV heads ``[r*h, (r+1)*h)`` (``h = H / N``) of every block in
its own tensor ``[num_blocks, num_layers, 2, block_size, h, head_dim]``; rank 0 (the worker process,
which runs the transfer side) sees the others' tensors through shared memory
(:mod:`engine.parallel.shared_kv`). :class:`ShardedKV` presents those N tensors as one pool of
whole blocks ``[num_blocks, num_layers, 2, block_size, H, head_dim]``.

On the wire a block is always the whole block (all H heads, in head order): what an unsharded pool
holds, and what the layout and its compatibility hash describe. So a prefill worker of TP ``p`` and
a decode worker of TP ``d`` exchange blocks for any ``p`` and ``d``: the sender gathers each head
from the rank that holds it into a staging buffer (:class:`ShardedCopier`), the receiver scatters
each head into the rank that owns it; each head crosses the link once. A sharded pool is no single
byte range, so a side over one offers no raw-memory mode (NIXL READ of the pool, CUDA IPC): its
blocks always go through staging buffers, and no peer ever reads a shard's bytes as a whole block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from .copiers import Batch, StreamCopier
from .layout import KVLayout
from .memory import KVRegion


class ShardedKV:
    """N rank tensors of one pool, seen as whole blocks (``shape``, ``dtype`` and ``device`` as a tensor's,
    so :meth:`KVLayout.of_kv_cache` reads the whole-block layout off it). ``axis`` says what the ranks split:
    ``"heads"`` (tensor parallelism: equal head ranges) or ``"layers"`` (pipeline parallelism: each stage's
    contiguous layer range, in order; the ranges may differ in size)."""

    AXES = {"heads": 4, "layers": 1}

    def __init__(self, shards: Sequence[Any], axis: str = "heads") -> None:
        shards = list(shards)
        if not shards:
            raise ValueError("a sharded KV pool needs at least one shard")
        if axis not in self.AXES:
            raise ValueError(f"axis must be one of {sorted(self.AXES)}, got {axis!r}")
        dim = self.AXES[axis]
        first = shards[0]
        for r, s in enumerate(shards):
            if s.dim() != 6 or s.shape[2] != 2:
                raise ValueError(f"shard {r}: shape {tuple(s.shape)} is not [num_blocks, num_layers, 2, "
                                 "block_size, heads, head_dim]")
            same = [d for i, d in enumerate(s.shape) if i != dim or axis == "heads"]
            if same != [d for i, d in enumerate(first.shape) if i != dim or axis == "heads"] \
                    or s.dtype != first.dtype or s.device.type != first.device.type:
                raise ValueError(f"shard {r} ({tuple(s.shape)}, {s.dtype}, {s.device}) differs from shard 0 "
                                 f"({tuple(first.shape)}, {first.dtype}, {first.device})")
            if not s.is_contiguous():
                raise ValueError(f"shard {r} is not contiguous")
        self.shards = shards
        self.axis = axis
        self._bounds = [0]
        for s in shards:
            self._bounds.append(self._bounds[-1] + int(s.shape[dim]))
        shape = [int(d) for d in first.shape]
        shape[dim] = self._bounds[-1]
        self.shape = tuple(shape)
        self.dtype = first.dtype
        self.device = first.device

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def head_range(self, rank: int) -> tuple[int, int]:
        """The KV heads ``[lo, hi)`` rank ``rank`` holds (``axis`` "heads"); see `index`."""
        return self._bounds[rank], self._bounds[rank + 1]

    def index(self, rank: int) -> tuple:
        """Rank ``rank``'s part of whole blocks ``[count, num_layers, 2, block_size, heads, head_dim]``, as an
        index: its head range (``axis`` "heads") or its layer range (``axis`` "layers")."""
        part = slice(self._bounds[rank], self._bounds[rank + 1])
        return (..., part, slice(None)) if self.axis == "heads" else (slice(None), part)


def region_of(pool: Any, layout: KVLayout) -> KVRegion:
    """The :class:`KVRegion` of any KV pool: a :class:`ShardedKV` or one buffer (see ``KVRegion.from_buffer``)."""
    if not isinstance(pool, ShardedKV):
        return KVRegion.from_buffer(pool, layout)
    # Whole blocks with ``addr`` 0: there is no one byte range.
    if KVLayout.of_kv_cache(pool, layout.model_id, None).mismatched_fields(layout) not in ([], ["kv_scales"]):
        raise ValueError(f"sharded pool {pool.shape} {pool.dtype} does not match layout {layout}")
    nbytes = pool.shape[0] * layout.block_nbytes
    return KVRegion(pool, layout, 0, nbytes, pool.shape[0], pool.device.type, int(pool.device.index or 0),
                    sharded=True)


class ShardedCopier(StreamCopier):
    """Staging copies of a :class:`ShardedKV`: gathers whole blocks from the rank shards into a staging
    buffer (sender) and scatters them back out (receiver), run by run of consecutive blocks. On CUDA the
    copies run on a side stream as :class:`~kv_transfer.copiers.CudaCopier`'s do (written for a GPU; CPU
    is what the tests run)."""

    def __init__(self, region: KVRegion) -> None:
        import torch
        self.torch = torch
        self.pool: ShardedKV = region.owner
        self.block_nbytes = region.block_nbytes
        self.block_shape = self.pool.shape[1:]
        self.pin = self.pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.pool.device) if self.pin else None

    def alloc(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=self.pin)

    def native(self, mapping: Any) -> Any:
        return mapping.tensor()

    def view(self, buf: Any) -> memoryview:
        return memoryview(buf.numpy())

    def start(self) -> None:
        if self.stream is not None:  # after the forward that wrote (or will reuse) these blocks
            self.stream.wait_stream(self.torch.cuda.default_stream(self.pool.device))

    def _blocks(self, buf: Any, offset: int, count: int) -> Any:
        """``count`` whole blocks of ``buf`` from byte ``offset``, typed and shaped."""
        return buf[offset:offset + count * self.block_nbytes].view(self.pool.dtype).view(count, *self.block_shape)

    def _copy(self, buf: Any, batch: Batch, to_host: bool) -> Any:
        torch, pool = self.torch, self.pool
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for block, count, offset in batch.runs:
                host = self._blocks(buf, offset, count)
                # CPU: each shard's heads straight to/from their slice of the staging buffer (one copy);
                # CUDA: through a contiguous device buffer, so one host<->device copy moves the run
                whole = torch.empty_like(host, device=pool.device) if self.pin else host
                if self.pin and not to_host:
                    whole.copy_(host, non_blocking=True)
                for r, shard in enumerate(pool.shards):
                    mine = pool.index(r)
                    part = shard[block:block + count]
                    if to_host:
                        whole[mine].copy_(part, non_blocking=self.pin)
                    else:
                        part.copy_(whole[mine], non_blocking=self.pin)
                if self.pin and to_host:
                    host.copy_(whole, non_blocking=True)
            if self.stream is None:
                return None
            event = torch.cuda.Event()
            event.record(self.stream)
            return event

