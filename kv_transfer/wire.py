"""Framing of the control protocol and zero-copy bulk I/O on sockets.

A message is a 4-byte big-endian length, a JSON header, then optionally
``header["payload"]`` raw bytes. Bulk block data is written with
``socket.sendmsg`` straight from memoryviews of the KV memory and read with
``socket.recvmsg_into`` straight into the destination blocks: no Python-level
copy of block bytes on either side.
"""

from __future__ import annotations

import json
import socket
import struct

_LEN = struct.Struct("!I")
_MAX_HEADER = 16 << 20
_IOV_BATCH = 512  # below IOV_MAX (1024 on Linux)


class PeerClosed(ConnectionError):
    """The peer closed the connection."""


def send_msg(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    """Send one framed message."""
    if payload:
        header = {**header, "payload": len(payload)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw + payload)


def recv_msg(sock: socket.socket) -> tuple[dict, bytes]:
    """Receive one framed message; raises :class:`PeerClosed` at EOF."""
    (size,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if size > _MAX_HEADER:
        raise ConnectionError(f"header of {size} bytes is too large")
    header = json.loads(recv_exact(sock, size))
    payload = recv_exact(sock, header["payload"]) if header.get("payload") else b""
    return header, payload


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Receive exactly ``n`` bytes (small control data only)."""
    buf = bytearray(n)
    recv_into_views(sock, [memoryview(buf)])
    return bytes(buf)


def send_views(sock: socket.socket, views: list[memoryview], should_stop=None) -> int:
    """Send every byte of ``views`` with scatter-gather ``sendmsg``; returns bytes sent."""
    total = 0
    i, pending = 0, list(views)
    while i < len(pending):
        if should_stop is not None and should_stop():
            raise InterruptedError("stopped")
        sent = sock.sendmsg(pending[i:i + _IOV_BATCH])
        total += sent
        i = _advance(pending, i, sent)
    return total


def recv_into_views(sock: socket.socket, views: list[memoryview], should_stop=None) -> int:
    """Fill ``views`` in order from the socket with ``recvmsg_into``; returns bytes read."""
    total = 0
    i, pending = 0, [v for v in views if v.nbytes]
    while i < len(pending):
        if should_stop is not None and should_stop():
            raise InterruptedError("stopped")
        got = sock.recvmsg_into(pending[i:i + _IOV_BATCH])[0]
        if got == 0:
            raise PeerClosed("peer closed the connection")
        total += got
        i = _advance(pending, i, got)
    return total


def _advance(pending: list[memoryview], i: int, nbytes: int) -> int:
    """Consume ``nbytes`` from ``pending[i:]`` (trimming a partly done view); return the new index."""
    while nbytes and i < len(pending):
        n = pending[i].nbytes
        if nbytes >= n:
            nbytes -= n
            i += 1
        else:
            pending[i] = pending[i][nbytes:]
            nbytes = 0
    return i


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    """TCP_NODELAY and large kernel buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not buffer_bytes:
        return
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        except OSError:
            pass
