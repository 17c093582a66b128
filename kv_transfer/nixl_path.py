"""The ``nixl`` data path: the receiver READs the sender's registered KV memory via UCX.

:class:`NixlSendPath` and :class:`NixlPullPath` are the native path of a NIXL side (built by the
factory, which with ``backend="auto"`` also runs their loopback self-test).

The receiver's pool is registered once (DRAM for CPU memory, VRAM for CUDA
tensors, with the GPU made current in every thread that calls NIXL; the
self-test then also READs VRAM) and prepared as a descriptor list with one entry
per block. On one host UCX moves VRAM between two processes with ``cuda_ipc``.

What the sender exposes (``KVTransferConfig.nixl_expose``):

- ``"lease"`` (default): nothing at start. At each grant the sender registers
  just the granted blocks (runs of consecutive ids as one range), and the
  ``grant`` carries the partial agent metadata of that registration (its
  remote keys); the registration ends with the transfer (done, abort, expiry,
  lost connection). A peer never holds a key to a block it was not granted,
  nor to a granted block after its lease. We chose this over the alternative
  (prefill WRITEs into blocks the decode side registered) because the pull
  model keeps the decode worker in charge of when its blocks are written and
  needs no second registration on the decode side; the price is a
  registration per grant (about 50 us on CPU, bench/kv_transfer_bench.py).
  How much a key's bounds are enforced is the transport's: RDMA NICs check
  them in hardware and revoke them on deregistration; same-host transports
  (``cma``, CUDA IPC) rest on the OS (ptrace rights, one pod's namespaces).
- ``"pool"``: the whole pool registered once and its descriptor list prepared
  once per sender on the receiver (trusted networks only).

A transfer is then ``make_prepped_xfer("READ", local, local_ids, remote,
remote_ids)``. Metadata travels on our control connection (``hello_ok`` carries
the sender's agent metadata, the grant a lease's), so the KV handle stays a
small JSON dict. The completion
notification to the sender is the control protocol's ``done``, answered by an
``ack`` that tells the receiver whether the sender still held the blocks for
the whole READ (a NIXL notification alone cannot tell the reader that).
A sender seen under a new instance id is a restart: its old remote agent is
removed before the new one is added.
"""

from __future__ import annotations

import select
import socket
import time
from typing import Any

import numpy as np

from .config import KVTransferConfig
from .data_path import Link, ReceiverPath, SenderPath
from .memory import KVRegion
from .nixl_agent import SPIN_S, NixlAgent, ProgressPump, block_descs
from .nixl_lease import LeaseRegistry, SenderKeys
from .transfer import Transfer


def _mem_type(region: KVRegion) -> str:
    return "VRAM" if region.is_cuda else "DRAM"


class NixlSendPath(SenderPath):
    """Registers the KV pool (or each grant's blocks) with NIXL; receivers READ it after a grant."""

    name = "nixl"

    def __init__(self, region: KVRegion, config: KVTransferConfig) -> None:
        self.region = region
        self.config = config
        self.nixl = NixlAgent("send", config)
        try:
            if region.is_cuda:
                self.nixl.use_cuda(region.device_id)
            if config.nixl_expose == "pool":
                self.nixl.register(region.addr, region.nbytes, region.device_id, _mem_type(region))
            self._leases = LeaseRegistry(self.nixl, region, _mem_type(region))
            self._metadata = self.nixl.agent.get_agent_metadata()  # "lease": connection info only
        except Exception:
            self.nixl.close()
            raise
        self._pump = ProgressPump(self.nixl, active=not config.nixl_progress_thread)

    def self_test(self) -> None:
        """See :meth:`NixlAgent.self_test`."""
        self.nixl.self_test()

    def hello_ok(self, hello: dict) -> tuple[dict, bytes]:
        r = self.region
        self._pump.keep_alive_for(2.0)  # the receiver's UCX wire-up needs our progress
        return ({"agent_name": self.nixl.name, "base_addr": r.addr, "mem_type": _mem_type(r),
                 "device_id": r.device_id, "expose": self.config.nixl_expose}, self._metadata)

    def grant_payload(self, t: Transfer, block_ids: list[int]) -> bytes:
        """``"lease"``: register the granted blocks until ``t`` ends; their metadata rides on the grant."""
        if self.config.nixl_expose != "lease" or not block_ids:
            return b""
        metadata = self._leases.acquire(block_ids)
        t.add_finish_hook(lambda _t: self._leases.release(block_ids))
        return metadata

    def serve(self, sock: socket.socket, t: Transfer, block_ids: list[int], hello: dict, read: dict) -> None:
        t.granted_nbytes = len(block_ids) * self.region.block_nbytes
        self._pump.hold()
        t.add_finish_hook(lambda _t: self._pump.release())

    def stats(self) -> dict[str, int]:
        if self.nixl.agent is None:
            return {"registered_regions": 0}
        stats = self.nixl.stats()
        return {**stats, "registered_regions": stats["registered_regions"] + self._leases.num_registered}

    def close(self) -> None:
        self._pump.close()
        self._leases.clear()
        self.nixl.close()


class NixlPullPath(ReceiverPath):
    """READs granted blocks from the sender's registered memory; ``link.path_state`` is
    ``(the sender's agent name, its prepared descriptors or lease keys)``."""

    name = "nixl"

    def __init__(self, region: KVRegion, config: KVTransferConfig) -> None:
        r = self.region = region
        self.config = config
        self.nixl = NixlAgent("recv", config)
        try:
            if r.is_cuda:
                self.nixl.use_cuda(r.device_id)
            self._reg = self.nixl.register(r.addr, r.nbytes, r.device_id, _mem_type(r))
            self._local = self.nixl.prep("NIXL_INIT_AGENT",
                                         block_descs(r.addr, r.block_nbytes, r.num_blocks, r.device_id),
                                         _mem_type(r))
        except Exception:
            self.nixl.close()
            raise
        self._lease_resets = 0
        """Reloads of a sender's metadata because a lease touched blocks we held keys for."""

    def self_test(self) -> None:
        """See :meth:`NixlAgent.self_test`."""
        self.nixl.self_test()

    def connected(self, link: Link, hello: dict, payload: bytes) -> None:
        name = str(hello["agent_name"])
        if link.path_state is not None and link.path_state[0] == name:
            return  # reconnect to the same sender instance: keep its prepared list
        self._drop_remote(link)
        if int(hello["block_nbytes"]) != self.region.block_nbytes:
            raise ConnectionError("sender block size in bytes differs")
        if name in self.nixl.remote_agents:  # stale metadata of a previous life
            self.nixl.remove_remote(name)
        self.nixl.add_remote(payload)
        try:
            # "lease": nothing to prepare until a grant brings the keys of its blocks
            prep = SenderKeys(name, payload) if hello.get("expose") == "lease" else self.nixl.prep(
                name, block_descs(int(hello["base_addr"]), int(hello["block_nbytes"]),
                                  int(hello["num_blocks"]), int(hello["device_id"])), str(hello["mem_type"]))
            link.path_state = (name, prep)
            with self.nixl.lock:
                self.nixl.agent.make_connection(name)
        except Exception:
            self._drop_remote(link)
            self.nixl.remove_remote(name)
            raise

    def _drop_remote(self, link: Link) -> None:
        if link.path_state is None:
            return
        name, prep = link.path_state
        link.path_state = None
        if not isinstance(prep, SenderKeys):
            self.nixl.release_prep(prep)
        self.nixl.remove_remote(name)

    def forget(self, link: Link) -> None:
        if self.nixl.agent is not None:
            self._drop_remote(link)

    def pull(self, link: Link, t: Transfer, grant: dict, payload: bytes) -> int:
        if not t.block_ids:
            return 0
        name, state = link.path_state
        if not isinstance(state, SenderKeys):  # "pool": prepared once per sender
            return self._read(link, t, state, t.remote_block_ids)
        if not payload:
            raise ConnectionError("the grant carries no NIXL metadata")
        self._lease_resets += state.load(self.nixl, t.remote_block_ids, payload)
        h = link.hello
        remote = np.asarray(t.remote_block_ids, dtype=np.uint64)
        descs = block_descs(int(h["base_addr"]), int(h["block_nbytes"]), int(h["num_blocks"]), int(h["device_id"]))
        lease_prep = self.nixl.prep(name, descs[remote], str(h["mem_type"]))
        try:
            return self._read(link, t, lease_prep, list(range(len(remote))))
        finally:
            self.nixl.release_prep(lease_prep)

    def _read(self, link: Link, t: Transfer, remote_prep: Any, remote_ids: list[int]) -> int:
        """READ ``remote_ids`` of ``remote_prep`` into ``t``'s local blocks, watching for stop,
        deadline and a sender that hangs up."""
        handle, st = self.nixl.start_read(self._local, list(t.block_ids), remote_prep, remote_ids)
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
                if now - start > SPIN_S:
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

    def stats(self) -> dict[str, int]:
        stats = self.nixl.stats() if self.nixl.agent is not None else {"registered_regions": 0}
        return {**stats, "nixl_lease_resets": self._lease_resets}

    def close(self) -> None:
        self.nixl.close()


def _peer_closed(sock: socket.socket | None, wait: float) -> bool:
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
