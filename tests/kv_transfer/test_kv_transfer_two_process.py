"""Two-process tests of every backend: one side in a spawned child, the other here.

Backends: ``tcp``, ``tcp-staged`` (the TCP path through host staging buffers, the
CUDA fallback's pipeline, run here on CPU pools) and ``nixl`` when installed.

Blocks have the SmolLM2-135M KV shape (30 layers, 3 KV heads, head dim 64,
block size 16): 737,280 bytes per block in float32. Every scenario ends with a
leak check on both sides.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kv_transfer import KVLayout, TransferState, make_receiver, make_sender
from kv_transfer.staging import NUM_SHARED_BUFFERS

from .helpers import BACKENDS, HAVE_NIXL, assert_no_leak, cap, label
from .peers import SMOLLM2, block_digest, config_for, make_pool

DONE, FAILED, TRANSFERRING = int(TransferState.DONE), int(TransferState.FAILED), int(TransferState.TRANSFERRING)


def _local(backend, layout, num_blocks=64, seed=2, role="receiver", lib="numpy"):
    pool = make_pool(layout, num_blocks, seed, lib)
    make = make_receiver if role == "receiver" else make_sender
    return pool, make(pool, layout, config_for(backend))


def _close_and_check(side):
    side.close()
    assert_no_leak(side.stats(), closed=True)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _wait_state(t, state, timeout=10.0):
    end = time.monotonic() + timeout
    while t.poll() != state and time.monotonic() < end:
        time.sleep(0.002)
    return t.poll()


@pytest.mark.parametrize("backend", BACKENDS)
def test_blocks_arrive_bit_exact(backend, peers, thread_guard):
    sender = peers("sender", backend, num_blocks=64, seed=1)
    assert sender.backend == label(backend)
    layout = KVLayout(**sender.layout)
    remote_src = make_pool(layout, 64, 1)
    pool, recv = _local(backend, layout)
    rng = np.random.default_rng(7)
    cases = [("contig", list(range(8, 24)), list(range(0, 16))),
             ("single", [63], [5])]
    for i in range(6):  # random non-contiguous subsets into random local slots
        n = int(rng.integers(1, 24))
        cases.append((f"rand{i}", rng.choice(64, n, replace=False).tolist(),
                      rng.choice(64, n, replace=False).tolist()))
    for tid, remote, local in cases:
        before = block_digest(pool, layout.block_nbytes, range(64))
        sender.call("expect", tid, remote, 30)
        t = recv.read(sender.peer_info, tid, remote, local, timeout_s=30, capability=cap(tid))
        assert t.wait(30) == TransferState.DONE, t.error
        assert sender.call("wait", tid, 10) == (DONE, None)
        after = block_digest(pool, layout.block_nbytes, range(64))
        assert [after[b] for b in local] == block_digest(remote_src, layout.block_nbytes, remote)
        untouched = set(range(64)) - set(local)
        assert all(after[b] == before[b] for b in untouched), "a block outside the read changed"
        assert t.bytes_moved == len(remote) * layout.block_nbytes
    moved = sum(len(r) for _, r, _ in cases) * layout.block_nbytes
    assert recv.stats()["bytes_moved"] == moved
    assert sender.call("stats")["bytes_moved"] == moved
    assert_no_leak(recv.stats())
    _close_and_check(recv)
    sender.close_and_check()


@pytest.mark.parametrize("batch_blocks", [1, 3, 1000])
@pytest.mark.parametrize("sender_backend,receiver_backend",
                         [("tcp-staged", "tcp-staged"), ("tcp-staged", "tcp"), ("tcp", "tcp-staged"),
                          ("tcp-staged-socket", "tcp-staged"), ("tcp-staged", "tcp-staged-socket")])
def test_staging_pipeline_bit_exact(sender_backend, receiver_backend, batch_blocks, peers, thread_guard):
    """The staging pipeline (device->buffer->socket, socket->buffer->device; here the
    "device" is host memory) at any batch size, and wire-compatible with a direct peer.
    Two staged sides of this host share the sender's buffers (the blocks skip the socket);
    when either side has that off, the blocks cross the socket."""
    layout = KVLayout(**{**SMOLLM2, "dtype": "bfloat16"})
    chunk = {"staging_chunk_bytes": batch_blocks * layout.block_nbytes + 100}  # rounds down
    sender = peers("sender", sender_backend, num_blocks=48, seed=1, dtype="bfloat16", config=chunk)
    assert sender.backend == label(sender_backend)
    pool = make_pool(layout, 48, 2)
    # The receiver's own chunk differs: with shared buffers it follows the sender's batches.
    recv_chunk = {"staging_chunk_bytes": (batch_blocks % 5 + 2) * layout.block_nbytes}
    recv = make_receiver(pool, layout, config_for(receiver_backend, **recv_chunk))
    src = make_pool(layout, 48, 1)
    rng = np.random.default_rng(batch_blocks)
    cases = [("run", list(range(5, 17)), list(range(30, 42))), ("one", [47], [0])]
    cases += [(f"rand{i}", rng.choice(48, n, replace=False).tolist(), rng.choice(48, n, replace=False).tolist())
              for i, n in enumerate([2, 7, 20, 48])]
    for tid, remote, local in cases:
        before = block_digest(pool, layout.block_nbytes, range(48))
        sender.call("expect", tid, remote, 30)
        t = recv.read(sender.peer_info, tid, remote, local, timeout_s=30, capability=cap(tid))
        assert t.wait(30) == TransferState.DONE, t.error
        assert sender.call("wait", tid, 10) == (DONE, None)
        after = block_digest(pool, layout.block_nbytes, range(48))
        assert [after[b] for b in local] == block_digest(src, layout.block_nbytes, remote), tid
        assert all(after[b] == before[b] for b in set(range(48)) - set(local)), tid
    if receiver_backend.startswith("tcp-staged"):
        assert recv.stats()["staging_sets"] == 1  # one buffer set, reused by every transfer
    # The sender's buffers mapped here only when both sides share them (reused throughout).
    shared = sender_backend == receiver_backend == "tcp-staged"
    assert recv.stats().get("shm_mapped", 0) == (NUM_SHARED_BUFFERS if shared else 0), recv.stats()
    assert_no_leak(recv.stats())
    assert_no_leak(sender.call("stats"))
    _close_and_check(recv)
    sender.close_and_check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_missing_blocks_move_and_unexposed_refused(backend, peers, thread_guard):
    sender = peers("sender", backend, seed=1)
    layout = KVLayout(**sender.layout)
    pool, recv = _local(backend, layout)
    exposed = [10, 11, 12, 13, 14, 15, 16, 17]
    # receiver already has the first five (prefix cache): it asks for the last three only
    sender.call("expect", "req", exposed, 30)
    t = recv.read(sender.peer_info, "req", exposed[5:], [40, 41, 42], timeout_s=30, capability=cap("req"))
    assert t.wait(30) == TransferState.DONE, t.error
    assert sender.call("wait", "req", 10) == (DONE, None)
    assert sender.call("stats")["bytes_moved"] == 3 * layout.block_nbytes
    # a block the sender did not expose for the transfer is refused, nothing moves
    before = block_digest(pool, layout.block_nbytes, [0])
    sender.call("expect", "req2", [1, 2], 30)
    t = recv.read(sender.peer_info, "req2", [3], [0], timeout_s=30, capability=cap("req2"))
    assert t.wait(30) == TransferState.FAILED
    assert "not exposed" in t.error
    assert block_digest(pool, layout.block_nbytes, [0]) == before
    # an empty read is the "I have everything, free it" notification
    t = recv.read(sender.peer_info, "req2", [], [], timeout_s=30, capability=cap("req2"))
    assert t.wait(30) == TransferState.DONE, t.error
    assert sender.call("wait", "req2", 10) == (DONE, None)
    assert recv.stats()["bytes_moved"] == 3 * layout.block_nbytes
    _close_and_check(recv)
    sender.close_and_check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_torch_tensors(backend, peers, thread_guard):
    torch = pytest.importorskip("torch")
    sender = peers("sender", backend, num_blocks=16, seed=3, dtype="bfloat16", lib="torch")
    layout = KVLayout(**sender.layout)
    pool, recv = _local(backend, layout, num_blocks=16, lib="torch")
    assert pool.dtype == torch.bfloat16
    sender.call("expect", "bf", [15, 0, 7], 30)
    t = recv.read(sender.peer_info, "bf", [15, 0, 7], [1, 2, 3], timeout_s=30, capability=cap("bf"))
    assert t.wait(30) == TransferState.DONE, t.error
    src = make_pool(layout, 16, 3, "torch")
    assert torch.equal(pool[1:4].view(torch.int16), src[[15, 0, 7]].view(torch.int16))
    _close_and_check(recv)
    sender.close_and_check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_incompatible_peer_refused(backend, peers, thread_guard):
    sender = peers("sender", backend, seed=1, dtype="bfloat16")
    layout = KVLayout(**{**sender.layout, "dtype": "float32"})
    pool, recv = _local(backend, layout)
    before = block_digest(pool, layout.block_nbytes, range(4))
    sender.call("expect", "x", [0, 1, 2, 3], 30)
    t = recv.read(sender.peer_info, "x", [0, 1, 2, 3], [0, 1, 2, 3], timeout_s=30, capability=cap("x"))
    assert t.wait(30) == TransferState.FAILED
    assert "incompatible KV layout" in t.error and "dtype" in t.error, t.error
    assert block_digest(pool, layout.block_nbytes, range(4)) == before
    assert recv.stats()["bytes_moved"] == 0
    stats = sender.call("stats")
    assert stats["bytes_moved"] == 0 and stats["in_flight"] == 1  # lease untouched
    sender.call("abort", "x")
    assert_no_leak(sender.call("stats"))
    _close_and_check(recv)
    sender.close_and_check()


STALL = {"tcp": "stall_tcp_send", "tcp-staged": "stall_tcp_send", "tcp-staged-socket": "stall_tcp_send",
         "tcp-tls": "stall_tcp_send",
         "nixl": "stall_after_grant"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_killed_mid_transfer(backend, peers, thread_guard):
    sender = peers("sender", backend, seed=1, fault=STALL[backend])
    layout = KVLayout(**sender.layout)
    pool, recv = _local(backend, layout)
    ids = list(range(32))
    sender.call("expect", "k", ids, 30)
    t = recv.read(sender.peer_info, "k", ids, ids, timeout_s=10, capability=cap("k"))
    assert sender.stalled.wait(20)
    assert _wait_state(t, TransferState.TRANSFERRING) == TransferState.TRANSFERRING
    sender.kill()
    start = time.monotonic()
    assert t.wait(15) == TransferState.FAILED
    assert time.monotonic() - start < 5 and time.monotonic() <= t.deadline + 0.5
    assert "lost" in t.error or "closed" in t.error, t.error
    assert_no_leak(recv.stats())
    _close_and_check(recv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stalled_sender_fails_at_deadline(backend, peers, thread_guard):
    sender = peers("sender", backend, seed=1, fault=STALL[backend])
    layout = KVLayout(**sender.layout)
    pool, recv = _local(backend, layout)
    ids = list(range(32))
    sender.call("expect", "s", ids, 30)
    t = recv.read(sender.peer_info, "s", ids, ids, timeout_s=2.0, capability=cap("s"))
    assert sender.stalled.wait(20)
    assert t.wait(10) == TransferState.FAILED
    assert "deadline" in t.error, t.error
    assert t.deadline - 0.05 <= t.finished_at <= t.deadline + 1.0
    assert_no_leak(recv.stats())
    # the sender's lease ends too once it runs again (tcp: the receiver hung up -> FAILED;
    # nixl: the receiver's "done" may already sit in the socket -> DONE); either way it frees
    sender.call("unstall")
    assert sender.call("wait", "s", 10)[0] in (FAILED, DONE)
    _close_and_check(recv)
    sender.close_and_check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_receiver_killed_mid_transfer(backend, peers, thread_guard):
    layout = KVLayout(**{**SMOLLM2, "dtype": "float32"})
    pool, send = _local(backend, layout, seed=1, role="sender")
    recv = peers("receiver", backend, seed=2, fault="stall_in_pull")
    ids = list(range(32))
    t = send.expect("r", ids, timeout_s=10)
    recv.call("read", send.peer_info(), "r", ids, ids, 10, t.capability)
    assert recv.stalled.wait(30)
    assert _wait_state(t, TransferState.TRANSFERRING) == TransferState.TRANSFERRING
    recv.kill()
    start = time.monotonic()
    assert t.wait(15) == TransferState.FAILED
    assert time.monotonic() - start < 5, "sender should notice the dead receiver before the deadline"
    assert_no_leak(send.stats())
    _close_and_check(send)


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_mid_transfer(backend, peers, thread_guard):
    sender = peers("sender", backend, seed=1, fault=STALL[backend])
    layout = KVLayout(**sender.layout)
    pool, recv = _local(backend, layout)
    ids = list(range(32))
    sender.call("expect", "a", ids, 30)
    t = recv.read(sender.peer_info, "a", ids, ids, timeout_s=30, capability=cap("a"))
    assert sender.stalled.wait(20)
    assert _wait_state(t, TransferState.TRANSFERRING) == TransferState.TRANSFERRING
    start = time.monotonic()
    assert t.abort() == TransferState.FAILED
    assert time.monotonic() - start < 1.0
    assert "aborted" in t.error
    assert_no_leak(recv.stats())
    sender.call("unstall")
    state = sender.call("wait", "a", 10)[0]  # the sender's lease ends too (nixl: the
    assert state == FAILED if backend != "nixl" else state in (FAILED, DONE)  # "done" may precede
    assert_no_leak(sender.call("stats"))
    # the link recovers: the next transfer to the same sender works
    sender.call("expect", "b", [1], 30)
    sender.call("unstall")
    t2 = recv.read(sender.peer_info, "b", [1], [1], timeout_s=30, capability=cap("b"))
    assert t2.wait(30) == TransferState.DONE, t2.error
    _close_and_check(recv)
    sender.close_and_check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_abort_and_expiry_refuse_later_reads(backend, peers, thread_guard):
    sender = peers("sender", backend, seed=1)
    layout = KVLayout(**sender.layout)
    pool, recv = _local(backend, layout)
    sender.call("expect", "gone", [1, 2], 30)
    assert sender.call("abort", "gone")[0] == FAILED
    sender.call("expect", "late", [3], 0.2)
    assert sender.call("wait", "late", 5)[0] == FAILED  # lease expired
    for tid in ("gone", "late"):
        t = recv.read(sender.peer_info, tid, [1 if tid == "gone" else 3], [0], timeout_s=30, capability=cap(tid))
        assert t.wait(30) == TransferState.FAILED
        assert "unknown, finished or expired" in t.error
    assert_no_leak(sender.call("stats"))
    _close_and_check(recv)
    sender.close_and_check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_thousand_small_transfers_no_leak(backend, peers, thread_guard):
    sender = peers("sender", backend, num_blocks=32, seed=1, dtype="bfloat16")
    layout = KVLayout(**sender.layout)
    pool, recv = _local(backend, layout, num_blocks=32)
    n = 1000
    sender.call("expect_many", [(f"t{i}", [i % 32]) for i in range(n)], 60)
    start = time.monotonic()
    for i in range(n):
        if i == 100:
            rss_warm = _rss_bytes()
        t = recv.read(sender.peer_info, f"t{i}", [i % 32], [(i * 7) % 32], timeout_s=30, capability=cap(f"t{i}"))
        assert t.wait(30) == TransferState.DONE, t.error
    elapsed = time.monotonic() - start
    assert _rss_bytes() - rss_warm < 16 << 20, "receiver memory grows with transfers"
    states = sender.call("wait_all", 10)
    assert all(s == (DONE, None) for s in states.values()) and len(states) == n
    assert recv.stats()["transfers_done"] == n
    assert recv.stats()["bytes_moved"] == n * layout.block_nbytes
    assert_no_leak(recv.stats())
    assert_no_leak(sender.call("stats"))
    assert elapsed < 30, elapsed
    _close_and_check(recv)
    sender.close_and_check()


@pytest.mark.skipif(not HAVE_NIXL, reason="nixl not installed")
@pytest.mark.parametrize("sender_backend,receiver_backend", [("nixl", "tcp"), ("tcp", "nixl")])
def test_mixed_backends_meet_on_tcp(sender_backend, receiver_backend, peers, thread_guard):
    """A NIXL side and a TCP-only side (e.g. auto fell back on one host) still exchange blocks."""
    sender = peers("sender", sender_backend, num_blocks=16, seed=1)
    layout = KVLayout(**sender.layout)
    pool, recv = _local(receiver_backend, layout, num_blocks=16)
    sender.call("expect", "m", [3, 9, 4], 30)
    t = recv.read(sender.peer_info, "m", [3, 9, 4], [0, 5, 1], timeout_s=30, capability=cap("m"))
    assert t.wait(30) == TransferState.DONE, t.error
    assert sender.call("wait", "m", 10) == (DONE, None)
    assert (block_digest(pool, layout.block_nbytes, [0, 5, 1])
            == block_digest(make_pool(layout, 16, 1), layout.block_nbytes, [3, 9, 4]))
    assert recv.stats().get("remote_agents", 0) == 0  # no NIXL state for a tcp-mode peer
    _close_and_check(recv)
    sender.close_and_check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_queued_reads_and_abort_while_queued(backend, peers, thread_guard):
    """Reads to one sender queue in order; aborting a queued one frees it on both sides."""
    sender = peers("sender", backend, seed=1, fault=STALL[backend])
    layout = KVLayout(**sender.layout)
    pool, recv = _local(backend, layout)
    plans = {f"q{i}": ([2 * i, 2 * i + 1], [40 + 2 * i, 41 + 2 * i]) for i in range(4)}
    sender.call("expect_many", [(tid, remote) for tid, (remote, _) in plans.items()], 30)
    ts = {tid: recv.read(sender.peer_info, tid, remote, local, timeout_s=30, capability=cap(tid))
          for tid, (remote, local) in plans.items()}
    assert sender.stalled.wait(20)  # q0 is held up at the sender; q1..q3 wait behind it
    assert ts["q1"].poll() == TransferState.WAITING
    assert ts["q1"].abort() == TransferState.FAILED
    assert recv.stats()["in_flight"] == 3
    sender.call("unstall")
    for tid in ("q0", "q2", "q3"):
        assert ts[tid].wait(30) == TransferState.DONE, (tid, ts[tid].error)
    states = sender.call("wait_all", 10)
    assert states["q1"][0] == FAILED and "receiver aborted" in states["q1"][1]
    assert all(states[tid] == (DONE, None) for tid in ("q0", "q2", "q3"))
    src = make_pool(layout, 64, 1)
    for tid in ("q0", "q2", "q3"):
        remote, local = plans[tid]
        assert (block_digest(pool, layout.block_nbytes, local)
                == block_digest(src, layout.block_nbytes, remote))
    assert_no_leak(recv.stats())
    _close_and_check(recv)
    sender.close_and_check()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_abort_mid_transfer(backend, peers, thread_guard):
    """The prefill side gives up its lease while the receiver is reading: both end FAILED."""
    sender = peers("sender", backend, seed=1, fault=STALL[backend])
    layout = KVLayout(**sender.layout)
    pool, recv = _local(backend, layout)
    ids = list(range(32))
    sender.call("expect", "sa", ids, 30)
    t = recv.read(sender.peer_info, "sa", ids, ids, timeout_s=30, capability=cap("sa"))
    assert sender.stalled.wait(20)
    assert _wait_state(t, TransferState.TRANSFERRING) == TransferState.TRANSFERRING
    state, error = sender.call("abort", "sa")
    assert state == FAILED and "aborted" in error
    assert_no_leak(sender.call("stats"))
    sender.call("unstall")
    assert t.wait(10) == TransferState.FAILED
    # tcp: the stream is cut; nixl: the READ may finish, but the ack says the lease was gone
    assert ("lost" in t.error) if backend != "nixl" else ("no longer held" in t.error), t.error
    assert_no_leak(recv.stats())
    _close_and_check(recv)
    sender.close_and_check()
