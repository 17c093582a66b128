"""Sender side of the control protocol, shared by every backend.

One listening socket; one thread per receiver connection. A connection goes:

0. ``auth`` (version, nonce) -> ``challenge`` (our nonce, our HMAC proof); the receiver's proof comes in
   its ``hello`` (see :mod:`kv_transfer.auth`). Until it checks out, messages are capped at
   ``PRE_AUTH_MAX_BYTES`` and nothing about this sender (layout, pool, NIXL metadata) is sent.
1. ``hello`` (proof, version, compat hash, layout, backend) -> ``hello_ok`` (+ backend
   metadata) or ``refuse`` and close: nothing else is possible before this.
2. ``read`` (transfer id, capability, block ids) -> ``grant`` or ``refuse_read``. Only
   blocks passed to :meth:`expect` for that transfer id, once, and only with the
   capability :meth:`expect` issued (a wrong one is refused like an unknown id).
   After ``grant`` the backend moves the data (TCP: streamed on this connection;
   NIXL: the receiver READs the registered memory itself).
3. ``done`` -> the sender's transfer turns DONE, only for a transfer granted on this connection (NIXL
   also answers ``ack``, telling the receiver whether the lease still held during its READ). ``abort``
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
import os
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
from .cuda_ipc import export_region, host_identity
from .layout import PROTOCOL_VERSION, KVLayout
from .memory import KVRegion
from .staging import make_staging
from .state import TransferState
from .tcp_path import serve_blocks
from .tls import wrap_server
from .transfer import Transfer, TransferTable
from .wire import MAX_HEADER, MessageTooLarge, PeerClosed, recv_msg, send_msg, shutdown_quietly, tune_socket

logger = logging.getLogger("pdserve.kv_transfer")


class ControlSender(KVSender):
    """Listener + handshake + leases; subclasses move the bytes."""

    #: Data paths this sender serves, native first. ``"tcp"`` streams on the
    #: control connection; any other mode lets the receiver read the memory on
    #: its own, so its ``done`` is answered with an ``ack`` (did the lease hold?).
    modes: tuple[str, ...] = ("tcp",)

    def __init__(self, kv_cache: Any, layout: KVLayout, config: KVTransferConfig) -> None:
        self.config = config
        self.layout = layout
        self.region = KVRegion.from_buffer(kv_cache, layout)
        #: Host buffers the tcp data path stages device memory through (None: host pool).
        self.staging = make_staging(self.region, config.staging, config.staging_chunk_bytes,
                                    shared=config.staging_shm)
        #: hello_ok fields that let a receiver of this host map the pool (``cuda_ipc`` mode).
        self._ipc_export = self._export_ipc()
        if self._ipc_export is not None:
            self.modes = ("cuda_ipc", *type(self).modes)
        self.instance_id = uuid.uuid4().hex
        self._table = TransferTable(f"send-{self.instance_id[:6]}")
        self._admission = Admission(config)
        self._closed = False
        self._num_auth_failed = 0
        #: A ``read`` names at most every block once: its header needs at most this much.
        self._max_header = MAX_HEADER + self.region.num_blocks * (len(str(self.region.num_blocks)) + 1)
        self._tls = config.tls.context(server_side=True) if config.tls is not None else None
        self._listener = socket.create_server((config.host, config.port), backlog=64)
        self.port = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"kv-accept-{self.port}")
        self._accept_thread.start()

    # -- hooks for backends --------------------------------------------------
    def _hello_extra(self, mode: str) -> tuple[dict, bytes]:
        """Backend fields (and payload) added to ``hello_ok`` for a ``mode`` connection."""
        return {}, b""

    def _grant_payload(self, t: Transfer, block_ids: list[int]) -> bytes:
        """Backend payload of the ``grant`` of ``block_ids`` on a non-tcp, non-cuda_ipc connection."""
        return b""

    def _serve_grant(self, sock: socket.socket, t: Transfer, block_ids: list[int]) -> None:
        """After ``grant`` on a non-tcp connection (the receiver reads by itself)."""

    def _backend_stats(self) -> dict[str, int]:
        return {}

    def _close_backend(self) -> None:
        """Release backend resources (deregister memory)."""

    def _export_ipc(self) -> dict | None:
        if not (self.region.is_cuda and self.config.cuda_ipc) or self.region.sharded:
            return None
        try:
            return export_region(self.region)
        except Exception as e:  # e.g. no libcuda, or memory CUDA IPC cannot share
            logger.info("CUDA IPC unavailable for this pool (%s); peers use the backend's own path", e)
            return None

    # -- public API -----------------------------------------------------------
    def peer_info(self) -> dict[str, Any]:
        return {
            "backend": self.backend_name,
            "modes": list(self.modes),
            "host": self.config.public_host,
            "port": self.port,
            "instance_id": self.instance_id,
            "protocol_version": PROTOCOL_VERSION,
            "compat_hash": self.layout.compat_hash(),
            "tls": self._tls is not None,
            **({"ipc_host": self._ipc_export["ipc_host"]} if self._ipc_export else {}),
        }

    def expect(self, transfer_id: str, block_ids: Sequence[int],
               timeout_s: float | None = None) -> Transfer:
        if self._closed:
            raise RuntimeError("sender is closed")
        ids = self.region.check_ids(block_ids, f"expect({transfer_id!r})")
        t = Transfer(str(transfer_id), "sender", ids,
                     timeout_s if timeout_s is not None else self.config.default_timeout_s,
                     self.config.abort_wait_s, on_finish=self._table.finished)
        t.capability = auth.new_capability()
        self._table.add(t)
        return t

    def stats(self) -> dict[str, int]:
        conns, pre_auth = self._admission.counts()
        return {
            "in_flight": len(self._table),
            "connections": conns,
            "pre_auth_connections": pre_auth,
            "connections_refused": self._admission.num_refused,
            "connections_evicted": self._admission.num_evicted,
            "auth_failed": self._num_auth_failed,
            "bytes_moved": self._table.bytes_moved,
            "transfers_done": self._table.num_done,
            "transfers_failed": self._table.num_failed,
            "registered_regions": 0,
            **(self.staging.stats() if self.staging is not None else {}),
            **self._backend_stats(),
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        shutdown_quietly(self._listener)
        self._listener.close()
        self._accept_thread.join(timeout=2)
        self._table.close("sender closed")
        conns = self._admission.live()
        for conn in conns:
            shutdown_quietly(conn.sock)
        for conn in conns:
            if conn.thread is not None and conn.thread.is_alive():
                conn.thread.join(timeout=2)
        if self.staging is not None:
            self.staging.close()
        self._close_backend()

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
        conn.thread = threading.Thread(target=self._serve_conn, args=(conn,), daemon=True,
                                       name=f"kv-send-conn-{self.port}")
        try:
            tune_socket(sock, self.config.socket_buffer_bytes)
            _start_thread(conn.thread)
        except BaseException:
            self._admission.remove(conn)
            raise

    def _check_hello(self, hello: dict) -> str | None:
        if hello.get("type") != "hello":
            return f"expected hello, got {hello.get('type')!r}"
        if hello.get("version") != PROTOCOL_VERSION:
            return (f"protocol version mismatch: sender speaks {PROTOCOL_VERSION}, "
                    f"receiver {hello.get('version')!r}")
        if hello.get("backend") not in self.modes:
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
        if self._tls is None:
            return conn.sock
        wrapped = wrap_server(self._tls, conn.sock)
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
            mode = hello["backend"]
            extra, payload = (self._ipc_export, b"") if mode == "cuda_ipc" else self._hello_extra(mode)
            # Staged blocks may skip the socket: this host's receivers map our staging buffers.
            shm = (mode == "tcp" and self.staging is not None and self.staging.shared
                   and hello.get("shm_host") == host_identity())
            if shm:
                extra = {**extra, "shm_pid": os.getpid()}
            send_msg(sock, {"type": "hello_ok", "instance_id": self.instance_id,
                            "num_blocks": self.region.num_blocks,
                            "block_nbytes": self.region.block_nbytes, **extra}, payload)
            while True:
                sock.settimeout(self.config.idle_timeout_s)
                msg, _ = recv_msg(sock, self._max_header)
                kind, tid = msg.get("type"), str(msg.get("tid"))
                if kind == "read":
                    self._handle_read(sock, tid, msg.get("cap"), msg.get("blocks", []), granted, mode,
                                      shm and msg.get("shm") is True)
                elif kind == "done":
                    t = granted.pop(tid, None)
                    ok = t is not None and t.succeed(t.granted_nbytes)
                    if mode != "tcp":
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

    def _handle_read(self, sock: socket.socket, tid: str, cap: object, blocks: list,
                     granted: dict[str, Transfer], mode: str, shm: bool = False) -> None:
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
        payload = self._grant_payload(t, ids) if mode not in ("tcp", "cuda_ipc") else b""
        send_msg(sock, {"type": "grant", "tid": tid, "nbytes": len(ids) * self.region.block_nbytes}, payload)
        if mode == "tcp":
            serve_blocks(sock, self.region, t, ids, self.staging, shm)
        elif mode == "cuda_ipc":  # the receiver copies out of its mapping, then says done
            t.granted_nbytes = len(ids) * self.region.block_nbytes
        else:
            self._serve_grant(sock, t, ids)


def _start_thread(thread: threading.Thread) -> None:
    thread.start()


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"

