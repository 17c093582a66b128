"""A stranger on the KV transfer port cannot exhaust the sender: sizes are checked before any
allocation, proven connections are capped, a hello must arrive in time, and the accept loop survives
errors. Raw sockets against a sender in a child process (its RSS read from /proc)."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from kv_transfer import KVLayout, TransferState, make_receiver, make_sender
from kv_transfer.layout import PROTOCOL_VERSION

from .peers import SMOLLM2, block_digest, config_for, make_pool

HUGE = 100_000_000


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def frame(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("!I", len(raw)) + raw


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """True when the peer closes (EOF or reset) within `within_s`, reading whatever it sent first."""
    sock.settimeout(within_s)
    deadline = time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def connect(peer) -> socket.socket:
    return socket.create_connection((peer.peer_info["host"], peer.peer_info["port"]), timeout=5)


def auth_msg() -> bytes:
    """Step 0 of the handshake (what a stranger can send before proving anything)."""
    return frame({"type": "auth", "version": PROTOCOL_VERSION, "nonce": "0" * 32})


def hello(peer) -> bytes:
    """The hello of an unauthenticated cluster (the sender has no key: the proof is empty)."""
    layout = KVLayout(**peer.layout)
    return frame({"type": "hello", "version": PROTOCOL_VERSION, "backend": "tcp", "proof": "",
                  "compat_hash": peer.peer_info["compat_hash"], "layout": layout.to_dict()})


def handshake(sock: socket.socket, peer) -> None:
    """auth -> challenge -> hello, as a receiver without a key does."""
    sock.sendall(auth_msg())
    sock.settimeout(5)
    assert b"challenge" in sock.recv(4096)
    sock.sendall(hello(peer))


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_oversized_messages_refused_without_allocating(peers):
    sender = peers("sender", "tcp", config={"pre_auth_timeout_s": 30.0})
    pid = sender.proc.pid
    before = rss_bytes(pid)
    attacks = {
        "payload before auth": frame({"type": "auth", "payload": HUGE}),  # ~30 bytes
        "header length": struct.pack("!I", (16 << 20) - 1),
        "header over the pre-auth cap": struct.pack("!I", 4097),
        "payload after hello": None,
        "negative payload": frame({"type": "auth", "payload": -1}),
        "not an object": frame([1, 2, 3]),
    }
    for name, data in attacks.items():
        with connect(sender) as sock:
            if data is None:
                handshake(sock, sender)
                data = frame({"type": "read", "tid": "x", "blocks": [], "payload": HUGE})
            sock.sendall(data)
            time.sleep(0.3)
            grown = rss_bytes(pid) - before
            assert grown < 8 << 20, f"{name}: the sender's RSS grew by {grown / 2**20:.0f} MiB"
            assert closed_by_peer(sock, 5.0), f"{name}: the sender kept the connection"
    assert wait_for(lambda: sender.call("stats")["connections"] == 0)
    sender.close_and_check()


def test_connection_cap(peers):
    """``max_connections`` counts proven connections: one more proven peer is refused as busy."""
    sender = peers("sender", "tcp", config={"max_connections": 4, "pre_auth_timeout_s": 30.0})
    idle = [connect(sender) for _ in range(4)]
    for sock in idle:
        handshake(sock, sender)
        assert b"hello_ok" in sock.recv(65536)
    assert wait_for(lambda: sender.call("stats")["connections"] == 4)
    with connect(sender) as extra:
        handshake(extra, sender)
        extra.settimeout(5)
        reply = extra.recv(65536)
        assert b"too many connections" in reply and b'"busy":true' in reply
        assert closed_by_peer(extra, 5.0)
    stats = sender.call("stats")
    assert stats["connections"] == 4 and stats["connections_refused"] == 1
    idle.pop().close()
    assert wait_for(lambda: sender.call("stats")["connections"] == 3)
    with connect(sender) as again:
        handshake(again, sender)
        assert b"hello_ok" in again.recv(65536)
    for sock in idle:
        sock.close()
    assert wait_for(lambda: sender.call("stats")["connections"] == 0)
    sender.close_and_check()


def test_connections_without_a_hello_are_closed(peers):
    sender = peers("sender", "tcp", config={"pre_auth_timeout_s": 1.0})
    silent = connect(sender)
    trickle = connect(sender)
    started = time.monotonic()
    data = auth_msg()
    closed_at = None
    for i in range(len(data)):  # a byte every 0.2 s: each recv is quick, the hello never completes in time
        try:
            trickle.sendall(data[i:i + 1])
            trickle.settimeout(0.2)
            if not trickle.recv(1):
                closed_at = time.monotonic()
        except TimeoutError:
            continue
        except OSError:
            closed_at = time.monotonic()
        if closed_at is not None or time.monotonic() - started > 6.0:
            break
    assert closed_at is not None and closed_at - started < 3.0, "a trickled hello kept the connection open"
    assert closed_by_peer(silent, 3.0)
    silent.close()
    trickle.close()
    assert wait_for(lambda: sender.call("stats")["connections"] == 0)
    sender.close_and_check()


def test_accept_loop_survives_a_thread_that_cannot_start(monkeypatch, thread_guard):
    import kv_transfer.sender as sender_module
    layout = KVLayout(**SMOLLM2, dtype="float32")
    src, dst = make_pool(layout, 8, 1), make_pool(layout, 8, 2)
    real_start = sender_module._start_thread
    failures = []

    def start_once_fails(thread):
        if not failures:
            failures.append(thread)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(sender_module, "_start_thread", start_once_fails)
    sender = make_sender(src, layout, config_for("tcp"))
    receiver = make_receiver(dst, layout, config_for("tcp"))
    try:
        with socket.create_connection(("127.0.0.1", sender.port), timeout=5) as first:
            assert closed_by_peer(first, 5.0)  # its thread never started: closed, not leaked
        assert failures and sender.stats()["connections"] == 0
        lease = sender.expect("t1", [1, 2], timeout_s=10)
        t = receiver.read(sender.peer_info(), "t1", [1, 2], [3, 4], timeout_s=10, capability=lease.capability)
        assert t.wait(10) == TransferState.DONE and lease.wait(10) == TransferState.DONE
        assert block_digest(dst, layout.block_nbytes, [3, 4]) == block_digest(src, layout.block_nbytes, [1, 2])
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("limit", [0, 1024])
def test_receiver_refuses_an_oversized_handshake_payload(limit):
    """The receiver bounds the one payload of the protocol (the sender's hello_ok)."""
    from kv_transfer.wire import MessageTooLarge, recv_msg, send_msg
    a, b = socket.socketpair()
    with a, b:
        send_msg(a, {"type": "hello_ok"}, b"x" * 2048)
        with pytest.raises(MessageTooLarge):
            recv_msg(b, max_payload=limit)
