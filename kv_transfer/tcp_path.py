"""The TCP data path, spoken by every sender and receiver (:class:`TcpSendPath`, :class:`TcpPullPath`).

After ``grant`` the sender writes the granted blocks on the control connection
and the receiver reads them, in the order of the block ids. Host memory goes
to the socket directly: scatter-gather ``sendmsg`` from memoryviews of the pool
(runs of consecutive block ids merged) and ``recvmsg_into`` straight into the
destination blocks, no Python-level copy. Device (CUDA) memory goes through a
:class:`~kv_transfer.staging.Stager`'s two host buffers, pipelined:

    sender:   copy batch 0 -> [copy batch k+1 | send batch k] -> ...
    receiver: recv batch 0 -> [copy batch k to the device | recv batch k+1] -> ...

The bytes on the wire are the same either way, so a staged side and a direct
side talk to each other.

Between two staged sides on one host (the receiver asked with ``"shm": true``
in its ``read``, see :mod:`shm_buffer`), the blocks skip the socket: the
sender's buffers are shared memory the receiver maps, and only small frames
cross the connection:

    sender:   {"type": "shm", B buffers}; copy batches 0..B-1 in; per batch k:
              {"type": "batch", k} when batch k is in its buffer, then copy
              batch k-1+B into buffer (k-1) % B once batch k-1 is acked
    receiver: per batch k: start copying buffer k % B to its blocks, then
              {"type": "ack", k-1} once batch k-1's copy finished

Both sides bracket the I/O with ``begin_io``/``end_io``
and install a socket shutdown as the transfer's interrupt, so abort and
deadline stop it at once; a staged side waits for its copies in flight before
``end_io`` (terminal still means the blocks are no longer touched).
"""

from __future__ import annotations

import collections
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

from .config import KVTransferConfig
from .copiers import split_batches
from .cuda_ipc import host_identity
from .data_path import DataPath, Link, ReceiverPath, SenderPath
from .memory import KVRegion
from .shm_buffer import SenderBuffers, can_map_from
from .staging import NUM_BUFFERS, Stager, StagingPool, make_staging
from .transfer import Transfer
from .wire import recv_into_views, recv_msg, send_msg, send_views, shutdown_quietly


def serve_blocks(sock: socket.socket, region: KVRegion, t: Transfer, block_ids: list[int],
                 staging: StagingPool | None = None, shm: bool = False) -> None:
    """Sender: stream ``block_ids`` of ``region`` (staged when ``staging`` is given; through
    shared buffers when ``shm`` too); counts the bytes on ``t``."""
    stager = staging.acquire() if staging is not None and block_ids else None
    t.set_interrupt(lambda _t: shutdown_quietly(sock))
    if not t.begin_io():
        t.set_interrupt(None)
        if stager is not None:
            staging.release(stager)
        raise InterruptedError("transfer stopped before sending")
    try:
        if stager is None:
            t.bytes_moved += send_views(sock, region.block_views(block_ids),
                                        should_stop=lambda: t.stop_requested)
        else:
            try:
                send = _send_shm if shm and stager.shared else _send_staged
                t.bytes_moved += send(sock, stager, block_ids, lambda: t.stop_requested)
            finally:
                stager.settle()
                staging.release(stager)
    finally:
        t.set_interrupt(None)
        t.end_io()


def pull_blocks(sock: socket.socket, region: KVRegion, t: Transfer, grant: dict,
                staging: StagingPool | None = None, map_peer: Callable[[dict], Any] | None = None) -> int:
    """Receiver: fill ``t``'s local blocks from the stream (caller holds ``begin_io``);
    staged when ``staging`` is given; from the sender's shared buffers (mapped with
    ``map_peer``) when given. Returns the bytes read."""
    expected = len(t.block_ids) * region.block_nbytes
    if int(grant.get("nbytes", -1)) != expected:
        raise ConnectionError(f"grant announces {grant.get('nbytes')} bytes, expected {expected}")
    if staging is None or not t.block_ids:
        return recv_into_views(sock, region.block_views(t.block_ids), should_stop=lambda: t.stop_requested)
    stager = staging.acquire()
    try:
        if map_peer is not None:
            return _recv_shm(sock, stager, list(t.block_ids), map_peer)
        return _recv_staged(sock, stager, list(t.block_ids), lambda: t.stop_requested)
    finally:
        stager.settle()
        staging.release(stager)


def _send_staged(sock: socket.socket, stager: Stager, block_ids: list[int], should_stop) -> int:
    """Pool -> buffer k % 2 -> socket; the copy of batch k+1 runs while batch k is sent."""
    batches = stager.batches(block_ids)
    stager.start()
    stager.to_host(0, batches[0])
    total = 0
    for k, batch in enumerate(batches):
        i = k % NUM_BUFFERS
        if k + 1 < len(batches):  # that buffer's previous batch (k-1) is already sent
            stager.to_host((k + 1) % NUM_BUFFERS, batches[k + 1])
        stager.wait(i)
        total += send_views(sock, [stager.views[i][:batch.nbytes]], should_stop=should_stop)
    return total


def _recv_staged(sock: socket.socket, stager: Stager, block_ids: list[int], should_stop) -> int:
    """Socket -> buffer k % 2 -> pool; the copy of batch k runs while batch k+1 arrives."""
    stager.start()
    total = 0
    for k, batch in enumerate(stager.batches(block_ids)):
        i = k % NUM_BUFFERS
        stager.wait(i)  # batch k-2 has left this buffer
        total += recv_into_views(sock, [stager.views[i][:batch.nbytes]], should_stop=should_stop)
        stager.to_device(i, batch)
    stager.settle()  # the blocks are in place before the transfer can turn DONE
    return total


def _send_shm(sock: socket.socket, stager: Stager, block_ids: list[int], should_stop) -> int:
    """Pool -> shared buffer k % B, announce batch k. All B buffers are filled up front; the
    receiver acks batch k-1 once it has batch k, and buffer (k-1) % B is then refilled."""
    batches = stager.batches(block_ids)
    nbuf = len(stager.buffers)
    stager.start()
    send_msg(sock, {"type": "shm", "buffers": stager.describe(), "batch_blocks": stager.batch_blocks})
    for j in range(min(nbuf, len(batches))):
        stager.to_host(j, batches[j])
    acked = 0  # batches the receiver has copied out (acks come in order)
    for k, batch in enumerate(batches):
        stager.wait(k % nbuf)
        if should_stop():
            raise InterruptedError("stopped")
        send_msg(sock, {"type": "batch", "k": k, "nbytes": batch.nbytes})
        refill = k - 1 + nbuf  # goes where batch k-1 was, once that is out
        if k >= 1 and refill < len(batches):
            while acked < k:
                acked = _recv_ack(sock, acked)
            stager.to_host(refill % nbuf, batches[refill])
    while acked < len(batches):
        acked = _recv_ack(sock, acked)
    return sum(b.nbytes for b in batches)


def _recv_ack(sock: socket.socket, acked: int) -> int:
    msg, _ = recv_msg(sock)
    if msg.get("type") != "ack" or msg.get("k") != acked:
        raise ConnectionError(f"expected ack of batch {acked}, got {msg}")
    return acked + 1


def _recv_shm(sock: socket.socket, stager: Stager, block_ids: list[int], map_peer) -> int:
    """Shared buffer k % B -> pool for each announced batch; batch k is acknowledged once its
    copy finished, after the copy of batch k+1 was started (copies and handoffs overlap)."""
    msg, _ = recv_msg(sock)
    descs = msg.get("buffers")
    if msg.get("type") != "shm" or not isinstance(descs, list) or not 2 <= len(descs) <= 16:
        raise ConnectionError(f"expected the sender's shared buffers, got {msg.get('type')!r}")
    mappings = [map_peer(desc) for desc in descs]
    batch_blocks = msg.get("batch_blocks")
    if type(batch_blocks) is not int or not 0 < batch_blocks * stager.block_nbytes <= min(m.nbytes for m in mappings):
        raise ConnectionError(f"sender batches of {batch_blocks!r} blocks do not fit its buffers")
    buffers = [stager.copier.native(m) for m in mappings]
    stager.start()
    copier, in_flight, total = stager.copier, collections.deque(), 0

    def finish_oldest() -> None:
        k, handle = in_flight.popleft()
        copier.wait(handle)
        send_msg(sock, {"type": "ack", "k": k})

    try:
        # The sender's batches (its buffers' size), whatever our own staging chunk is.
        for k, batch in enumerate(split_batches(block_ids, batch_blocks, stager.block_nbytes)):
            msg, _ = recv_msg(sock)
            if msg.get("type") != "batch" or msg.get("k") != k or msg.get("nbytes") != batch.nbytes:
                raise ConnectionError(f"expected batch {k} of {batch.nbytes} bytes, got {msg}")
            in_flight.append((k, copier.to_device(buffers[k % len(buffers)], batch)))
            total += batch.nbytes
            if len(in_flight) > 1:
                finish_oldest()
        while in_flight:
            finish_oldest()
    finally:
        for _, handle in in_flight:  # the blocks are no longer touched once this returns
            copier.wait(handle)
    return total


class _TcpPath(DataPath):
    """Both halves: the side's staging pool (None: a host pool, its blocks go to the socket directly)."""

    name = "tcp"
    acks_done = False

    def __init__(self, region: KVRegion, config: KVTransferConfig) -> None:
        self.region = region
        #: Host buffers device memory is staged through (None: host pool).
        self.staging = make_staging(region, config.staging, config.staging_chunk_bytes, shared=config.staging_shm)
        #: Who may map our shared staging buffers (None: they are not shared).
        self._host = host_identity() if self.staging is not None and self.staging.shared else None

    @property
    def label(self) -> str:
        """``"tcp-staged"`` (through host staging buffers) or ``"tcp"``: the backend name of a TCP side."""
        return "tcp" if self.staging is None else "tcp-staged"

    def stats(self) -> dict[str, int]:
        return self.staging.stats() if self.staging is not None else {}

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()


class TcpSendPath(_TcpPath, SenderPath):
    """Streams granted blocks on the control connection (or hands them over in shared buffers)."""

    def _shares_with(self, hello: dict) -> bool:
        """Staged blocks may skip the socket: a receiver of this host maps our staging buffers."""
        return self._host is not None and hello.get("shm_host") == self._host

    def hello_ok(self, hello: dict) -> tuple[dict, bytes]:
        return ({"shm_pid": os.getpid()} if self._shares_with(hello) else {}), b""

    def serve(self, sock: socket.socket, t: Transfer, block_ids: list[int], hello: dict, read: dict) -> None:
        serve_blocks(sock, self.region, t, block_ids, self.staging,
                     self._shares_with(hello) and read.get("shm") is True)


class TcpPullPath(_TcpPath, ReceiverPath):
    """Reads granted blocks off the control connection (or out of a same-host sender's shared buffers);
    ``link.path_state`` is that sender's :class:`~kv_transfer.shm_buffer.SenderBuffers`."""

    def hello(self) -> dict:
        return {"shm_host": self._host} if self._host is not None else {}

    def connected(self, link: Link, hello: dict, payload: bytes) -> None:
        if link.path_state is None:
            link.path_state = SenderBuffers(pin=self.staging is not None and self.staging.copier_pins)
        link.path_state.shared = bool(hello.get("shm_pid")) and can_map_from(hello["shm_pid"])

    def read_fields(self, link: Link) -> dict:
        return {"shm": link.path_state.shared}

    def pull(self, link: Link, t: Transfer, grant: dict, payload: bytes) -> int:
        buffers: SenderBuffers = link.path_state
        return pull_blocks(link.sock, self.region, t, grant, self.staging, buffers.map if buffers.shared else None)

    def forget(self, link: Link) -> None:
        buffers, link.path_state = link.path_state, None
        if buffers is not None:
            buffers.close()

    def link_stats(self, states: Sequence[Any]) -> dict[str, int]:
        return {"shm_mapped": sum(len(s) for s in states if s is not None)}
