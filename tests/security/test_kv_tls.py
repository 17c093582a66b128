"""Mutual TLS on the KV control channel and TCP data path, over real sockets.

Through a recording proxy the blocks' bytes cross the wire in clear without TLS and never with
it; a receiver without TLS, one with a certificate of another CA and a plaintext stranger are
refused at the handshake, get nothing readable, and the sender keeps serving its good peers.
"""
from __future__ import annotations

import socket
import threading

import pytest

from kv_transfer import KVLayout, KVTLSFiles, TransferState, make_receiver, make_sender
from kv_transfer.layout import PROTOCOL_VERSION
from tests.kv_transfer.peers import SMOLLM2, config_for, kv_tls_files, make_pool
from tests.security.test_kv_channel_auth import everything_until_closed, frame

KEY = b"k" * 32
LAYOUT = KVLayout(**{**SMOLLM2, "dtype": "float32"})


class RecordingProxy:
    """Forwards one TCP port to another and keeps every byte the sender side sends back."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.from_target = bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.from_target), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        try:
            while data := src.recv(1 << 16):
                if record is not None:
                    record.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def sides():
    made = []

    def make(role: str, backend: str = "tcp-tls", seed: int = 1, **config):
        pool = make_pool(LAYOUT, 16, seed)
        factory = make_sender if role == "sender" else make_receiver
        side = factory(pool, LAYOUT, config_for(backend, auth_key=KEY, **config))
        side.pool = pool
        made.append(side)
        return side

    yield make
    for side in reversed(made):
        side.close()


def _read_via_proxy(sender, receiver, tid: str) -> tuple[TransferState, bytes]:
    proxy = RecordingProxy(sender.port)
    try:
        t = sender.expect(tid, [3, 4])
        info = {**sender.peer_info(), "port": proxy.port}
        r = receiver.read(info, tid, [3, 4], [0, 1], timeout_s=20, capability=t.capability)
        return r.wait(20), bytes(proxy.from_target)
    finally:
        proxy.close()


@pytest.mark.parametrize("backend", ["tcp", "tcp-tls"])
def test_blocks_cross_the_wire_encrypted_only_with_tls(backend, sides):
    sender, receiver = sides("sender", backend), sides("receiver", backend, seed=2)
    state, wire = _read_via_proxy(sender, receiver, "t1")
    assert state == TransferState.DONE
    views = sender.region.block_views([3])
    needle = bytes(views[0][:4096])  # 4 KiB of random bits from block 3
    assert len(wire) > 2 * LAYOUT.block_nbytes
    if backend == "tcp":
        assert needle in wire  # the control: a plaintext link carries the block as it is
    else:
        assert needle not in wire
        assert b"grant" not in wire and b"hello_ok" not in wire  # the control messages are hidden too
    assert receiver.region.block_views([0])[0].tobytes()[:4096] == needle


def test_receiver_without_tls_is_refused_and_learns_nothing(sides):
    sender = sides("sender")
    plain = sides("receiver", backend="tcp", seed=2)
    t = sender.expect("t2", [1])
    r = plain.read(sender.peer_info(), "t2", [1], [1], timeout_s=10, capability=t.capability)
    assert r.wait(10) == TransferState.FAILED and "requires TLS" in r.error
    # one that ignores what the handle says gets nothing readable: the sender wants a TLS hello
    with socket.create_connection(("127.0.0.1", sender.port), timeout=5) as sock:
        sock.sendall(frame({"type": "auth", "version": PROTOCOL_VERSION, "nonce": "0" * 32}))
        answer = everything_until_closed(sock)
    assert b"challenge" not in answer and b"nonce" not in answer
    # the sender still serves a good receiver, the same transfer
    good = sides("receiver", seed=2)
    r = good.read(sender.peer_info(), "t2", [1], [1], timeout_s=10, capability=t.capability)
    assert r.wait(10) == TransferState.DONE, r.error


def test_certificate_of_another_ca_is_refused(sides):
    sender = sides("sender")
    stranger = sides("receiver", seed=2, tls=KVTLSFiles(*kv_tls_files("stranger", ca="other-ca")))
    t = sender.expect("t3", [2])
    r = stranger.read(sender.peer_info(), "t3", [2], [2], timeout_s=10, capability=t.capability)
    assert r.wait(10) == TransferState.FAILED and "cannot connect" in r.error
    assert sender.stats()["transfers_done"] == 0
    good = sides("receiver", seed=2)
    r = good.read(sender.peer_info(), "t3", [2], [2], timeout_s=10, capability=t.capability)
    assert r.wait(10) == TransferState.DONE, r.error


def test_tls_receiver_refuses_a_plaintext_sender(sides):
    tls_receiver = sides("receiver", seed=2)
    plain_sender = sides("sender", backend="tcp")
    t = plain_sender.expect("t4", [1])
    r = tls_receiver.read(plain_sender.peer_info(), "t4", [1], [1], timeout_s=10, capability=t.capability)
    assert r.wait(10) == TransferState.FAILED and "does not speak it" in r.error
