"""Framing of the control protocol and zero-copy bulk I/O on sockets.

A message is a 4-byte big-endian length, a JSON header, then optionally
``header["payload"]`` raw bytes. Bulk block data is written with
``socket.sendmsg`` straight from memoryviews of the KV memory and read with
``socket.recvmsg_into`` straight into the destination blocks: no Python-level
copy of block bytes on either side. On a TLS connection (no scatter-gather there)
each view is written and read whole by the TLS layer, still without a copy in Python.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import time

_LEN = struct.Struct("!I")
MAX_HEADER = 64 << 10
"""Default bound of a message's JSON header (a sender allows more for reads of many blocks)."""
_IOV_BATCH = 512  # below IOV_MAX (1024 on Linux)
_TLS_CHUNK = 4 << 20


class PeerClosed(ConnectionError):
    """The peer closed the connection."""


class MessageTooLarge(ConnectionError):
    """A message announced more bytes than this side accepts for it (refused before reading them)."""


def send_msg(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    """Send one framed message."""
    if payload:
        header = {**header, "payload": len(payload)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw + payload)


def recv_msg(sock: socket.socket, max_header: int = MAX_HEADER, max_payload: int = 0,
             deadline: float | None = None) -> tuple[dict, bytes]:
    """Receive one framed message; raises :class:`PeerClosed` at EOF.

    Sizes are checked before anything is allocated: a header over ``max_header`` or a payload
    over ``max_payload`` bytes raises :class:`MessageTooLarge` (the caller drops the connection).
    Only the sender's handshake reply carries a payload (NIXL metadata); block data is never
    framed (it streams after ``grant``, sized by the reader). ``deadline`` (``time.monotonic()``)
    bounds the whole message, however slowly its bytes trickle in."""
    (size,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
    if size > max_header:
        raise MessageTooLarge(f"header of {size} bytes is over the limit of {max_header}")
    header = json.loads(recv_exact(sock, size, deadline))
    if not isinstance(header, dict):
        raise ValueError("a message header must be a JSON object")
    nbytes = header.get("payload", 0)
    if type(nbytes) is not int or nbytes < 0:
        raise ValueError(f"bad payload size {nbytes!r}")
    if nbytes > max_payload:
        raise MessageTooLarge(f"payload of {nbytes} bytes is over the limit of {max_payload}")
    payload = recv_exact(sock, nbytes, deadline) if nbytes else b""
    return header, payload


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Receive exactly ``n`` bytes (small control data only)."""
    buf = bytearray(n)
    recv_into_views(sock, [memoryview(buf)], deadline=deadline)
    return bytes(buf)


def send_views(sock: socket.socket, views: list[memoryview], should_stop=None) -> int:
    """Send every byte of ``views`` with scatter-gather ``sendmsg``; returns bytes sent."""
    if isinstance(sock, ssl.SSLSocket):
        return _send_views_tls(sock, views, should_stop)
    total = 0
    i, pending = 0, list(views)
    while i < len(pending):
        if should_stop is not None and should_stop():
            raise InterruptedError("stopped")
        sent = sock.sendmsg(pending[i:i + _IOV_BATCH])
        total += sent
        i = _advance(pending, i, sent)
    return total


def recv_into_views(sock: socket.socket, views: list[memoryview], should_stop=None,
                    deadline: float | None = None) -> int:
    """Fill ``views`` in order from the socket with ``recvmsg_into``; returns bytes read.
    With ``deadline`` (``time.monotonic()``) the socket timeout is what is left of it."""
    total = 0
    i, pending = 0, [v for v in views if v.nbytes]
    while i < len(pending):
        if should_stop is not None and should_stop():
            raise InterruptedError("stopped")
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
        if isinstance(sock, ssl.SSLSocket):  # one TLS record at most per call
            got = sock.recv_into(pending[i])
        else:
            got = sock.recvmsg_into(pending[i:i + _IOV_BATCH])[0]
        if got == 0:
            raise PeerClosed("peer closed the connection")
        total += got
        i = _advance(pending, i, got)
    return total


def _send_views_tls(sock: ssl.SSLSocket, views: list[memoryview], should_stop) -> int:
    total = 0
    for view in views:
        for start in range(0, view.nbytes, _TLS_CHUNK):  # checks ``should_stop`` every few MB
            if should_stop is not None and should_stop():
                raise InterruptedError("stopped")
            chunk = view[start:start + _TLS_CHUNK]
            sock.sendall(chunk)
            total += chunk.nbytes
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


def shutdown_quietly(sock: socket.socket | None) -> None:
    """Shut both directions of ``sock`` down, ignoring errors; safe from another thread while one
    blocks in I/O on it (also for TLS: the plain socket's shutdown, leaving the TLS state alone)."""
    if sock is None:
        return
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except (OSError, ValueError):
        pass
