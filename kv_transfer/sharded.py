"""The KV pool of a tensor-parallel worker (every block's heads split across ranks), of a
pipeline-parallel one (every block's layers split across stages), or both (``stages`` rows of ranks).

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
    so :meth:`KVLayout.of_kv_cache` reads the whole-block layout off it). With ``stages`` > 1 (pipeline
    parallelism) the shards are ``stages`` rows, in order, of N / stages tensor-parallel ranks each: stage s
    holds a contiguous layer range (the ranges may differ in size), each of its ranks an equal head range.
    ``layers`` = ``(lo, hi)``: only those layers of every block (the pool reads as blocks of ``hi - lo`` layers),
    what a receiver pulling one pipeline stage's layer range writes into (kv_transfer/layer_split.py)."""

    def __init__(self, shards: Sequence[Any], stages: int = 1, layers: tuple[int, int] | None = None) -> None:
        shards = list(shards)
        if not shards:
            raise ValueError("a sharded KV pool needs at least one shard")
        if stages < 1 or len(shards) % stages:
            raise ValueError(f"{len(shards)} shards do not make {stages} pipeline stages of equal rank counts")
        first = shards[0]
        for r, s in enumerate(shards):
            if s.dim() != 6 or s.shape[2] != 2:
                raise ValueError(f"shard {r}: shape {tuple(s.shape)} is not [num_blocks, num_layers, 2, "
                                 "block_size, heads, head_dim]")
            row = shards[r - r % (len(shards) // stages)]  # its stage's first rank: the same layers
            if (s.shape[0], *s.shape[2:]) != (first.shape[0], *first.shape[2:]) or s.shape[1] != row.shape[1] \
                    or s.dtype != first.dtype or s.device.type != first.device.type:
                raise ValueError(f"shard {r} ({tuple(s.shape)}, {s.dtype}, {s.device}) differs from shard 0 "
                                 f"({tuple(first.shape)}, {first.dtype}, {first.device})")
            if not s.is_contiguous():
                raise ValueError(f"shard {r} is not contiguous")
        self.shards = shards
        self.stages = stages
        self.ranks_per_stage = len(shards) // stages
        self.heads_per_shard = int(first.shape[4])
        self._layer_bounds = [0]
        for stage in range(stages):
            self._layer_bounds.append(self._layer_bounds[-1] + int(shards[stage * self.ranks_per_stage].shape[1]))
        lo, hi = layers if layers is not None else (0, self._layer_bounds[-1])
        if not 0 <= lo < hi <= self._layer_bounds[-1]:
            raise ValueError(f"layers [{lo}, {hi}) are not within the pool's {self._layer_bounds[-1]} layers")
        self.window = (lo, hi)
        nb, _, _, block_size, h, head_dim = (int(d) for d in first.shape)
        self.shape = (nb, hi - lo, 2, block_size, h * self.ranks_per_stage, head_dim)
        self.dtype = first.dtype
        self.device = first.device

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def kind(self) -> str:
        """What splits the pool, in words."""
        tp = "tensor-parallel" if self.ranks_per_stage > 1 else ""
        return " and ".join(x for x in (tp, "pipeline-parallel" if self.stages > 1 else "") if x)

    def head_range(self, rank: int) -> tuple[int, int]:
        """The KV heads ``[lo, hi)`` rank ``rank`` holds."""
        t = rank % self.ranks_per_stage
        return t * self.heads_per_shard, (t + 1) * self.heads_per_shard

    def layer_range(self, rank: int) -> tuple[int, int]:
        """The layers ``[lo, hi)`` rank ``rank``'s stage holds."""
        s = rank // self.ranks_per_stage
        return self._layer_bounds[s], self._layer_bounds[s + 1]

    def index(self, rank: int) -> tuple[tuple, slice] | None:
        """Rank ``rank``'s part of the pool's blocks: (its index into blocks ``[count, num_layers, 2, block_size,
        heads, head_dim]`` as this pool reads them, the layers of its shard it covers); None when the shard
        holds none of the pool's layers."""
        (a, b), (lo, hi) = self.layer_range(rank), self.window
        x, y = max(a, lo), min(b, hi)
        if x >= y:
            return None
        heads = slice(*self.head_range(rank))
        return (slice(None), slice(x - lo, y - lo), slice(None), slice(None), heads), slice(x - a, y - a)


def region_of(pool: Any, layout: KVLayout) -> KVRegion:
    """The :class:`KVRegion` of any KV pool: a :class:`ShardedKV` or one buffer (see ``KVRegion.from_buffer``)."""
    if not isinstance(pool, ShardedKV):
        return KVRegion.from_buffer(pool, layout)
    # Whole blocks with ``addr`` 0: there is no one byte range.
    if set(KVLayout.of_kv_cache(pool, layout.model_id, None).mismatched_fields(layout)) - {"kv_scales", "first_layer"}:
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
                    if (index := pool.index(r)) is None:
                        continue
                    mine, layers = index
                    part = shard[block:block + count, layers]
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

