"""A tensor-parallel rank's KV cache, visible to rank 0.

Rank 0 of a prefill or decode worker runs the KV transfer for the whole worker, so it must read and
write every rank's share of each block (kv_transfer/sharded.py). Ranks 1..N-1 therefore keep their
KV cache where rank 0 can map it:

- CPU: an anonymous memfd (kv_transfer/shm_buffer.py), which rank 0 maps through
  ``/proc/<pid>/fd/<fd>``; nothing is named in /dev/shm, so a killed rank leaks nothing, and rank 0's
  mapping stays valid after a rank dies.
- CUDA: the tensor's CUDA IPC handle (torch.multiprocessing's own reduction), opened in rank 0 as a
  tensor on the rank's GPU. Written for a GPU machine; never run here (no GPU).

`allocate` is what a rank calls for its cache, `export` the picklable handle it sends to rank 0 with
its "ready", `open_handle` what rank 0 does with it.
"""
from __future__ import annotations

import torch

from kv_transfer.shm_buffer import PeerBuffer, SharedBuffer


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, object]:
    """A zeroed KV cache rank 0 can map: ``(tensor, what keeps its memory alive)``."""
    if device.type == "cuda":
        return torch.zeros(shape, dtype=dtype, device=device), None
    nbytes = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        nbytes *= d
    buf = SharedBuffer(nbytes, pin=False)  # a fresh memfd reads as zeros
    return torch.from_numpy(buf.array).view(dtype).view(shape), buf


def export(kv_cache: torch.Tensor, keepalive: object) -> tuple:
    """The picklable handle of a cache from :func:`allocate`."""
    if kv_cache.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor
        return ("cuda_ipc", reduce_tensor(kv_cache))
    return ("memfd", keepalive.describe(), str(kv_cache.dtype).removeprefix("torch."), tuple(kv_cache.shape))


def open_handle(handle: tuple) -> tuple[torch.Tensor, object]:
    """Rank 0's view of another rank's cache: ``(tensor, what keeps the mapping alive)``."""
    if handle[0] == "cuda_ipc":
        rebuild, args = handle[1]
        return rebuild(*args), None
    if handle[0] != "memfd":
        raise ValueError(f"unknown KV cache handle kind {handle[0]!r}")
    _, desc, dtype, shape = handle
    mapping = PeerBuffer(desc, pin=False)
    return torch.from_numpy(mapping.array).view(getattr(torch, dtype)).view(shape), mapping
