"""The TCP data path, spoken by every sender and receiver on CPU memory.

After ``grant`` the sender writes the granted blocks on the control connection
with scatter-gather ``sendmsg`` from memoryviews of its pool (runs of
consecutive block ids merged); the receiver ``recvmsg_into``-s them straight
into its destination blocks. No Python-level copy of block bytes. Both sides
bracket the I/O with ``begin_io``/``end_io`` and install a socket shutdown as
the transfer's interrupt, so abort and deadline stop it at once.
"""

from __future__ import annotations

import socket

from .memory import KVRegion
from .transfer import Transfer
from .wire import recv_into_views, send_views


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def serve_blocks(sock: socket.socket, region: KVRegion, t: Transfer, block_ids: list[int]) -> None:
    """Sender: stream ``block_ids`` of ``region``; counts the bytes on ``t``."""
    views = region.block_views(block_ids)
    t.set_interrupt(lambda _t: _shutdown(sock))
    if not t.begin_io():
        t.set_interrupt(None)
        raise InterruptedError("transfer stopped before sending")
    try:
        t.bytes_moved += send_views(sock, views, should_stop=lambda: t.stop_requested)
    finally:
        t.set_interrupt(None)
        t.end_io()


def pull_blocks(sock: socket.socket, region: KVRegion, t: Transfer, grant: dict) -> int:
    """Receiver: fill ``t``'s local blocks from the stream (caller holds ``begin_io``)."""
    expected = len(t.block_ids) * region.block_nbytes
    if int(grant.get("nbytes", -1)) != expected:
        raise ConnectionError(f"grant announces {grant.get('nbytes')} bytes, expected {expected}")
    return recv_into_views(sock, region.block_views(t.block_ids), should_stop=lambda: t.stop_requested)
