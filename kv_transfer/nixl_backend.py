"""NIXL backend: the receiver READs the sender's registered KV memory via UCX.

Both pools are registered once (DRAM for CPU memory, VRAM for CUDA tensors).
Descriptor lists with one entry per block are prepared once: the local pool at
construction, a sender's pool when the receiver first connects to it. A
transfer is then ``make_prepped_xfer("READ", local, local_ids, remote,
remote_ids)`` - no per-request registration.

Metadata travels on our control connection (``hello_ok`` carries the sender's
agent metadata), so the KV handle stays a small JSON dict. The completion
notification to the sender is the control protocol's ``done``, answered by an
``ack`` that tells the receiver whether the sender still held the blocks for
the whole READ (a NIXL notification alone cannot tell the reader that).
A sender seen under a new instance id is a restart: its old remote agent is
removed before the new one is added.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
import uuid
from typing import Any, Optional

import numpy as np

from .config import KVTransferConfig
from .errors import BackendUnavailableError
from .layout import KVLayout
from .memory import KVRegion
from .receiver import ControlReceiver, PeerLink
from .sender import ControlSender
from .transfer import Transfer

logger = logging.getLogger("pdserve.kv_transfer")

#: Poll a running READ back-to-back for this long before backing off to sleeps.
_SPIN_S = 0.5


def _mem_type(region: KVRegion) -> str:
    return "VRAM" if region.is_cuda else "DRAM"


def _block_descs(base: int, block_nbytes: int, num_blocks: int, dev_id: int) -> np.ndarray:
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
        conf = nixl_agent_config(enable_prog_thread=config.nixl_progress_thread,
                                 enable_listen_thread=False, backends=list(config.nixl_backends))
        self.agent = nixl_agent(self.name, conf)
        if not self.agent.backends:
            raise BackendUnavailableError(
                f"no NIXL backend among {config.nixl_backends} could be created "
                f"(plugins: {self.agent.plugin_list})")
        self.lock = threading.Lock()
        self.registered: list[Any] = []
        self.prepped: list[Any] = []
        self.remote_agents: set[str] = set()
        self.live_xfers = 0

    # memory ------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, dev_id: int, mem: str) -> Any:
        with self.lock:
            reg = self.agent.register_memory([(addr, nbytes, dev_id, "")], mem)
            self.registered.append(reg)
            return reg

    def deregister(self, reg: Any) -> None:
        with self.lock:
            self.agent.deregister_memory(reg)
            self.registered.remove(reg)

    def prep(self, agent_name: str, descs: np.ndarray, mem: str) -> Any:
        with self.lock:
            handle = self.agent.prep_xfer_dlist(agent_name, descs, mem)
            self.prepped.append(handle)
            return handle

    def release_prep(self, handle: Any) -> None:
        with self.lock:
            self.agent.release_dlist_handle(handle)
            self.prepped.remove(handle)

    # peers ---------------------------------------------------------------------
    def add_remote(self, metadata: bytes) -> str:
        with self.lock:
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self.remote_agents.add(name)
            return name

    def remove_remote(self, name: str) -> None:
        with self.lock:
            if name in self.remote_agents:
                self.remote_agents.discard(name)
                self.agent.remove_remote_agent(name)

    # transfers -----------------------------------------------------------------
    def start_read(self, local_prep: Any, local_ids: list[int], remote_prep: Any,
                   remote_ids: list[int]) -> tuple[Any, str]:
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
        """Loopback READ of a small buffer inside this agent; raises on any failure."""
        src = np.arange(8192, dtype=np.uint8) % 251
        dst = np.zeros_like(src)
        regs = [self.register(int(a.ctypes.data), a.nbytes, 0, "DRAM") for a in (src, dst)]
        preps = []
        try:
            half = src.nbytes // 2
            preps.append(self.prep("NIXL_INIT_AGENT", _block_descs(int(dst.ctypes.data), half, 2, 0), "DRAM"))
            preps.append(self.prep(self.name, _block_descs(int(src.ctypes.data), half, 2, 0), "DRAM"))
            handle, st = self.start_read(preps[0], [1, 0], preps[1], [1, 0])
            end = time.monotonic() + 5
            while st == "PROC" and time.monotonic() < end:
                st = self.state(handle)
            self.release(handle)
            if st != "DONE":
                raise RuntimeError(f"loopback transfer ended in state {st}")
            if not np.array_equal(src, dst):
                raise RuntimeError("loopback transfer delivered wrong bytes")
        finally:
            for p in preps:
                self.release_prep(p)
            for r in regs:
                self.deregister(r)

    def stats(self) -> dict[str, int]:
        return {"registered_regions": len(self.registered), "prepped_dlists": len(self.prepped),
                "remote_agents": len(self.remote_agents), "nixl_xfers": self.live_xfers}

    def close(self) -> None:
        for name in list(self.remote_agents):
            self.remove_remote(name)
        for handle in list(self.prepped):
            self.release_prep(handle)
        for reg in list(self.registered):
            self.deregister(reg)
        self.agent = None


class NixlSender(ControlSender):
    """Registers the KV pool with NIXL; receivers READ it after a grant."""

    backend_name = "nixl"
    modes = ("nixl", "tcp")

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig) -> None:
        region = KVRegion.from_buffer(kv_cache, layout)  # validate before the costly agent
        self.nixl = NixlAgent("send", config)
        try:
            self._reg = self.nixl.register(region.addr, region.nbytes, region.device_id,
                                           _mem_type(region))
            self._metadata = self.nixl.agent.get_agent_metadata()
        except Exception:
            self.nixl.close()
            raise
        self._pump = _ProgressPump(self.nixl, active=not config.nixl_progress_thread)
        super().__init__(kv_cache, layout, config)

    def self_test(self) -> None:
        """See :meth:`NixlAgent.self_test`."""
        self.nixl.self_test()

    def _hello_extra(self, mode: str) -> tuple[dict, bytes]:
        if mode != "nixl":
            return {}, b""
        r = self.region
        self._pump.keep_alive_for(2.0)  # the receiver's UCX wire-up needs our progress
        return ({"agent_name": self.nixl.name, "base_addr": r.addr, "mem_type": _mem_type(r),
                 "device_id": r.device_id}, self._metadata)

    def _serve_grant(self, sock: socket.socket, t: Transfer, block_ids: list[int]) -> None:
        t.granted_nbytes = len(block_ids) * self.region.block_nbytes
        self._pump.hold()
        t.add_finish_hook(lambda _t: self._pump.release())

    def _backend_stats(self) -> dict[str, int]:
        return self.nixl.stats() if self.nixl.agent is not None else {"registered_regions": 0}

    def _close_backend(self) -> None:
        self._pump.close()
        self.nixl.close()


class _ProgressPump:
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
        with self._cond:
            if self._holds <= 0:
                self._busy_since = time.monotonic()
            self._holds += 1
            self._cond.notify()

    def release(self) -> None:
        with self._cond:
            self._holds -= 1

    def keep_alive_for(self, seconds: float) -> None:
        with self._cond:
            self._until = max(self._until, time.monotonic() + seconds)
            self._cond.notify()

    def close(self) -> None:
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
                spin = self._holds > 0 and time.monotonic() - self._busy_since < _SPIN_S
            with self._nixl.lock:
                self._nixl.agent.get_new_notifs()
            time.sleep(0 if spin else 0.00005)


class NixlReceiver(ControlReceiver):
    """READs granted blocks from the sender's registered pool."""

    backend_name = "nixl"
    modes = ("nixl", "tcp")

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig) -> None:
        super().__init__(kv_cache, layout, config)
        r = self.region
        self.nixl = NixlAgent("recv", config)
        try:
            self._reg = self.nixl.register(r.addr, r.nbytes, r.device_id, _mem_type(r))
            self._local = self.nixl.prep("NIXL_INIT_AGENT",
                                         _block_descs(r.addr, r.block_nbytes, r.num_blocks, r.device_id),
                                         _mem_type(r))
        except Exception:
            self.nixl.close()
            raise

    def self_test(self) -> None:
        """See :meth:`NixlAgent.self_test`."""
        self.nixl.self_test()

    def _on_connected(self, link: PeerLink, hello: dict, payload: bytes) -> None:
        name = str(hello["agent_name"])
        if link.backend_state is not None and link.backend_state[0] == name:
            return  # reconnect to the same sender instance: keep its prepared list
        self._drop_remote(link)
        if int(hello["block_nbytes"]) != self.region.block_nbytes:
            raise ConnectionError("sender block size in bytes differs")
        if name in self.nixl.remote_agents:  # stale metadata of a previous life
            self.nixl.remove_remote(name)
        self.nixl.add_remote(payload)
        try:
            prep = self.nixl.prep(name, _block_descs(int(hello["base_addr"]), int(hello["block_nbytes"]),
                                                     int(hello["num_blocks"]), int(hello["device_id"])),
                                  str(hello["mem_type"]))
            link.backend_state = (name, prep)
            with self.nixl.lock:
                self.nixl.agent.make_connection(name)
        except Exception:
            self._drop_remote(link)
            self.nixl.remove_remote(name)
            raise

    def _drop_remote(self, link: PeerLink) -> None:
        if link.backend_state is None:
            return
        name, prep = link.backend_state
        link.backend_state = None
        self.nixl.release_prep(prep)
        self.nixl.remove_remote(name)

    def _forget_peer(self, link: PeerLink) -> None:
        if self.nixl.agent is not None:
            self._drop_remote(link)

    def _pull(self, link: PeerLink, t: Transfer, grant: dict) -> int:
        if not t.block_ids:
            return 0
        _, remote_prep = link.backend_state
        handle, st = self.nixl.start_read(self._local, list(t.block_ids), remote_prep,
                                          t.remote_block_ids)
        settled = False
        try:
            # Without a progress thread the copy itself (UCX cma: process_vm_readv) runs
            # inside check_xfer_state, so poll back-to-back for a while; back off to
            # sleeps only when the READ takes long (a stalled or dying peer).
            start = last_check = time.monotonic()
            wait = 0.0
            while st == "PROC":
                if t.stop_requested:
                    raise InterruptedError(t.error or "stopped")
                now = time.monotonic()
                if now >= t.deadline:
                    raise TimeoutError("deadline exceeded")
                if now - start > _SPIN_S:
                    wait = min(0.001, wait * 2 or 0.00005)
                if wait or now - last_check > 0.002:
                    last_check = now
                    if _peer_closed(link.sock, wait):
                        raise ConnectionError("sender closed the connection during the READ")
                st = self.nixl.state(handle)
            if st != "DONE":
                raise ConnectionError(f"NIXL transfer ended in state {st}")
            settled = True
        finally:
            if not self.nixl.release(handle, grace_s=0.0 if settled else self.config.abort_wait_s):
                raise ConnectionError("NIXL transfer could not be released")
        return len(t.block_ids) * self.region.block_nbytes

    def _backend_stats(self) -> dict[str, int]:
        return self.nixl.stats() if self.nixl.agent is not None else {"registered_regions": 0}

    def _close_backend(self) -> None:
        self.nixl.close()


def _peer_closed(sock: Optional[socket.socket], wait: float) -> bool:
    """Sleep up to ``wait`` on the control socket; True if the peer hung up."""
    if sock is None:
        return True
    readable, _, _ = select.select([sock], [], [], wait)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
