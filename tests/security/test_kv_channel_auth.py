"""The KV control channel against strangers and insiders, over real sockets.

A peer without the cluster secret gets nothing about the sender (no layout, pool size, NIXL
metadata) and reads nothing; a peer with the secret but a stolen transfer id and no capability
reads nothing and cannot end the lease with `abort` or `done`; the pre-auth size cap, the
per-peer connection cap and the idle timeout hold.
"""
from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from kv_transfer import KVLayout, TransferState, make_receiver, make_sender
from kv_transfer import auth as kv_auth
from kv_transfer.layout import PROTOCOL_VERSION
from tests.kv_transfer.helpers import HAVE_NIXL
from tests.kv_transfer.peers import SMOLLM2, block_digest, config_for, make_pool

KEY = b"k" * 32
WRONG = b"w" * 32
LAYOUT = KVLayout(**{**SMOLLM2, "dtype": "float32"})
BACKENDS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not HAVE_NIXL, reason="nixl not installed"))]


def frame(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("!I", len(raw)) + raw


def read_frame(sock: socket.socket) -> dict:
    sock.settimeout(5)
    size = struct.unpack("!I", _exact(sock, 4))[0]
    return json.loads(_exact(sock, size))


def _exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def everything_until_closed(sock: socket.socket, within_s: float = 5.0) -> bytes:
    sock.settimeout(within_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def raw_hello(sock: socket.socket, key: bytes | None, backend: str = "tcp") -> dict:
    """Do the receiver's side of the handshake by hand; returns the sender's answer to the hello."""
    nonce_r = kv_auth.new_nonce()
    sock.sendall(frame({"type": "auth", "version": PROTOCOL_VERSION, "nonce": nonce_r}))
    challenge = read_frame(sock)
    assert challenge["type"] == "challenge"
    proof = kv_auth.proof(key, "receiver", nonce_r, challenge["nonce"]) if key else "0" * 64
    sock.sendall(frame({"type": "hello", "version": PROTOCOL_VERSION, "backend": backend, "proof": proof,
                        "compat_hash": LAYOUT.compat_hash(), "layout": LAYOUT.to_dict()}))
    return read_frame(sock)


@pytest.fixture
def sides(request):
    """sender(backend, key) / receiver(backend, key) factories over fresh pools, closed afterwards."""
    made = []

    def sender(backend: str = "tcp", key: bytes | None = KEY, **config):
        side = make_sender(make_pool(LAYOUT, 16, 1), LAYOUT, config_for(backend, auth_key=key, **config))
        made.append(side)
        return side

    def receiver(backend: str = "tcp", key: bytes | None = KEY, **config):
        pool = make_pool(LAYOUT, 16, 2)
        side = make_receiver(pool, LAYOUT, config_for(backend, auth_key=key, **config))
        side.pool = pool
        made.append(side)
        return side

    yield sender, receiver
    for side in reversed(made):
        side.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_stranger_without_the_secret_learns_nothing(backend, sides):
    make_s, _ = sides
    sender = make_s(backend)
    with socket.create_connection(("127.0.0.1", sender.port), timeout=5) as sock:
        nonce_r = kv_auth.new_nonce()
        sock.sendall(frame({"type": "auth", "version": PROTOCOL_VERSION, "nonce": nonce_r}))
        challenge = read_frame(sock)
        assert set(challenge) == {"type", "nonce", "authenticated", "proof"} and challenge["authenticated"]
        # a guessed proof: refused, and the reply says nothing about us
        sock.sendall(frame({"type": "hello", "version": PROTOCOL_VERSION, "backend": backend, "proof": "0" * 64,
                            "compat_hash": LAYOUT.compat_hash(), "layout": LAYOUT.to_dict()}))
        rest = everything_until_closed(sock)
    assert b"authentication failed" in rest
    for secret in (b"num_blocks", b"block_nbytes", b"agent_name", b"base_addr", b"instance_id",
                   b"float32", LAYOUT.compat_hash().encode()):
        assert secret not in rest, secret
    assert len(rest) < 100, "a refusal carries no payload (no NIXL metadata)"
    assert sender.stats()["auth_failed"] == 1


@pytest.mark.parametrize("receiver_key,why", [(None, "disagree on authentication"),
                                              (WRONG, "failed authentication")])
def test_receiver_without_the_right_secret_reads_nothing(receiver_key, why, sides):
    make_s, make_r = sides
    sender = make_s()
    lease = sender.expect("victim", [1, 2], timeout_s=30)
    stranger = make_r(key=receiver_key)
    t = stranger.read(sender.peer_info(), "victim", [1, 2], [3, 4], timeout_s=5, capability=lease.capability)
    assert t.wait(10) == TransferState.FAILED and why in t.error, t.error
    assert t.bytes_moved == 0 and lease.state == TransferState.WAITING  # the lease survives
    assert block_digest(stranger.pool, LAYOUT.block_nbytes, [3, 4]) != \
        block_digest(make_pool(LAYOUT, 16, 1), LAYOUT.block_nbytes, [1, 2])


def test_a_sender_without_the_secret_is_not_trusted(sides):
    """A fake sender (wrong secret) cannot feed blocks to a receiver: it fails its proof first."""
    make_s, make_r = sides
    fake = make_s(key=WRONG)
    lease = fake.expect("t", [1], timeout_s=30)
    t = make_r().read(fake.peer_info(), "t", [1], [1], timeout_s=5, capability=lease.capability)
    assert t.wait(10) == TransferState.FAILED and "failed authentication" in t.error, t.error


@pytest.mark.parametrize("backend", BACKENDS)
def test_stolen_transfer_id_without_its_capability_reads_nothing(backend, sides):
    make_s, make_r = sides
    sender = make_s(backend)
    lease = sender.expect("victim", [1, 2, 3], timeout_s=30)
    insider = make_r(backend)  # holds the cluster secret, but was not handed this transfer
    for guess in ("", "00" * 16, lease.capability[:-1] + "0" if lease.capability[-1] != "0" else "1"):
        t = insider.read(sender.peer_info(), "victim", [1, 2, 3], [1, 2, 3], timeout_s=5, capability=guess)
        assert t.wait(10) == TransferState.FAILED, t.error
        assert "unknown, finished or expired transfer" in t.error and t.bytes_moved == 0
    assert lease.state == TransferState.WAITING
    intended = make_r(backend)
    t = intended.read(sender.peer_info(), "victim", [1, 2, 3], [5, 6, 7], timeout_s=10, capability=lease.capability)
    assert t.wait(10) == TransferState.DONE, t.error
    assert lease.wait(10) == TransferState.DONE
    assert block_digest(intended.pool, LAYOUT.block_nbytes, [5, 6, 7]) == \
        block_digest(make_pool(LAYOUT, 16, 1), LAYOUT.block_nbytes, [1, 2, 3])
    assert block_digest(insider.pool, LAYOUT.block_nbytes, [1, 2, 3]) == \
        block_digest(make_pool(LAYOUT, 16, 2), LAYOUT.block_nbytes, [1, 2, 3]), "the insider's blocks changed"


def test_foreign_abort_and_done_are_ignored(sides):
    make_s, make_r = sides
    sender = make_s()
    lease = sender.expect("victim", [4], timeout_s=30)
    with socket.create_connection(("127.0.0.1", sender.port), timeout=5) as sock:
        assert raw_hello(sock, KEY)["type"] == "hello_ok"  # an authenticated insider
        sock.sendall(frame({"type": "done", "tid": "victim"}))
        sock.sendall(frame({"type": "abort", "tid": "victim", "cap": "00" * 16}))
        sock.sendall(frame({"type": "abort", "tid": "victim"}))
        time.sleep(0.5)
        assert lease.poll() == TransferState.WAITING, lease.error
    intended = make_r()
    t = intended.read(sender.peer_info(), "victim", [4], [4], timeout_s=10, capability=lease.capability)
    assert t.wait(10) == TransferState.DONE and lease.wait(10) == TransferState.DONE
    # the holder of the capability may abort from any connection (a decode worker giving up before its read)
    other = sender.expect("other", [5], timeout_s=30)
    with socket.create_connection(("127.0.0.1", sender.port), timeout=5) as sock:
        assert raw_hello(sock, KEY)["type"] == "hello_ok"
        sock.sendall(frame({"type": "abort", "tid": "other", "cap": other.capability}))
        assert other.wait(5) == TransferState.FAILED


def test_pre_auth_messages_are_capped_at_4_kib(sides):
    make_s, _ = sides
    sender = make_s()
    with socket.create_connection(("127.0.0.1", sender.port), timeout=5) as sock:
        sock.sendall(struct.pack("!I", kv_auth.PRE_AUTH_MAX_BYTES + 1) + b"{" * 100)
        assert everything_until_closed(sock) == b""
    with socket.create_connection(("127.0.0.1", sender.port), timeout=5) as sock:
        nonce_r = kv_auth.new_nonce()
        sock.sendall(frame({"type": "auth", "version": PROTOCOL_VERSION, "nonce": nonce_r}))
        read_frame(sock)
        big_hello = frame({"type": "hello", "proof": "", "pad": "x" * kv_auth.PRE_AUTH_MAX_BYTES})
        sock.sendall(big_hello)
        assert b"hello_ok" not in everything_until_closed(sock)


def test_per_peer_connection_cap_and_idle_timeout(sides):
    make_s, make_r = sides
    sender = make_s(max_connections_per_peer=2, idle_timeout_s=0.5)
    socks = [socket.create_connection(("127.0.0.1", sender.port), timeout=5) for _ in range(2)]
    for sock in socks:
        assert raw_hello(sock, KEY)["type"] == "hello_ok"
    with socket.create_connection(("127.0.0.1", sender.port), timeout=5) as extra:
        refused = raw_hello(extra, KEY)  # the cap counts proven connections: checked after the proof
        assert refused["type"] == "refuse" and refused["busy"] and "too many connections" in refused["reason"]
    started = time.monotonic()
    for sock in socks:  # silent after the handshake: closed at the idle timeout
        assert everything_until_closed(sock, 5.0) == b""
        sock.close()
    assert time.monotonic() - started < 3.0
    # a receiver's link outlives the sender's idle timeout: it reconnects instead of failing
    receiver = make_r(idle_timeout_s=0.5)
    for tid, block in (("a", 1), ("b", 2)):
        lease = sender.expect(tid, [block], timeout_s=10)
        t = receiver.read(sender.peer_info(), tid, [block], [block], timeout_s=10, capability=lease.capability)
        assert t.wait(10) == TransferState.DONE, t.error
        time.sleep(1.0)
