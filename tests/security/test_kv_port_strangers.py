"""Strangers on a prefill worker's KV control port cannot keep a proven decode side out (issue 35, row 4).

Before: 64 idle connections from one address (or 256 spread over several) filled the sender's
per-peer and global caps, which counted connections that had proven nothing; the real decode worker
was refused and recomputed the prompt. Now connections that have not proven the cluster key sit in a
bounded pre-auth pool of their own (a newcomer drops the oldest connection of the busiest address),
must prove the key within ``pre_auth_timeout_s``, and a receiver whose handshake is cut or answered
``busy`` tries again. Real sockets, a cluster secret, senders in processes of their own for the
timing (as in a cluster) and in this one for the rest.
"""
from __future__ import annotations

import socket
import statistics
import threading
import time

import pytest

from kv_transfer import KVLayout, KVTransferConfig, TransferState, make_receiver, make_sender
from kv_transfer.admission import Admission
from tests.kv_transfer.helpers import Peer
from tests.kv_transfer.peers import SMOLLM2, block_digest, config_for, make_pool
from tests.security.test_kv_channel_auth import everything_until_closed, raw_hello

KEY = b"k" * 32
LAYOUT = KVLayout(**{**SMOLLM2, "dtype": "float32"})
STRANGER_HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
NUM_STRANGERS = 256
PULL_BLOCKS = 16  # 12 MiB a pull: a few ms, so many alternating pulls fit in a second
PULLS = 60
#: The issue's bound: with strangers a pull is at most 20% slower (the median, over PULLS rounds, of
#: the ratio of the attacked pull to the quiet pull run next to it).
SLACK = 1.20


def wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def num_threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def stranger(port: int, source: str) -> socket.socket:
    """An idle TCP connection to the KV port from ``source`` (any 127.0.0.x is ours on Linux loopback)."""
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


def open_strangers(port: int, n: int) -> list[socket.socket]:
    return [stranger(port, STRANGER_HOSTS[i % len(STRANGER_HOSTS)]) for i in range(n)]


def timed_pull(sender: Peer, dst, tid: str) -> float:
    """Seconds from ``read`` to DONE of a pull of PULL_BLOCKS by a fresh receiver (so every pull
    connects and runs the HMAC handshake, as a decode worker's first pull from a prefill worker does)."""
    receiver = make_receiver(dst, LAYOUT, config_for("tcp", auth_key=KEY))
    try:
        ids = list(range(PULL_BLOCKS))
        capability = sender.call("expect", tid, ids, 30.0)[tid]
        started = time.monotonic()
        t = receiver.read(sender.peer_info, tid, ids, ids, timeout_s=20, capability=capability)
        assert t.wait(20) == TransferState.DONE, t.error
        took = time.monotonic() - started
        assert receiver.stats()["handshake_retries"] == 0, "got in at the first try"
        return took
    finally:
        receiver.close()


@pytest.fixture
def cleanup():
    """Calls what the test registers (``side.close``, ``peer.kill``, ...) at the end, last first."""
    calls: list = []
    yield calls.append
    for call in reversed(calls):
        call()


def test_256_idle_strangers_leave_a_proven_pull_as_fast_as_before(cleanup):
    # Two identical prefill-side senders, each in a process of its own as in a cluster; one gets the
    # strangers. Pulls alternate between them (either first as often), so a change of load on this
    # shared machine hits both series alike. The pre-auth deadline is long here so the strangers stay
    # for the whole measurement (the deadline has its own test below).
    config = {"auth_key": KEY, "pre_auth_timeout_s": 120.0}
    quiet, attacked = (Peer("sender", "tcp", num_blocks=PULL_BLOCKS, seed=1, config=config) for _ in range(2))
    cleanup(quiet.kill)
    cleanup(attacked.kill)
    pool = KVTransferConfig().max_pre_auth_connections
    # Each pull starts on a settled sender: the last pull's connection thread gone and a refilled
    # stranger's thread started, i.e. the sender process runs its threads at rest (checked: no thread is
    # made lazily by a pull) plus one per stranger in the pre-auth pool.
    settled = {quiet: num_threads(quiet.proc.pid), attacked: num_threads(attacked.proc.pid) + pool}
    dst = make_pool(LAYOUT, PULL_BLOCKS, 2)
    timed_pull(quiet, dst, "warm-q")
    timed_pull(attacked, dst, "warm-a")

    def stats() -> dict:
        return attacked.call("stats")

    port = attacked.peer_info["port"]
    for sock in open_strangers(port, NUM_STRANGERS):
        cleanup(sock.close)
    assert wait_for(lambda: stats()["connections_evicted"] == NUM_STRANGERS - pool)
    assert stats()["pre_auth_connections"] == pool

    before, during = [], []
    for i in range(PULLS):
        if stats()["pre_auth_connections"] < pool:  # the last pull took a stranger's slot: refill it
            cleanup(stranger(port, STRANGER_HOSTS[i % len(STRANGER_HOSTS)]).close)
            assert wait_for(lambda: stats()["pre_auth_connections"] == pool)
        evicted = stats()["connections_evicted"]
        for side in (quiet, attacked) if i % 2 else (attacked, quiet):
            assert wait_for(lambda side=side: num_threads(side.proc.pid) == settled[side])
            (during if side is attacked else before).append(timed_pull(side, dst, f"{i}-{id(side)}"))
        assert stats()["connections_evicted"] == evicted + 1, "the pull displaced exactly one stranger"
    assert block_digest(dst, LAYOUT.block_nbytes, range(PULL_BLOCKS)) == \
        block_digest(make_pool(LAYOUT, PULL_BLOCKS, 1), LAYOUT.block_nbytes, range(PULL_BLOCKS))
    final = stats()
    assert final["connections_refused"] == 0 and final["auth_failed"] == 0
    # Pulls of one round ran back to back, so their ratio cancels the load of the moment; its median
    # over the rounds must stay within the 20%.
    paired = statistics.median(a / q for a, q in zip(during, before, strict=True))
    quiet_ms, attacked_ms = statistics.median(before) * 1e3, statistics.median(during) * 1e3
    print(f"median pull of {PULL_BLOCKS} blocks: {quiet_ms:.2f} ms quiet, {attacked_ms:.2f} ms with {NUM_STRANGERS} "
          f"strangers ({final['connections_evicted']} evicted); median of paired ratios {paired:.3f}")
    assert paired <= SLACK, (before, during)


def test_pre_auth_pool_drops_the_oldest_of_the_busiest_address():
    """Unit level (real socket pairs): who is dropped, and what proven connections count against."""
    admission = Admission(KVTransferConfig(max_pre_auth_connections=3, max_connections=2,
                                           max_connections_per_peer=1))
    pairs = [socket.socketpair() for _ in range(6)]
    ours = [p[0] for p in pairs]
    try:
        a, b, c = (admission.admit(ours[i], peer) for i, peer in enumerate(("10.0.0.2", "10.0.0.2", "10.0.0.3")))
        assert admission.counts() == (3, 3) and admission.num_evicted == 0
        d = admission.admit(ours[3], "10.0.0.4")  # full: the oldest of 10.0.0.2 (two in the pool) goes
        assert admission.num_evicted == 1 and a.dropped and not (b.dropped or c.dropped)
        assert everything_until_closed(pairs[0][1], 2.0) == b"", "its socket is shut down"
        assert admission.promote(a) is not None, "a dropped connection cannot be promoted"
        admission.remove(a)
        e = admission.admit(ours[4], "10.0.0.5")  # one each: the oldest overall (b) goes
        assert admission.num_evicted == 2 and everything_until_closed(pairs[1][1], 2.0) == b""
        admission.remove(b)
        assert admission.promote(c) is None and admission.promote(d) is None
        assert "per peer" not in admission.promote(e)  # two proven already: the global cap
        admission.remove(d)  # one proven slot free again
        f = admission.admit(ours[5], "10.0.0.3")
        assert "per peer" in admission.promote(f)  # 10.0.0.3 holds its one proven connection (c)
        assert admission.num_refused == 2 and admission.is_proven(c) and not admission.is_proven(f)
        for conn in (c, e, f):
            admission.remove(conn)
        assert admission.counts() == (0, 0)
    finally:
        for x, y in pairs:
            x.close()
            y.close()


def test_a_stranger_is_cut_at_the_pre_auth_deadline_and_a_proven_peer_is_not(cleanup):
    sender = make_sender(make_pool(LAYOUT, 4, 1), LAYOUT, config_for("tcp", auth_key=KEY))  # default deadline
    cleanup(sender.close)
    deadline = sender.config.pre_auth_timeout_s
    assert deadline <= 3.0
    proven = socket.create_connection(("127.0.0.1", sender.port), timeout=5)
    cleanup(proven.close)
    assert raw_hello(proven, KEY)["type"] == "hello_ok"
    silent = stranger(sender.port, "127.0.0.2")
    cleanup(silent.close)
    started = time.monotonic()
    assert everything_until_closed(silent, deadline + 5.0) == b""
    took = time.monotonic() - started
    # Stated slack: 1.5 s over the deadline for a busy 2-core machine.
    assert took < deadline + 1.5, f"a stranger was held {took:.2f}s (deadline {deadline}s)"
    assert wait_for(lambda: sender.stats()["pre_auth_connections"] == 0)
    assert sender.stats()["connections"] == 1, "the proven connection outlives the pre-auth deadline"
    proven.settimeout(0.2)
    with pytest.raises(TimeoutError):
        proven.recv(1)  # still open, nothing to read


def test_a_busy_refusal_is_tried_again(cleanup):
    """The sender answers ``busy`` (its one proven slot taken); the slot frees; the retry pulls."""
    src, dst = make_pool(LAYOUT, 4, 1), make_pool(LAYOUT, 4, 2)
    sender = make_sender(src, LAYOUT, config_for("tcp", auth_key=KEY, max_connections=1))
    cleanup(sender.close)
    holder = socket.create_connection(("127.0.0.1", sender.port), timeout=5)
    cleanup(holder.close)
    assert raw_hello(holder, KEY)["type"] == "hello_ok"

    impatient = make_receiver(make_pool(LAYOUT, 4, 3), LAYOUT, config_for("tcp", auth_key=KEY, connect_attempts=1))
    cleanup(impatient.close)
    lease = sender.expect("t0", [1], timeout_s=30)
    t = impatient.read(sender.peer_info(), "t0", [1], [1], timeout_s=10, capability=lease.capability)
    assert t.wait(10) == TransferState.FAILED and "sender busy" in t.error, t.error  # no retry: failed

    # 6 attempts (pauses 0.05 .. 0.8 s, 1.55 s in all): room for this busy machine to free the slot
    receiver = make_receiver(dst, LAYOUT, config_for("tcp", auth_key=KEY, connect_attempts=6))
    cleanup(receiver.close)
    lease = sender.expect("t1", [1, 2], timeout_s=30)
    t = receiver.read(sender.peer_info(), "t1", [1, 2], [1, 2], timeout_s=10, capability=lease.capability)
    assert wait_for(lambda: sender.stats()["connections_refused"] == 2), t.error
    holder.close()
    assert t.wait(10) == TransferState.DONE, t.error
    assert receiver.stats()["handshake_retries"] >= 1
    assert block_digest(dst, LAYOUT.block_nbytes, [1, 2]) == block_digest(src, LAYOUT.block_nbytes, [1, 2])


@pytest.mark.parametrize("attempts", [1, None])
def test_a_cut_handshake_is_tried_again(attempts, cleanup):
    """A relay in front of the sender closes the first connection at once (as an eviction or a
    restart would): with retries (the default) the second handshake gets through, without them the
    pull fails."""
    src, dst = make_pool(LAYOUT, 4, 1), make_pool(LAYOUT, 4, 2)
    sender = make_sender(src, LAYOUT, config_for("tcp", auth_key=KEY))
    cleanup(sender.close)
    relay = CutOnce(sender.port)
    cleanup(relay.close)
    overrides = {} if attempts is None else {"connect_attempts": attempts}
    receiver = make_receiver(dst, LAYOUT, config_for("tcp", auth_key=KEY, **overrides))
    cleanup(receiver.close)
    lease = sender.expect("t", [1, 2], timeout_s=30)
    t = receiver.read({**sender.peer_info(), "port": relay.port}, "t", [1, 2], [1, 2], timeout_s=10,
                      capability=lease.capability)
    if attempts == 1:
        assert t.wait(10) == TransferState.FAILED and "cut the handshake" in t.error, t.error
        return
    assert t.wait(10) == TransferState.DONE, t.error
    assert relay.num_cut == 1 and receiver.stats()["handshake_retries"] == 1
    assert block_digest(dst, LAYOUT.block_nbytes, [1, 2]) == block_digest(src, LAYOUT.block_nbytes, [1, 2])


class CutOnce:
    """A TCP relay to ``port`` that closes its first connection at once and relays the others."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.num_cut = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._socks.append(client)
            if self.num_cut == 0:
                self.num_cut += 1
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            self._socks.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._listener.close()
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    src.settimeout(None)
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
