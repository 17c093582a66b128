"""TCP backend: block bytes streamed on the control connection.

The sender writes the granted blocks with scatter-gather ``sendmsg`` from
memoryviews of its KV pool (runs of consecutive block ids merged into one
range); the receiver ``recvmsg_into``-s them straight into its destination
blocks. No Python-level copy of block bytes; the kernel does one copy per side.
CPU memory only (a CUDA pool needs the NIXL backend).
"""

from __future__ import annotations

import socket
from typing import Any

from .config import KVTransferConfig
from .layout import KVLayout
from .receiver import ControlReceiver, PeerLink
from .sender import ControlSender, _shutdown
from .transfer import Transfer
from .wire import recv_into_views, send_views


def _require_cpu(region_is_cuda: bool) -> None:
    if region_is_cuda:
        raise ValueError("the tcp backend moves CPU memory only; use backend='nixl' for CUDA KV")


class TcpSender(ControlSender):
    """Serves granted blocks over the receiver's TCP connection."""

    backend_name = "tcp"

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig) -> None:
        super().__init__(kv_cache, layout, config)
        try:
            _require_cpu(self.region.is_cuda)
        except ValueError:
            self.close()
            raise

    def _serve_grant(self, sock: socket.socket, t: Transfer, block_ids: list[int]) -> None:
        views = self.region.block_views(block_ids)
        if not t.begin_io():
            raise InterruptedError("transfer stopped before sending")
        t.set_interrupt(lambda _t: _shutdown(sock))
        try:
            t.bytes_moved += send_views(sock, views, should_stop=lambda: t.stop_requested)
        finally:
            t.set_interrupt(None)
            t.end_io()


class TcpReceiver(ControlReceiver):
    """Receives granted blocks straight into the local KV pool."""

    backend_name = "tcp"

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig) -> None:
        super().__init__(kv_cache, layout, config)
        _require_cpu(self.region.is_cuda)

    def _pull(self, link: PeerLink, t: Transfer, grant: dict) -> int:
        expected = len(t.block_ids) * self.region.block_nbytes
        if int(grant.get("nbytes", -1)) != expected:
            raise ConnectionError(f"grant announces {grant.get('nbytes')} bytes, expected {expected}")
        return recv_into_views(link.sock, self.region.block_views(t.block_ids),
                               should_stop=lambda: t.stop_requested)
