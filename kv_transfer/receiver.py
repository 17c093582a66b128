"""Receiver side of the control protocol, shared by every backend.

``read()`` validates its arguments, creates a :class:`Transfer` and queues it
on the :class:`~kv_transfer.peer_link.PeerLink` to that sender (one per sender
instance, see :mod:`peer_link` for what a link does with it); it never blocks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from .base import KVReceiver
from .config import KVTransferConfig
from .cuda_ipc import IpcPuller, host_identity
from .layout import KVLayout
from .memory import KVRegion
from .peer_link import PeerLink
from .staging import make_staging
from .transfer import Transfer, TransferTable

logger = logging.getLogger("pdserve.kv_transfer")


class ControlReceiver(KVReceiver):
    """Links to senders + the transfer table; subclasses pull the bytes."""

    #: Data paths this receiver can use, preferred first (see ``ControlSender.modes``).
    modes: tuple[str, ...] = ("tcp",)

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig) -> None:
        self.config = config
        self.layout = layout
        self.region = KVRegion.from_buffer(kv_cache, layout)
        #: Host buffers the tcp data path stages device memory through (None: host pool).
        self.staging = make_staging(self.region, config.staging, config.staging_chunk_bytes,
                                    shared=config.staging_shm)
        #: Copies out of same-host senders' mapped CUDA pools (``cuda_ipc`` mode), if possible here.
        #: Client side of the links' TLS (None: plaintext).
        self.tls = config.tls.context(server_side=False) if config.tls is not None else None
        self._ipc = self._make_ipc_puller()
        self._ipc_refused: set[str] = set()
        self._ipc_pulls = 0
        #: Handshakes tried again after the sender cut one or answered busy (see ``PeerLink``).
        self._handshake_retries = 0
        self._table = TransferTable("recv")
        self._links: dict[tuple, PeerLink] = {}
        self._closing: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def _make_ipc_puller(self) -> IpcPuller | None:
        if not (self.region.is_cuda and self.config.cuda_ipc) or self.region.sharded:
            return None
        try:
            return IpcPuller(self.region)
        except Exception as e:  # e.g. a pool torch cannot view as bytes
            logger.info("CUDA IPC pulls unavailable for this pool (%s)", e)
            return None

    # -- hooks for backends ---------------------------------------------------
    def _on_connected(self, link: PeerLink, hello: dict, payload: bytes) -> None:
        """Handshake succeeded: set up backend state for this peer."""

    def _pull(self, link: PeerLink, t: Transfer, grant: dict, payload: bytes) -> int:
        """Non-tcp mode: move the granted blocks into ``t``'s local blocks; returns bytes."""
        raise NotImplementedError

    def _forget_peer(self, link: PeerLink) -> None:
        """Link closed for good: drop backend peer state."""

    def _backend_stats(self) -> dict[str, int]:
        return {}

    def _close_backend(self) -> None:
        """Release backend resources (deregister memory)."""

    # -- public API -------------------------------------------------------------
    def read(self, peer_info: dict[str, Any], transfer_id: str,
             remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
             timeout_s: float | None = None, capability: str = "") -> Transfer:
        if self._closed:
            raise RuntimeError("receiver is closed")
        mode = self._mode_for(peer_info)
        local = self.region.check_ids(local_block_ids, f"read({transfer_id!r}) local")
        remote = [int(b) for b in remote_block_ids]
        if len(remote) != len(local):
            raise ValueError(f"{len(remote)} remote block ids but {len(local)} local ones")
        if len(set(remote)) != len(remote) or any(b < 0 for b in remote):
            raise ValueError("remote block ids must be distinct and >= 0")
        t = Transfer(str(transfer_id), "receiver", local,
                     timeout_s if timeout_s is not None else self.config.default_timeout_s,
                     self.config.abort_wait_s, on_finish=self._table.finished)
        t.remote_block_ids = remote
        t.capability = str(capability)
        self._table.add(t)
        self._link_for(peer_info, mode).submit(t)
        return t

    def stats(self) -> dict[str, int]:
        with self._lock:
            links = list(self._links.values())
        return {
            "in_flight": len(self._table),
            "links": len(links),
            "connections": sum(1 for link in links if link.sock is not None),
            "bytes_moved": self._table.bytes_moved,
            "transfers_done": self._table.num_done,
            "transfers_failed": self._table.num_failed,
            "registered_regions": 0,
            "cuda_ipc_pulls": self._ipc_pulls,
            "handshake_retries": self._handshake_retries,
            "cuda_ipc_mapped": sum(1 for link in links if link.mapped is not None),
            "shm_mapped": sum(len(link.peer_buffers) for link in links),
            **(self.staging.stats() if self.staging is not None else {}),
            **self._backend_stats(),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._table.close("receiver closed")
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()
        for thread in self._closing:
            thread.join(timeout=10)
        if self.staging is not None:
            self.staging.close()
        self._close_backend()

    def _mode_for(self, peer_info: dict[str, Any]) -> str:
        """First of our modes the peer serves (tcp stages device memory on either side)."""
        offered = peer_info.get("modes") or [peer_info.get("backend")]
        if ("cuda_ipc" in offered and self._ipc is not None and peer_info.get("ipc_host") == host_identity()
                and str(peer_info.get("instance_id")) not in self._ipc_refused):
            return "cuda_ipc"
        for mode in self.modes:
            if mode in offered:
                return mode
        raise ValueError(f"no common data path: peer serves {offered}, this receiver {list(self.modes)}")

    def _link_for(self, peer_info: dict[str, Any], mode: str) -> PeerLink:
        key = (str(peer_info["host"]), int(peer_info["port"]))
        stale = None
        with self._lock:
            link = self._links.get(key)
            if link is not None and (link.instance_id != peer_info.get("instance_id")
                                     or link.mode != mode):
                stale, link = link, None  # the sender restarted on the same address
                del self._links[key]
            if link is None:
                link = self._links[key] = PeerLink(self, peer_info, mode)
        if stale is not None:
            logger.info("sender %s:%s restarted; dropping the old link", *key)
            closer = threading.Thread(target=stale.close, daemon=True)
            self._closing.append(closer)
            closer.start()
        return link
