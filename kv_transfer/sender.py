"""Sender side of the control protocol, shared by every backend; the data paths move the bytes.

One listening socket; one thread per receiver connection. A connection goes:

0. ``auth`` (version, nonce) -> ``challenge`` (our nonce, our HMAC proof); the receiver's proof comes in
   its ``hello`` (see :mod:`kv_transfer.auth`). Until it checks out, messages are capped at
   ``PRE_AUTH_MAX_BYTES`` and nothing about this sender (layout, pool, NIXL metadata) is sent.
1. ``hello`` (proof, version, compat hash, layout, backend) -> ``hello_ok`` (+ backend
   metadata) or ``refuse`` and close: nothing else is possible before this.
2. ``read`` (transfer id, capability, block ids) -> ``grant`` or ``refuse_read``. Only
   blocks passed to :meth:`expect` for that transfer id, once, and only with the
   capability :meth:`expect` issued (a wrong one is refused like an unknown id).
   After ``grant`` the connection's data path moves the data (:meth:`SenderPath.serve`; TCP: streamed
   on this connection; CUDA IPC, NIXL: the receiver reads the memory itself).
3. ``done`` -> the sender's transfer turns DONE, only for a transfer granted on this connection (a path
   the receiver reads by itself also answers ``ack``, telling the receiver whether the lease still held
   during its read). ``abort``
   -> FAILED, only for a transfer granted on this connection or with its capability.

A connection that drops fails every transfer granted on it.

Nothing a connection sends is trusted: a message over its size limit (a receiver's messages carry no
payload; a header is bounded by what a ``read`` of every block needs) drops that connection before
anything is allocated; a proven ``hello`` must arrive whole within ``pre_auth_timeout_s``; a connection
silent for ``idle_timeout_s`` after it is closed; connections not yet proven and proven ones are capped
apart, so strangers can never crowd out a peer (see :mod:`kv_transfer.admission`); and the accept loop
outlives any error serving one.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from . import auth
from .admission import Admission, Conn
from .base import KVSender
from .config import KVTransferConfig
from .control_side import ControlSide
from .data_path import SenderPath
from .ipc_path import IpcSendPath
from .layout import PROTOCOL_VERSION, KVLayout
from .state import TransferState
from .tcp_path import TcpSendPath
from .tls import wrap_server
from .transfer import Transfer, TransferTable
from .wire import MAX_HEADER, MessageTooLarge, PeerClosed, recv_msg, send_msg, shutdown_quietly, tune_socket

logger = logging.getLogger("pdserve.kv_transfer")


class ControlSender(ControlSide, KVSender):
    """Listener + handshake + leases; the data paths move the bytes."""

    role = "sender"
    paths: list[SenderPath]

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig,
                 native: SenderPath | None = None) -> None:
        super().__init__(kv_cache, layout, config, native)
        self.instance_id = uuid.uuid4().hex
        self._table = TransferTable(f"send-{self.instance_id[:6]}")
        self._admission = Admission(config)
        #: The connection threads started and maybe still running (only the accept loop changes it).
        self._conn_threads: list[threading.Thread] = []
        self._num_auth_failed = 0
        #: A ``read`` names at most every block once: its header needs at most this much.
        self._max_header = MAX_HEADER + self.region.num_blocks * (len(str(self.region.num_blocks)) + 1)
        try:
            self._listener = socket.create_server((config.host, config.port), backlog=64)
        except BaseException:
            self._table.close("sender failed to start")
            self._close_paths()
            raise
        self.port = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"kv-accept-{self.port}")
        self._accept_thread.start()

    def _make_paths(self, native: SenderPath | None) -> list[SenderPath]:
        # CUDA IPC (if this pool can be exported), the native path, TCP.
        ipc = IpcSendPath.for_region(self.region, self.config)
        return [p for p in (ipc, native) if p is not None] + [TcpSendPath(self.region, self.config)]

    # -- public API -----------------------------------------------------------
    def peer_info(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        for path in self.paths:
            extra.update(path.peer_info())
        return {
            "backend": self.backend_name,
            "modes": list(self.modes),
            "host": self.config.public_host,
            "port": self.port,
            "instance_id": self.instance_id,
            "protocol_version": PROTOCOL_VERSION,
            "compat_hash": self.layout.compat_hash(),
            "tls": self.tls is not None,
            **extra,
        }

    def expect(self, transfer_id: str, block_ids: Sequence[int],
               timeout_s: float | None = None, capability: str | None = None) -> Transfer:
        if self._closed:
            raise RuntimeError("sender is closed")
        ids = self.region.check_ids(block_ids, f"expect({transfer_id!r})")
        t = Transfer(str(transfer_id), "sender", ids,
                     timeout_s if timeout_s is not None else self.config.default_timeout_s,
                     self.config.abort_wait_s, on_finish=self._table.finished)
        t.capability = capability or auth.new_capability()
        self._table.add(t)
        return t

    def stats(self) -> dict[str, int]:
        conns, pre_auth = self._admission.counts()
        return self._stats(connections=conns, pre_auth_connections=pre_auth,
                           connections_refused=self._admission.num_refused,
                           connections_evicted=self._admission.num_evicted, auth_failed=self._num_auth_failed)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        shutdown_quietly(self._listener)
        self._listener.close()
        self._accept_thread.join(timeout=2)
        self._table.close("sender closed")
        for conn in self._admission.live():
            shutdown_quietly(conn.sock)
        for thread in self._conn_threads:  # also those that left the admission pools but still run
            if thread.is_alive():
                thread.join(timeout=2)
        self._close_paths()

    # -- connection handling ----------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                logger.warning("accepting a receiver connection failed: %s", e)  # e.g. out of fds
                time.sleep(0.05)
                continue
            try:
                self._admit(sock, str(addr[0]))
            except Exception:  # noqa: BLE001 - e.g. no thread can start: drop this one, keep accepting
                logger.exception("cannot serve a receiver connection; closing it")
                sock.close()

    def _admit(self, sock: socket.socket, peer: str) -> None:
        """Serve a new connection on a thread of its own, in the pre-auth pool (see :mod:`admission`)."""
        if self._closed:
            sock.close()
            return
        conn = self._admission.admit(sock, peer)
        thread = threading.Thread(target=self._serve_conn, args=(conn,), daemon=True,
                                  name=f"kv-send-conn-{self.port}")
        self._conn_threads = [*(th for th in self._conn_threads if th.is_alive()), thread]
        try:
            tune_socket(sock, self.config.socket_buffer_bytes)
            _start_thread(thread)
        except BaseException:
            self._admission.remove(conn)
            raise

    def _check_hello(self, hello: dict) -> str | None:
        if hello.get("type") != "hello":
            return f"expected hello, got {hello.get('type')!r}"
        if hello.get("version") != PROTOCOL_VERSION:
            return (f"protocol version mismatch: sender speaks {PROTOCOL_VERSION}, "
                    f"receiver {hello.get('version')!r}")
        if self.path_named(hello.get("backend")) is None:
            return f"backend mismatch: sender serves {list(self.modes)}, receiver asks {hello.get('backend')!r}"
        if hello.get("compat_hash") != self.layout.compat_hash():
            try:
                fields = self.layout.mismatched_fields(KVLayout.from_dict(hello["layout"]))
            except Exception:
                fields = []
            # The fields that differ, never our values: the peer learns nothing about our layout.
            return f"incompatible KV layout (differs in: {', '.join(fields) or 'unreadable peer layout'})"
        return None

    def _authenticate(self, sock: socket.socket, deadline: float) -> dict | None:
        """Steps 0-1: the HMAC challenge-response; returns the receiver's ``hello`` once its proof
        checks out, or refuses (saying nothing about this sender) and returns None."""
        first, _ = recv_msg(sock, auth.PRE_AUTH_MAX_BYTES, deadline=deadline)
        if first.get("type") != "auth" or first.get("version") != PROTOCOL_VERSION:
            send_msg(sock, {"type": "refuse", "reason": f"protocol version mismatch: sender speaks "
                                                        f"{PROTOCOL_VERSION}, receiver {first.get('version')!r}"})
            return None
        key = self.config.auth_key
        nonce_r, nonce_s = first.get("nonce"), auth.new_nonce()
        if not isinstance(nonce_r, str) or len(nonce_r) > 2 * auth.NONCE_BYTES:
            nonce_r = ""
        send_msg(sock, {"type": "challenge", "nonce": nonce_s, "authenticated": key is not None,
                        "proof": auth.proof(key, "sender", nonce_r, nonce_s)})
        hello, _ = recv_msg(sock, auth.PRE_AUTH_MAX_BYTES, deadline=deadline)
        if not auth.proof_ok(key, "receiver", nonce_r, nonce_s, hello.get("proof")):
            self._num_auth_failed += 1
            logger.warning("refusing a receiver at %s: authentication failed", _peer_name(sock))
            send_msg(sock, {"type": "refuse", "reason": "authentication failed"
                            if key is not None else "this sender does not authenticate (no cluster secret)"})
            return None
        return hello

    def _start_tls(self, conn: Conn, deadline: float) -> socket.socket:
        """The TLS handshake (when configured), by ``deadline``; the wrapped socket takes the plain one's place."""
        if self.tls is None:
            return conn.sock
        wrapped = wrap_server(self.tls, conn.sock)
        self._admission.replace_sock(conn, wrapped)
        wrapped.settimeout(max(0.001, deadline - time.monotonic()))
        wrapped.do_handshake()
        return wrapped

    def _serve_conn(self, conn: Conn) -> None:
        granted: dict[str, Transfer] = {}
        sock = conn.sock
        try:
            deadline = time.monotonic() + self.config.pre_auth_timeout_s
            sock = self._start_tls(conn, deadline)
            hello = self._authenticate(sock, deadline)
            if hello is None:
                return
            full = self._admission.promote(conn)
            if full:  # a proven peer: it may try again soon
                logger.warning("refusing a receiver at %s: %s", conn.peer, full)
                send_msg(sock, {"type": "refuse", "reason": full, "busy": True})
                return
            problem = self._check_hello(hello)
            if problem:
                logger.warning("refusing receiver: %s", problem)
                send_msg(sock, {"type": "refuse", "reason": problem})
                return
            path = self.path_named(hello["backend"])
            extra, payload = path.hello_ok(hello)
            send_msg(sock, {"type": "hello_ok", "instance_id": self.instance_id,
                            "num_blocks": self.region.num_blocks,
                            "block_nbytes": self.region.block_nbytes, **extra}, payload)
            while True:
                sock.settimeout(self.config.idle_timeout_s)
                msg, _ = recv_msg(sock, self._max_header)
                kind, tid = msg.get("type"), str(msg.get("tid"))
                if kind == "read":
                    self._handle_read(sock, tid, msg, granted, path, hello)
                elif kind == "done":
                    t = granted.pop(tid, None)
                    ok = t is not None and t.succeed(t.granted_nbytes)
                    if path.acks_done:
                        reason = "" if ok else (t.error if t is not None else "transfer not granted")
                        send_msg(sock, {"type": "ack", "tid": tid, "ok": ok, "reason": reason})
                elif kind == "abort":  # honoured from the grant's connection, or with the capability
                    t = granted.pop(tid, None)
                    if t is None:
                        t = self._table.get(tid)
                        if t is not None and not auth.capability_ok(t.capability, msg.get("cap")):
                            logger.warning("ignoring an abort of %r without its capability from %s",
                                           tid, _peer_name(sock))
                            t = None
                    if t is not None:
                        t.request_stop(f"receiver aborted: {str(msg.get('reason', ''))[:200]}")
                else:
                    raise ConnectionError(f"unexpected message {kind!r}")
        except MessageTooLarge as e:
            logger.warning("dropping a receiver connection: %s", e)
        except ssl.SSLError as e:
            if not conn.dropped:  # else: cut by us, for a newer connection
                logger.warning("refusing a receiver at %s: TLS failed (%s)", conn.peer, e.reason or e)
        except TimeoutError:
            if self._admission.is_proven(conn):
                logger.info("closing a receiver connection idle for %.0fs", self.config.idle_timeout_s)
            else:
                logger.info("closing a connection from %s that did not prove the key within %.1fs", conn.peer,
                            self.config.pre_auth_timeout_s)
        except (PeerClosed, OSError, ValueError, InterruptedError) as e:
            if granted:
                logger.info("receiver connection lost with %d transfers granted: %s", len(granted), e)
        except Exception:  # a malformed message: drop this connection, keep serving others
            logger.exception("closing a receiver connection after an unexpected error")
        finally:
            for t in granted.values():
                t.request_stop("receiver connection lost")
            self._admission.remove(conn)
            shutdown_quietly(conn.sock)
            conn.sock.close()

    def _handle_read(self, sock: socket.socket, tid: str, msg: dict, granted: dict[str, Transfer],
                     path: SenderPath, hello: dict) -> None:
        """Grant (or refuse) the ``read`` ``msg`` of the receiver whose handshake was ``hello``; ``path``
        then serves the blocks."""
        cap, blocks = msg.get("cap"), msg.get("blocks", [])
        t = self._table.get(tid)
        reason = None
        if t is None or not auth.capability_ok(t.capability, cap):
            if t is not None:
                logger.warning("refusing a read of %r with a wrong capability from %s", tid, _peer_name(sock))
                t = None
            reason = f"unknown, finished or expired transfer {tid!r}"
        elif t.state != TransferState.WAITING:
            reason = f"transfer {tid!r} was already read"
        else:
            exposed = set(t.block_ids)
            bad = [b for b in blocks if b not in exposed]
            if bad:
                reason = f"blocks {bad[:8]} not exposed for transfer {tid!r}"
            elif len(set(blocks)) != len(blocks):
                reason = "duplicate block ids"
        if reason is None and not t.set_transferring():
            reason = f"transfer {tid!r} is no longer available ({t.error})"
        if reason is not None:
            logger.warning("refusing read: %s", reason)
            send_msg(sock, {"type": "refuse_read", "tid": tid, "reason": reason})
            return
        granted[tid] = t
        ids = [int(b) for b in blocks]
        payload = path.grant_payload(t, ids)
        send_msg(sock, {"type": "grant", "tid": tid, "nbytes": len(ids) * self.region.block_nbytes}, payload)
        path.serve(sock, t, ids, hello, msg)


def _start_thread(thread: threading.Thread) -> None:
    thread.start()


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"

