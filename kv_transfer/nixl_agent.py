"""A NIXL agent with the bookkeeping kv_transfer needs, and its progress pump.

:class:`NixlAgent` wraps one ``nixl_agent`` (UCX backend, no NIXL progress
thread): registration, prepared descriptor lists, remote agents and transfer
handles all go through it under one lock and are counted, so ``stats()`` can
prove that nothing is left registered, prepared or in flight.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

import numpy as np

from .config import KVTransferConfig
from .errors import BackendUnavailableError
from .nixl_devices import ucx_devices_for

logger = logging.getLogger("pdserve.kv_transfer")

#: Poll back-to-back for this long before backing off to sleeps (see the pump and the READ loop).
SPIN_S = 0.5

_thread_device = threading.local()

def block_descs(base: int, block_nbytes: int, num_blocks: int, dev_id: int) -> np.ndarray:
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_nbytes)
    descs[:, 1] = block_nbytes
    descs[:, 2] = dev_id
    return descs


class NixlAgent:
    """One NIXL agent plus the bookkeeping needed to prove nothing leaks."""

    def __init__(self, role: str, config: KVTransferConfig) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except Exception as e:  # ImportError, or a broken native library
            raise BackendUnavailableError(f"nixl does not import: {e!r}") from e
        self.name = f"pdserve-kv-{role}-{uuid.uuid4().hex[:12]}"
        # UCX turns off cuda_ipc READs (get_zcopy) when it sees no NVLink, so a pull of VRAM between
        # two processes on one GPU (or PCIe peers) went host-staged over tcp/lo at 0.5 GB/s; with
        # them on, 53 GB/s at 1,024 blocks on an H100 (BENCHMARKS.md). An operator's value wins.
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        conf = nixl_agent_config(enable_prog_thread=config.nixl_progress_thread,
                                 enable_listen_thread=False, backends=list(config.nixl_backends))
        with ucx_devices_for(config.host):  # UCX listens only where the KV side was bound (nixl_devices)
            self.agent = nixl_agent(self.name, conf)
        if not self.agent.backends:
            raise BackendUnavailableError(
                f"no NIXL backend among {config.nixl_backends} could be created "
                f"(plugins: {self.agent.plugin_list})")
        self.lock = threading.Lock()
        self.cuda_device: int | None = None
        self.registered: list[Any] = []
        self.prepped: list[Any] = []
        self.remote_agents: set[str] = set()
        self.live_xfers = 0

    # CUDA --------------------------------------------------------------------
    def use_cuda(self, device_id: int) -> None:
        """The KV pool is on GPU ``device_id``: every thread calling NIXL makes that device
        (its primary CUDA context) current first, as UCX's CUDA transports expect."""
        self.cuda_device = device_id
        self._bind()

    def _bind(self) -> None:
        if self.cuda_device is not None and getattr(_thread_device, "id", None) != self.cuda_device:
            import torch
            torch.cuda.set_device(self.cuda_device)
            _thread_device.id = self.cuda_device

    # memory ------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, dev_id: int, mem: str) -> Any:
        """Register one memory region (``DRAM`` or ``VRAM``)."""
        self._bind()
        with self.lock:
            reg = self.agent.register_memory([(addr, nbytes, dev_id, "")], mem)
            self.registered.append(reg)
            return reg

    def deregister(self, reg: Any) -> None:
        """Deregister a region returned by :meth:`register`."""
        with self.lock:
            self.agent.deregister_memory(reg)
            self.registered.remove(reg)

    def prep(self, agent_name: str, descs: np.ndarray, mem: str) -> Any:
        """Prepare a descriptor list (local: ``NIXL_INIT_AGENT``; remote: its agent name)."""
        with self.lock:
            handle = self.agent.prep_xfer_dlist(agent_name, descs, mem)
            self.prepped.append(handle)
            return handle

    def release_prep(self, handle: Any) -> None:
        """Release a prepared descriptor list."""
        with self.lock:
            self.agent.release_dlist_handle(handle)
            self.prepped.remove(handle)

    # peers ---------------------------------------------------------------------
    def add_remote(self, metadata: bytes) -> str:
        """Load a remote agent's metadata; returns its name."""
        self._bind()
        with self.lock:
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self.remote_agents.add(name)
            return name

    def remove_remote(self, name: str) -> None:
        """Forget a remote agent (its connection and metadata)."""
        with self.lock:
            if name in self.remote_agents:
                self.remote_agents.discard(name)
                self.agent.remove_remote_agent(name)

    # transfers -----------------------------------------------------------------
    def start_read(self, local_prep: Any, local_ids: list[int], remote_prep: Any,
                   remote_ids: list[int]) -> tuple[Any, str]:
        """Post a READ of remote blocks into local blocks; returns (handle, first state)."""
        self._bind()
        with self.lock:
            handle = self.agent.make_prepped_xfer(
                "READ", local_prep, np.asarray(local_ids, dtype=np.int32),
                remote_prep, np.asarray(remote_ids, dtype=np.int32))
            self.live_xfers += 1
            try:
                return handle, self.agent.transfer(handle)
            except Exception as e:
                try:
                    self._release_locked(handle)
                except Exception:
                    logger.exception("releasing a failed NIXL transfer")
                raise ConnectionError(f"NIXL could not post the READ: {e!r}") from e

    def state(self, handle: Any) -> str:
        """``PROC``, ``DONE`` or an error string (also drives progress)."""
        self._bind()
        with self.lock:
            try:
                return self.agent.check_xfer_state(handle)
            except Exception as e:  # nixl raises e.g. nixlRemoteDisconnectError
                return f"ERR ({e!r})"

    def release(self, handle: Any, grace_s: float = 1.0) -> bool:
        """Release a transfer handle, waiting (bounded) for an aborted one to settle."""
        end = time.monotonic() + grace_s
        while True:
            with self.lock:
                try:
                    self._release_locked(handle)
                    return True
                except Exception as e:
                    err = e
            if time.monotonic() >= end:
                logger.error("NIXL transfer handle could not be released: %r", err)
                return False
            time.sleep(0.005)

    def _release_locked(self, handle: Any) -> None:
        self.agent.release_xfer_handle(handle)
        self.live_xfers -= 1

    def self_test(self) -> None:
        """Loopback READs of a small buffer inside this agent, DRAM and (when the pool is
        on a GPU, see :meth:`use_cuda`) VRAM; raises on any failure."""
        src = np.arange(8192, dtype=np.uint8) % 251
        dst = np.zeros_like(src)
        self._loopback(int(src.ctypes.data), int(dst.ctypes.data), src.nbytes, 0, "DRAM")
        if not np.array_equal(src, dst):
            raise RuntimeError("loopback DRAM transfer delivered wrong bytes")
        if self.cuda_device is not None:
            import torch
            dev = torch.device("cuda", self.cuda_device)
            src_t = (torch.arange(8192, device=dev) % 251).to(torch.uint8)
            dst_t = torch.zeros_like(src_t)
            torch.cuda.synchronize(dev)
            self._loopback(src_t.data_ptr(), dst_t.data_ptr(), 8192, self.cuda_device, "VRAM")
            if not torch.equal(src_t, dst_t):
                raise RuntimeError("loopback VRAM transfer delivered wrong bytes")

    def _loopback(self, src: int, dst: int, nbytes: int, dev_id: int, mem: str) -> None:
        """READ ``src`` into ``dst`` (two halves, swapped order) through this agent itself."""
        regs = [self.register(addr, nbytes, dev_id, mem) for addr in (src, dst)]
        preps = []
        try:
            half = nbytes // 2
            preps.append(self.prep("NIXL_INIT_AGENT", block_descs(dst, half, 2, dev_id), mem))
            preps.append(self.prep(self.name, block_descs(src, half, 2, dev_id), mem))
            handle, st = self.start_read(preps[0], [1, 0], preps[1], [1, 0])
            end = time.monotonic() + 5
            while st == "PROC" and time.monotonic() < end:
                st = self.state(handle)
            self.release(handle)
            if st != "DONE":
                raise RuntimeError(f"loopback {mem} transfer ended in state {st}")
        finally:
            for p in preps:
                self.release_prep(p)
            for r in regs:
                self.deregister(r)

    def progress(self) -> None:
        """Drive UCX progress (and collect notifications) once."""
        self._bind()
        with self.lock:
            self.agent.get_new_notifs()

    def stats(self) -> dict[str, int]:
        """Live counts of everything this agent holds."""
        return {"registered_regions": len(self.registered), "prepped_dlists": len(self.prepped),
                "remote_agents": len(self.remote_agents), "nixl_xfers": self.live_xfers}

    def close(self) -> None:
        """Drop remote agents, prepared lists and registrations."""
        for name in list(self.remote_agents):
            self.remove_remote(name)
        for handle in list(self.prepped):
            self.release_prep(handle)
        for reg in list(self.registered):
            self.deregister(reg)
        self.agent = None


class ProgressPump:
    """Drives the sender agent's UCX progress only while a peer may need it.

    NIXL's own progress thread polls without pause (a whole core here), and a
    passive agent that never calls NIXL leaves UCX wire-up stalled, and READs
    too: UCX here serves an RMA get through active messages on the target
    (``rma_am(tcp/lo)``, data by ``cma``). So: poll (``get_new_notifs``)
    back-to-back for the first 0.5 s of outstanding grants, then every ~50 us
    while any grant is outstanding or a handshake happened recently; sleep
    otherwise.
    """

    def __init__(self, nixl: NixlAgent, active: bool = True) -> None:
        self._nixl = nixl
        self._holds = 0
        self._busy_since = 0.0
        self._until = 0.0
        self._cond = threading.Condition()
        self._closed = not active
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-nixl-pump")
        if active:
            self._thread.start()

    def hold(self) -> None:
        """A grant is outstanding: keep progressing until :meth:`release`."""
        with self._cond:
            if self._holds <= 0:
                self._busy_since = time.monotonic()
            self._holds += 1
            self._cond.notify()

    def release(self) -> None:
        """The grant ended (done, abort, expiry or connection loss)."""
        with self._cond:
            self._holds -= 1

    def keep_alive_for(self, seconds: float) -> None:
        """Progress for at least ``seconds`` from now (a peer is wiring up)."""
        with self._cond:
            self._until = max(self._until, time.monotonic() + seconds)
            self._cond.notify()

    def close(self) -> None:
        """Stop the pump thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._holds <= 0 and time.monotonic() >= self._until:
                    self._cond.wait(max(0.0, self._until - time.monotonic()) or None)
                if self._closed:
                    return
                spin = self._holds > 0 and time.monotonic() - self._busy_since < SPIN_S
            self._nixl.progress()
            time.sleep(0 if spin else 0.00005)
