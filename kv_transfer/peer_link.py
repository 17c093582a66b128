"""A receiver's link to one sender instance: its control connection and worker thread.

Each link runs its queued transfers in order:

    queued -> connect + HMAC handshake + hello (once per connection) -> ``read`` ->
    ``grant`` (TRANSFERRING) -> the data path pulls the bytes -> ``done``
    [-> ``ack``] -> DONE

The link's data path (:class:`~kv_transfer.data_path.ReceiverPath`) adds its fields to the
``hello`` and each ``read``, sets up what it keeps for this sender once connected
(``path_state``) and pulls the granted bytes: ``tcp`` (streamed on the connection, or
through the sender's shared staging buffers on one host), ``cuda_ipc`` (copied out of
the sender's mapped pool) or ``nixl`` (a NIXL READ). A path that cannot work with this
sender after all (:class:`~kv_transfer.data_path.PathUnusable`) is replaced by the
receiver's next one, for good.
Abort or deadline during a pull shuts the connection down (that interrupts any
blocking I/O at once, and tells the sender to free); the next transfer on the
link reconnects, as does a transfer on a link idle for half the sender's idle
timeout (the sender may be about to close it). The sender proves it holds the
cluster key before its ``hello_ok`` (and any payload over ``PRE_AUTH_MAX_BYTES``)
is read. A handshake the sender cuts short or answers ``busy`` (strangers crowding
its port, its connection caps) is tried again, up to ``connect_attempts`` times with a
doubling pause, within the transfer's deadline, before the transfer fails.
"""

from __future__ import annotations

import collections
import logging
import socket
import ssl
import threading
import time
from typing import Any, Protocol

from . import auth
from .config import KVTransferConfig
from .data_path import PathUnusable, ReceiverPath
from .errors import HandshakeCutError, IncompatiblePeerError, TransferRefusedError
from .layout import PROTOCOL_VERSION, KVLayout
from .tls import wrap_client
from .transfer import Transfer
from .wire import PeerClosed, recv_msg, send_msg, shutdown_quietly, tune_socket

logger = logging.getLogger("pdserve.kv_transfer")


#: Pause before the second handshake attempt (then doubling, at most ``MAX_RETRY_PAUSE_S``).
FIRST_RETRY_PAUSE_S = 0.05
MAX_RETRY_PAUSE_S = 1.0
#: How a sender cutting an established connection during the handshake shows here (not a timeout: a
#: sender that stopped answering is not tried again).
_CUT = (PeerClosed, ConnectionResetError, BrokenPipeError, ssl.SSLEOFError)


class LinkOwner(Protocol):
    """What a link uses of its receiver (:class:`~kv_transfer.receiver.ControlReceiver`)."""

    config: KVTransferConfig
    layout: KVLayout
    tls: ssl.SSLContext | None
    """Client side of the links' TLS (None: plaintext)."""

    def fall_back(self, peer_info: dict[str, Any], failed: ReceiverPath) -> ReceiverPath:
        """``failed`` did not work with this sender instance: the path to use instead, for good."""

    def count_handshake_retry(self) -> None:
        """Count a handshake tried again."""


class PeerLink:
    """Control connection + worker thread for one sender instance."""

    def __init__(self, owner: LinkOwner, peer_info: dict[str, Any], path: ReceiverPath) -> None:
        self.owner = owner
        self.peer_info = peer_info
        self.path = path
        #: What the path keeps for this sender (e.g. its mapped pool), across reconnects to one instance.
        self.path_state: Any = None
        self.host = str(peer_info["host"])
        self.port = int(peer_info["port"])
        self.instance_id = peer_info.get("instance_id")
        self.sock: socket.socket | None = None
        self.last_used = 0.0
        """``time.monotonic()`` of the last message on the connection."""
        self.hello: dict = {}
        self._queue: collections.deque[Transfer] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kv-recv-{self.host}:{self.port}")
        self._thread.start()

    def submit(self, t: Transfer) -> None:
        """Queue ``t``; the worker picks it up in order."""
        with self._cond:
            self._queue.append(t)
            self._cond.notify()

    def interrupt(self) -> None:
        """Break any blocking I/O on the connection (used by abort/deadline)."""
        shutdown_quietly(self.sock)

    def disconnect(self) -> None:
        """Close the connection; the next transfer reconnects."""
        sock, self.sock = self.sock, None
        if sock is not None:
            shutdown_quietly(sock)
            sock.close()

    def close(self) -> None:
        """Fail queued transfers, stop the worker, drop the path's state for this sender."""
        with self._cond:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._cond.notify()
        for t in queued:
            t.fail("receiver closed")
        self.interrupt()
        self._thread.join(timeout=5)
        self.disconnect()
        self.path.forget(self)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                t = self._queue.popleft()
            try:
                self._run_one(t)
            except Exception as e:  # never let the worker die
                logger.exception("transfer %s: unexpected error", t.transfer_id)
                self.disconnect()
                t.fail(f"internal error: {e!r}")

    def _connect(self, t: Transfer) -> None:
        timeout = max(0.001, min(self.owner.config.connect_timeout_s, t.remaining()))
        sender_tls = self.peer_info.get("tls") is True
        if sender_tls != (self.owner.tls is not None):
            raise IncompatiblePeerError("the sender requires TLS on KV links and this receiver has no KV TLS files"
                                        if sender_tls else "this receiver requires TLS on KV links; the sender "
                                        "does not speak it")
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            tune_socket(sock, self.owner.config.socket_buffer_bytes)
            if self.owner.tls is not None:
                sock = wrap_client(self.owner.tls, sock)
            layout = self.owner.layout
            proof = self._authenticate(sock)
            send_msg(sock, {"type": "hello", "version": PROTOCOL_VERSION, "proof": proof,
                            "backend": self.path.name, **self.path.hello(),
                            "compat_hash": layout.compat_hash(), "layout": layout.to_dict()})
            hello, payload = recv_msg(sock, max_payload=self.owner.config.max_handshake_payload_bytes)
            if hello.get("type") == "refuse" and hello.get("busy") is True:
                raise HandshakeCutError(f"sender busy: {str(hello.get('reason'))[:200]}")
            if hello.get("type") == "refuse":
                raise IncompatiblePeerError(f"sender refused the handshake: {hello.get('reason')}")
            if hello.get("type") != "hello_ok":
                raise IncompatiblePeerError(f"unexpected handshake reply {hello.get('type')!r}")
            if self.instance_id and hello.get("instance_id") != self.instance_id:
                raise IncompatiblePeerError(
                    "sender restarted (instance id changed): its KV handle is stale")
            self.path.connected(self, hello, payload)
        except PathUnusable as e:
            sock.close()
            self._fall_back(t, str(e))
            return
        except _CUT as e:
            sock.close()
            raise HandshakeCutError(f"the sender cut the handshake: {e!r}") from e
        except BaseException:
            sock.close()
            raise
        self.hello = hello
        self.sock = sock
        self.last_used = time.monotonic()

    def _connect_retrying(self, t: Transfer) -> None:
        """``_connect``, tried again after a pause while the sender cuts the handshake or is busy."""
        pause = FIRST_RETRY_PAUSE_S
        for attempt in range(1, self.owner.config.connect_attempts + 1):
            try:
                self._connect(t)
                return
            except HandshakeCutError as e:
                if attempt == self.owner.config.connect_attempts or t.remaining() <= pause or t.state.is_terminal:
                    raise
                logger.info("kv_transfer: handshake %d with %s:%s failed (%s); trying again in %.2fs",
                            attempt, self.host, self.port, e, pause)
            self.owner.count_handshake_retry()
            with self._cond:
                if self._cond.wait_for(lambda: self._closed, pause):
                    raise HandshakeCutError("receiver closed")
            pause = min(2 * pause, MAX_RETRY_PAUSE_S)

    def _authenticate(self, sock: socket.socket) -> str:
        """Step 0 of the handshake: check the sender's proof, return ours (see :mod:`kv_transfer.auth`)."""
        key = self.owner.config.auth_key
        nonce_r = auth.new_nonce()
        send_msg(sock, {"type": "auth", "version": PROTOCOL_VERSION, "nonce": nonce_r})
        reply, _ = recv_msg(sock, auth.PRE_AUTH_MAX_BYTES)
        if reply.get("type") == "refuse":
            raise IncompatiblePeerError(f"sender refused the handshake: {str(reply.get('reason'))[:200]}")
        if reply.get("type") != "challenge":
            raise IncompatiblePeerError(f"unexpected handshake reply {str(reply.get('type'))[:40]!r}")
        nonce_s = reply.get("nonce")
        if not auth.proof_ok(key, "sender", nonce_r, nonce_s, reply.get("proof")):
            raise IncompatiblePeerError(
                "the sender failed authentication (wrong cluster secret)" if key is not None and reply.get("proof")
                else "the sender and this receiver disagree on authentication (cluster secret on one side only)")
        return auth.proof(key, "receiver", nonce_r, nonce_s)

    def _fall_back(self, t: Transfer, why: str) -> None:
        """The path did not work with this sender: use the receiver's next one, for good."""
        failed = self.path
        failed.forget(self)
        self.path = self.owner.fall_back(self.peer_info, failed)
        logger.warning("kv_transfer: %s with %s:%s unusable (%s); using %s", failed.name, self.host, self.port, why,
                       self.path.name)
        self._connect(t)

    def _run_one(self, t: Transfer) -> None:
        if t.state.is_terminal:  # aborted or expired while queued: let the sender free
            self._send_abort(t)
            return
        if self.sock is not None and time.monotonic() - self.last_used > self.owner.config.idle_timeout_s / 2:
            self.disconnect()  # the sender may be closing it as idle: start afresh
        if self.sock is None:
            try:
                self._connect_retrying(t)
            except (OSError, IncompatiblePeerError, HandshakeCutError, ValueError) as e:
                t.fail(f"cannot connect to {self.host}:{self.port}: {e}")
                return
        remote = t.remote_block_ids
        if any(b >= int(self.hello["num_blocks"]) for b in remote):
            t.fail(f"remote block id out of range [0, {self.hello['num_blocks']})")
            self._send_abort(t)
            return
        t.set_interrupt(lambda _t: self.interrupt())
        if not t.begin_io():
            t.set_interrupt(None)
            self._send_abort(t)
            return
        error: str | None = None
        nbytes = 0
        try:
            sock = self.sock
            sock.settimeout(max(0.001, t.remaining()))
            self.last_used = time.monotonic()
            send_msg(sock, {"type": "read", "tid": t.transfer_id, "cap": t.capability, "blocks": remote,
                            **self.path.read_fields(self)})
            reply, payload = recv_msg(sock, max_payload=self.owner.config.max_handshake_payload_bytes)
            if reply.get("type") == "refuse_read":
                raise TransferRefusedError(f"sender refused the read: {reply.get('reason')}")
            if reply.get("type") != "grant" or reply.get("tid") != t.transfer_id:
                raise ConnectionError(f"unexpected reply {reply}")
            t.set_transferring()
            nbytes = self.path.pull(self, t, reply, payload)
            send_msg(sock, {"type": "done", "tid": t.transfer_id})
            if self.path.acks_done:
                ack, _ = recv_msg(sock)
                if ack.get("type") != "ack" or ack.get("tid") != t.transfer_id:
                    raise ConnectionError(f"unexpected reply {ack}")
                if not ack.get("ok"):
                    raise TransferRefusedError(f"sender no longer held the blocks: {ack.get('reason')}")
        except TransferRefusedError as e:
            error = str(e)
        except (OSError, ConnectionError, ValueError, InterruptedError) as e:
            error = ("deadline exceeded" if isinstance(e, socket.timeout)
                     else f"connection to sender lost: {e!r}")
            self.disconnect()
        finally:
            t.set_interrupt(None)
            t.end_io()
        if error is None:
            t.succeed(nbytes)
        else:
            t.fail(error)

    def _send_abort(self, t: Transfer) -> None:
        if self.sock is None:
            if t.remaining() <= 0:
                return  # expired: the sender's own lease deadline frees it
            try:
                self._connect(t)
            except Exception:
                return
        try:
            self.last_used = time.monotonic()
            send_msg(self.sock, {"type": "abort", "tid": t.transfer_id, "cap": t.capability,
                                 "reason": t.error or ""})
        except OSError:
            self.disconnect()
