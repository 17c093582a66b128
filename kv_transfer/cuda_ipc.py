"""CUDA IPC between two processes on one host: the receiver maps the sender's pool.

NIXL moves VRAM between processes on one GPU through UCX ``cuda_ipc``, which
issues one ``cuMemcpyAsync`` per descriptor (one per block here): ~7 us each,
so a 1,024-block pull runs at ~5% of what the GPU copies in one kernel
(BENCHMARKS.md). The ``cuda_ipc`` data mode does the pull as one kernel: the
sender exports its pool's allocation with ``cuIpcGetMemHandle`` in
``hello_ok``; the receiver opens it once per connection and, for each
transfer, copies the granted blocks from the mapped pool into its own with
:func:`~kv_transfer.block_copy.copy_blocks` on a side stream, then ``done``.

Only offered between processes of one host that see each other's IPC
namespace (:func:`host_identity` equal on both sides: same boot, same pid and
IPC namespaces); in Kubernetes that is one pod, so prefill and decode pods on
one node use NIXL or TCP. Like a NIXL registration, the handle maps the
sender's whole pool into the receiver, which is why it is only handed out on
an accepted ``hello`` (see README, Security).

Driver API through ctypes (``libcuda.so.1`` comes with every NVIDIA driver):
no extra package, and the same calls whatever CUDA runtime torch was built with.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Any

from .memory import KVRegion

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_HANDLE_BYTES = 64


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * _HANDLE_BYTES)]


def host_identity() -> str:
    """Who may map our device memory: boot id plus pid and IPC namespace inodes.
    Two processes with the same identity are on one host and see each other."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("no-boot-id")
    for ns in ("pid", "ipc"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append(f"no-{ns}-ns")
    return ":".join(parts)


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.c_uint64]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        try:
            _libcuda().cuGetErrorName(result, ctypes.byref(name))
        except Exception:
            pass
        raise RuntimeError(f"{what} failed: CUDA error {result} {name.value.decode() if name.value else ''}".strip())


def _bind_device(device_id: int) -> None:
    """Make the device's primary context current in this thread (driver calls need one)."""
    import torch
    torch.cuda.set_device(device_id)
    torch.cuda.current_stream(device_id)


def export_region(region: KVRegion) -> dict[str, Any]:
    """What a receiver needs to map ``region`` (a CUDA pool): hello_ok fields. Raises
    RuntimeError when the memory cannot be shared (e.g. a virtual-memory allocation)."""
    _bind_device(region.device_id)
    lib = _libcuda()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(region.addr)),
           "cuMemGetAddressRange")
    handle = _IpcHandle()
    _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
    return {"ipc_handle": bytes(handle.reserved).hex(), "ipc_offset": region.addr - base.value,
            "ipc_nbytes": region.nbytes, "ipc_host": host_identity()}


class MappedPool:
    """A sender's pool mapped into this process, as ``[num_blocks, block_elems]`` rows."""

    def __init__(self, fields: dict, region: KVRegion) -> None:
        import torch

        from .block_copy import as_block_rows
        raw = bytes.fromhex(str(fields["ipc_handle"]))
        if len(raw) != _HANDLE_BYTES:
            raise ValueError("malformed CUDA IPC handle")
        offset, nbytes = int(fields["ipc_offset"]), int(fields["ipc_nbytes"])
        if offset < 0 or nbytes <= 0 or nbytes % region.block_nbytes:
            raise ValueError("malformed CUDA IPC region")
        self.device_id = region.device_id
        _bind_device(self.device_id)
        handle = _IpcHandle()
        ctypes.memmove(ctypes.addressof(handle), raw, _HANDLE_BYTES)
        base = ctypes.c_uint64()
        _check(_libcuda().cuIpcOpenMemHandle_v2(ctypes.byref(base), handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
               "cuIpcOpenMemHandle")
        self._base = base.value
        ptr = self._base + offset
        array = type("_Mapped", (), {"__cuda_array_interface__": {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}})()
        self.flat = torch.as_tensor(array, device=torch.device("cuda", self.device_id))
        self.rows = as_block_rows(self.flat, region.block_nbytes)
        self.num_blocks = nbytes // region.block_nbytes

    def close(self) -> None:
        """Unmap (the caller waited for every copy out of it)."""
        if self._base:
            self.flat = self.rows = None
            _bind_device(self.device_id)
            _check(_libcuda().cuIpcCloseMemHandle(ctypes.c_uint64(self._base)), "cuIpcCloseMemHandle")
            self._base = 0


class IpcPuller:
    """Receiver side: copies granted blocks out of mapped pools into the local pool."""

    def __init__(self, region: KVRegion) -> None:
        import torch

        from .block_copy import as_block_rows
        self.torch = torch
        self.region = region
        self.rows = as_block_rows(region.owner.reshape(-1).view(torch.uint8), region.block_nbytes)
        self.stream = torch.cuda.Stream(device=region.owner.device)
        self._ids = None  # pinned int32, viewed as [2, width]: remote ids, local ids
        self._lock = threading.Lock()  # links to several senders pull through one stream and buffer

    def pull(self, mapped: MappedPool, remote_ids: list[int], local_ids: list[int]) -> int:
        """Copy the blocks and wait for the copy; returns the bytes moved."""
        import numpy as np
        n = len(local_ids)
        if mapped.rows.dtype != self.rows.dtype:
            raise ValueError("sender and receiver pools differ in alignment")
        ids = np.asarray([remote_ids, local_ids], dtype=np.int64)
        if ids.size and (ids[0].max() >= mapped.num_blocks or ids.min() < 0):
            raise ValueError(f"remote block id out of range [0, {mapped.num_blocks})")
        with self._lock:
            self._copy(mapped, ids, n)
        return n * self.region.block_nbytes

    def _copy(self, mapped: MappedPool, ids, n: int) -> None:
        from .block_copy import copy_blocks
        torch = self.torch
        width = -(-n // 4) * 4  # rows of 16 bytes: Triton compiles once (it specializes on alignment)
        if self._ids is None or self._ids.numel() < 2 * width:
            self._ids = torch.empty(max(2 * width, 512), dtype=torch.int32, pin_memory=True)
        host = self._ids[:2 * width].view(2, width)
        host.numpy()[:, :n] = ids
        with torch.cuda.stream(self.stream):
            # After what the engine queued on the pool (e.g. reads of blocks just reallocated).
            self.stream.wait_stream(torch.cuda.default_stream(self.rows.device))
            dev_ids = host.to(self.rows.device, non_blocking=True)
            copy_blocks(self.rows, mapped.rows, dev_ids[1, :n], dev_ids[0, :n])
        self.stream.synchronize()  # also: the pinned ids may be rewritten by the next pull
