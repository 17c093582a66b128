"""The ``cuda_ipc`` data path: a receiver on the sender's host copies out of the sender's mapped pool.

The sender offers it when it can export its CUDA pool (:func:`~kv_transfer.cuda_ipc.export_region`):
the export rides on ``hello_ok``, and a grant only records the bytes the receiver will copy. The
receiver uses it with a sender of its own host (same :func:`~kv_transfer.cuda_ipc.host_identity`) when
it can copy on its GPU; it maps the pool once per sender instance (``link.path_state``, a
:class:`~kv_transfer.cuda_ipc.MappedPool`) and copies each grant in one kernel, then says ``done``.
A pool that cannot be mapped here makes the link fall back to the next path for that sender.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Any

from .config import KVTransferConfig
from .cuda_ipc import IpcPuller, MappedPool, export_region, host_identity
from .data_path import Link, PathUnusable, ReceiverPath, SenderPath
from .memory import KVRegion
from .transfer import Transfer

logger = logging.getLogger("pdserve.kv_transfer")


def _ipc_possible(region: KVRegion, config: KVTransferConfig) -> bool:
    """A single CUDA allocation, with CUDA IPC allowed by the config."""
    return region.is_cuda and config.cuda_ipc and not region.sharded


class IpcSendPath(SenderPath):
    """Hands a same-host receiver the export of the pool; it copies the granted blocks itself."""

    name = "cuda_ipc"

    def __init__(self, region: KVRegion, export: dict[str, Any]) -> None:
        self.region = region
        #: ``hello_ok`` fields that let a receiver of this host map the pool.
        self.export = export

    @classmethod
    def for_region(cls, region: KVRegion, config: KVTransferConfig) -> IpcSendPath | None:
        """The path over ``region``, or None when its memory cannot be shared this way."""
        if not _ipc_possible(region, config):
            return None
        try:
            return cls(region, export_region(region))
        except Exception as e:  # e.g. no libcuda, or memory CUDA IPC cannot share
            logger.info("CUDA IPC unavailable for this pool (%s); peers use the backend's own path", e)
            return None

    def peer_info(self) -> dict[str, Any]:
        return {"ipc_host": self.export["ipc_host"]}

    def hello_ok(self, hello: dict) -> tuple[dict, bytes]:
        return self.export, b""

    def serve(self, sock: socket.socket, t: Transfer, block_ids: list[int], hello: dict, read: dict) -> None:
        t.granted_nbytes = len(block_ids) * self.region.block_nbytes


class IpcPullPath(ReceiverPath):
    """Copies granted blocks out of a same-host sender's mapped pool (``puller`` None: not on this side)."""

    name = "cuda_ipc"

    def __init__(self, region: KVRegion, config: KVTransferConfig) -> None:
        self.region = region
        #: Copies out of mapped pools on a side stream (None: this pool cannot, e.g. host memory).
        self.puller = self._make_puller(region) if _ipc_possible(region, config) else None
        self._host = host_identity()
        self._pulls = 0

    @staticmethod
    def _make_puller(region: KVRegion) -> IpcPuller | None:
        try:
            return IpcPuller(region)
        except Exception as e:  # e.g. a pool torch cannot view as bytes
            logger.info("CUDA IPC pulls unavailable for this pool (%s)", e)
            return None

    def can_reach(self, peer_info: dict[str, Any]) -> bool:
        return self.puller is not None and peer_info.get("ipc_host") == self._host

    def connected(self, link: Link, hello: dict, payload: bytes) -> None:
        if link.path_state is not None:
            return  # same sender instance (the link checked): its pool is still mapped
        try:
            link.path_state = MappedPool(hello, self.region)
        except Exception as e:
            raise PathUnusable(f"cannot map the sender's pool: {e}") from e

    def pull(self, link: Link, t: Transfer, grant: dict, payload: bytes) -> int:
        nbytes = self.puller.pull(link.path_state, t.remote_block_ids, list(t.block_ids))
        self._pulls += 1
        return nbytes

    def forget(self, link: Link) -> None:
        mapped, link.path_state = link.path_state, None
        if mapped is not None:
            try:
                mapped.close()
            except Exception:
                logger.exception("unmapping the CUDA IPC pool of %s:%s", link.host, link.port)

    def stats(self) -> dict[str, int]:
        return {"cuda_ipc_pulls": self._pulls}

    def link_stats(self, states: Sequence[Any]) -> dict[str, int]:
        return {"cuda_ipc_mapped": sum(1 for s in states if s is not None)}
