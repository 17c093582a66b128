"""Receiver side of the control protocol, shared by every backend; the data paths move the bytes.

``read()`` validates its arguments, picks the data path for the sender (:func:`data_path.choose`: the
first of ours it offers and that can reach it), creates a :class:`Transfer` and queues it on the
:class:`~kv_transfer.peer_link.PeerLink` to that sender (one per sender instance, see
:mod:`peer_link` for what a link does with it); it never blocks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from .base import KVReceiver
from .config import KVTransferConfig
from .control_side import ControlSide
from .data_path import ReceiverPath, choose
from .ipc_path import IpcPullPath
from .layout import KVLayout
from .peer_link import PeerLink
from .tcp_path import TcpPullPath
from .transfer import Transfer, TransferTable

logger = logging.getLogger("pdserve.kv_transfer")


class ControlReceiver(ControlSide, KVReceiver):
    """Links to senders + the transfer table; the data paths pull the bytes."""

    role = "receiver"
    paths: list[ReceiverPath]

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig,
                 native: ReceiverPath | None = None) -> None:
        super().__init__(kv_cache, layout, config, native)
        #: ``(path name, sender instance id)`` of paths that failed with that sender: not tried again.
        self._refused: set[tuple[str, str]] = set()
        #: Handshakes tried again after the sender cut one or answered busy (see ``PeerLink``).
        self._handshake_retries = 0
        self._table = TransferTable("recv")
        self._links: dict[tuple, PeerLink] = {}
        self._closing: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _make_paths(self, native: ReceiverPath | None) -> list[ReceiverPath]:
        # CUDA IPC (used only with a sender of this host, if this pool can copy that way), native, TCP.
        tcp = TcpPullPath(self.region, self.config)
        return [IpcPullPath(self.region, self.config), *([native] if native is not None else []), tcp]

    # -- what links call ----------------------------------------------------------
    def choose_path(self, peer_info: dict[str, Any]) -> ReceiverPath:
        """The data path to use with the sender of ``peer_info`` (ValueError: none in common)."""
        instance = str(peer_info.get("instance_id"))
        with self._lock:
            refused = [name for name, i in self._refused if i == instance]
        return choose(self.paths, peer_info, refused)

    def fall_back(self, peer_info: dict[str, Any], failed: ReceiverPath) -> ReceiverPath:
        """``failed`` did not work with this sender instance: never use it with it again; the next path."""
        with self._lock:
            self._refused.add((failed.name, str(peer_info.get("instance_id"))))
        return self.choose_path(peer_info)

    def count_handshake_retry(self) -> None:
        """A link tries a handshake again (counted in ``stats()["handshake_retries"]``)."""
        self._handshake_retries += 1

    # -- public API -------------------------------------------------------------
    def read(self, peer_info: dict[str, Any], transfer_id: str,
             remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
             timeout_s: float | None = None, capability: str = "") -> Transfer:
        if self._closed:
            raise RuntimeError("receiver is closed")
        path = self.choose_path(peer_info)
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
        self._link_for(peer_info, path).submit(t)
        return t

    def stats(self) -> dict[str, int]:
        with self._lock:
            links = list(self._links.values())
        stats = self._stats(links=len(links), connections=sum(1 for link in links if link.sock is not None),
                            handshake_retries=self._handshake_retries)
        for path in self.paths:
            stats.update(path.link_stats([link.path_state for link in links if link.path is path]))
        return stats

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
        self._close_paths()

    def _link_for(self, peer_info: dict[str, Any], path: ReceiverPath) -> PeerLink:
        key = (str(peer_info["host"]), int(peer_info["port"]))
        stale = None
        with self._lock:
            link = self._links.get(key)
            if link is not None and (link.instance_id != peer_info.get("instance_id")
                                     or link.path is not path):
                stale, link = link, None  # the sender restarted on the same address
                del self._links[key]
            if link is None:
                link = self._links[key] = PeerLink(self, peer_info, path)
        if stale is not None:
            logger.info("sender %s:%s restarted; dropping the old link", *key)
            closer = threading.Thread(target=stale.close, daemon=True)
            self._closing.append(closer)
            closer.start()
        return link
