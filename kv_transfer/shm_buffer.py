"""Staging buffers shared between two processes of one host.

A sender's staging buffer is an anonymous ``memfd`` mapping. A receiver on the
same host (same boot and pid namespace: :func:`~kv_transfer.cuda_ipc.host_identity`)
opens it through ``/proc/<sender pid>/fd/<fd>`` and maps the same pages, so a
batch of blocks crosses from one process to the other with no socket copy:
the sender copies blocks into the buffer, says so in a small frame, the
receiver copies them out and acknowledges (see :mod:`tcp_path`).

On CUDA hosts both mappings are page-locked with ``cudaHostRegister`` so the
device<->host copies run at pinned speed and asynchronously. Nothing is named
in ``/dev/shm``: the pages live as long as some process holds the fd or a
mapping, so a killed process leaks nothing.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np


def _pin(addr: int, nbytes: int) -> None:
    import torch
    err = torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")


def _unpin(addr: int) -> None:
    import torch
    torch.cuda.cudart().cudaHostUnregister(addr)


class _Mapping:
    """An mmap of a memfd with a numpy view, optionally page-locked for CUDA."""

    def __init__(self, fd: int, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.addr = int(self.array.ctypes.data)
        self.pinned = False
        if pin:
            _pin(self.addr, nbytes)
            self.pinned = True

    def tensor(self) -> Any:
        """A CPU torch tensor over the mapping (pinned if registered)."""
        import torch
        return torch.from_numpy(self.array)

    def close(self) -> None:
        if self.pinned:
            _unpin(self.addr)
            self.pinned = False
        self.array = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: the GC unmaps it later
            pass


class SharedBuffer(_Mapping):
    """A sender's staging buffer: a fresh memfd of ``nbytes``, mapped here."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.fd = os.memfd_create("pdserve-kv-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self.inode = os.fstat(self.fd).st_ino
            super().__init__(self.fd, nbytes, pin)
        except BaseException:
            os.close(self.fd)
            raise

    def describe(self) -> dict[str, int]:
        """What a receiver needs to map this buffer."""
        return {"pid": os.getpid(), "fd": self.fd, "inode": self.inode, "nbytes": self.nbytes}

    def close(self) -> None:
        super().close()
        os.close(self.fd)


class PeerBuffer(_Mapping):
    """A sender's :class:`SharedBuffer` mapped into the receiver."""

    def __init__(self, desc: dict, pin: bool) -> None:
        pid, fd, nbytes = int(desc["pid"]), int(desc["fd"]), int(desc["nbytes"])
        if pid <= 0 or fd < 0 or nbytes <= 0:
            raise ValueError(f"malformed shared buffer description {desc}")
        local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            st = os.fstat(local)
            if st.st_ino != int(desc["inode"]) or st.st_size < nbytes:
                raise ValueError("the sender's staging buffer changed under its descriptor")
            self.key = (pid, fd, st.st_ino)
            super().__init__(local, nbytes, pin)
        finally:
            os.close(local)  # the mapping keeps the pages


def can_map_from(pid: int) -> bool:
    """Whether this process may open another's fds (same pid namespace, same user or ptrace rights)."""
    try:
        os.listdir(f"/proc/{int(pid)}/fd")
        return True
    except (OSError, ValueError):
        return False


#: Shared staging buffers of one sender kept mapped (its stagers in use at once, two buffers each).
MAX_PEER_BUFFERS = 32


class SenderBuffers:
    """A receiver's view of one same-host sender's shared staging buffers: whether the sender shares them
    on the current connection (``shared``), and those mapped here, cached per buffer across reconnects."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.shared = False
        self._buffers: dict[tuple, PeerBuffer] = {}

    def __len__(self) -> int:
        return len(self._buffers)

    def map(self, desc: dict) -> PeerBuffer:
        """The sender's buffer ``desc`` mapped here (the cached mapping while that fd holds the same buffer)."""
        key = (int(desc["pid"]), int(desc["fd"]))
        buf = self._buffers.get(key)
        if buf is not None and buf.key[2] == int(desc["inode"]) and buf.nbytes == int(desc["nbytes"]):
            return buf
        if buf is not None:  # that fd now holds another buffer
            self._buffers.pop(key).close()
        if len(self._buffers) >= MAX_PEER_BUFFERS:
            self._buffers.pop(next(iter(self._buffers))).close()
        buf = self._buffers[key] = PeerBuffer(desc, pin=self.pin)
        return buf

    def close(self) -> None:
        """Unmap every buffer."""
        buffers, self._buffers = list(self._buffers.values()), {}
        for buf in buffers:
            buf.close()
