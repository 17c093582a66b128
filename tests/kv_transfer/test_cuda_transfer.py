"""GPU tests: CUDA KV pools in two processes on one GPU. Skipped without CUDA.

Pools have the Llama-1B KV shape (16 layers, 8 KV heads, head dim 64, block 16,
bfloat16: 512 KiB a block). The sender lives in a spawned child, the receiver
here. Backends: ``cuda-ipc`` (the receiver maps the sender's pool with CUDA IPC and
pulls with one copy kernel), ``tcp`` (on a CUDA pool: the pinned-host staging fallback,
``tcp-staged``, sharing its pinned buffers with the receiver on one host; ``tcp-staged-socket``
through the socket as between hosts) and, when nixl imports, ``nixl`` (VRAM registration; UCX moves
VRAM between the processes with ``cuda_ipc``). Every pull is compared bit for
bit on the GPU with the sender's pool, rebuilt here from its seed.

Run alone: ``python3 -m pytest -p no:cacheprovider tests/kv_transfer/test_cuda_transfer.py``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kv_transfer import KVLayout, KVTransferConfig, TransferState, make_receiver, make_sender
from kv_transfer.staging import NUM_SHARED_BUFFERS

from .helpers import HAVE_NIXL, assert_no_leak, cap
from .peers import config_for, make_pool

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LLAMA_1B = dict(model_id="llama-1b-shape", block_size=16, num_layers=16, num_kv_heads=8, head_dim=64,
                device="cuda")
POOL = 1536
SIZES = [1, 16, 128, 1024]
DONE, FAILED = int(TransferState.DONE), int(TransferState.FAILED)
CUDA_BACKENDS = ["cuda-ipc", "tcp", "tcp-staged-socket",
                 pytest.param("nixl", marks=pytest.mark.skipif(not HAVE_NIXL, reason="nixl not installed"))]
LABEL = {"tcp": "tcp-staged", "nixl": "nixl", "cuda-ipc": "tcp-staged", "tcp-staged-socket": "tcp-staged"}


@pytest.fixture(scope="module", autouse=True)
def _cuda_initialized():
    """Start CUDA (and pinned memory) in this process before any test's leak baseline is taken."""
    torch.zeros(1, device="cuda")
    torch.empty(1, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()


def _layout() -> KVLayout:
    return KVLayout(dtype="bfloat16", **LLAMA_1B)


def _bits(pool, ids: list[int]):
    """The listed blocks as int16 (bf16 bit patterns: NaNs compare equal)."""
    return pool.view(torch.int16)[torch.tensor(ids, device=pool.device)]


def _close_and_check(side) -> None:
    side.close()
    assert_no_leak(side.stats(), closed=True)


@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_cuda_pulls_bit_exact(backend, peers, thread_guard):
    sender = peers("sender", backend, num_blocks=POOL, seed=1, dtype="bfloat16", lib="cuda", **LLAMA_1B)
    assert sender.backend == LABEL[backend]
    layout = _layout()
    assert layout.block_nbytes == 512 * 1024
    pool = make_pool(layout, POOL, 2, "cuda")
    src = make_pool(layout, POOL, 1, "cuda")  # the sender's pool, rebuilt from its seed
    recv = make_receiver(pool, layout, config_for(backend))
    assert recv.backend_name == LABEL[backend] and recv.region.is_cuda
    rng = np.random.default_rng(11)
    cases = [("run16", list(range(100, 116)), list(range(1000, 1016)))]
    cases += [(f"rand{n}", rng.choice(POOL, n, replace=False).tolist(), rng.choice(POOL, n, replace=False).tolist())
              for n in SIZES]
    for tid, remote, local in cases:
        before = pool.clone()
        sender.call("expect", tid, remote, 60)
        start = time.perf_counter()
        t = recv.read(sender.peer_info, tid, remote, local, timeout_s=60, capability=cap(tid))
        assert t.wait(60) == TransferState.DONE, t.error
        elapsed = time.perf_counter() - start
        assert sender.call("wait", tid, 10) == (DONE, None)
        assert torch.equal(_bits(pool, local), _bits(src, remote)), f"{tid}: blocks differ"
        untouched = sorted(set(range(POOL)) - set(local))
        assert torch.equal(_bits(pool, untouched), _bits(before, untouched)), f"{tid}: a block outside the read changed"
        assert t.bytes_moved == len(remote) * layout.block_nbytes
        print(f"{backend} {tid}: {len(remote)} blocks in {elapsed * 1e3:.2f} ms, "
              f"{t.bytes_moved / elapsed / 1e9:.2f} GB/s")
        del before
    # Each backend row moves its blocks on its own path: CUDA IPC only when asked for.
    assert (recv.stats()["cuda_ipc_pulls"] == len(cases)) == (backend == "cuda-ipc"), recv.stats()
    # Staged blocks skip the socket on one host (the sender's pinned buffers mapped here).
    assert recv.stats()["shm_mapped"] == (NUM_SHARED_BUFFERS if backend == "tcp" else 0), recv.stats()
    assert_no_leak(recv.stats())
    assert_no_leak(sender.call("stats"))
    _close_and_check(recv)
    sender.close_and_check()


@pytest.mark.parametrize("role", ["sender", "receiver"])
def test_cuda_auto_never_refuses_a_cuda_pool(role, thread_guard):
    layout = _layout()
    pool = make_pool(layout, 8, 3, "cuda")
    make = make_sender if role == "sender" else make_receiver
    side = make(pool, layout, KVTransferConfig(backend="auto"))
    try:
        info = side.backend_info()
        print(f"auto on a CUDA pool ({role}): {side.selection}")
        assert info["reason"]
        if HAVE_NIXL:
            assert info["backend"] in ("nixl", "tcp-staged")
        else:
            assert info["backend"] == "tcp-staged" and "nixl unavailable" in info["reason"]
        if info["backend"] == "tcp-staged":
            assert "CUDA KV moves through pinned host staging buffers" in info["reason"]
    finally:
        _close_and_check(side)


def test_cuda_staged_abort_mid_pull_then_link_recovers(peers, thread_guard):
    sender = peers("sender", "tcp", num_blocks=128, seed=1, dtype="bfloat16", lib="cuda",
                   fault="stall_tcp_send", **LLAMA_1B)
    layout = _layout()
    pool = make_pool(layout, 128, 2, "cuda")
    recv = make_receiver(pool, layout, KVTransferConfig(backend="tcp"))
    ids = list(range(64))
    sender.call("expect", "a", ids, 60)
    t = recv.read(sender.peer_info, "a", ids, ids, timeout_s=60, capability=cap("a"))
    assert sender.stalled.wait(60)
    end = time.monotonic() + 10
    while t.poll() != TransferState.TRANSFERRING and time.monotonic() < end:
        time.sleep(0.002)
    start = time.monotonic()
    assert t.abort() == TransferState.FAILED
    assert time.monotonic() - start < 1.0 and "aborted" in t.error
    assert_no_leak(recv.stats())  # staging buffers given back, no copy in flight
    sender.call("unstall")
    assert sender.call("wait", "a", 10)[0] == FAILED
    src = make_pool(layout, 128, 1, "cuda")
    sender.call("expect", "b", [70, 3, 99], 60)
    t2 = recv.read(sender.peer_info, "b", [70, 3, 99], [5, 6, 100], timeout_s=60, capability=cap("b"))
    assert t2.wait(60) == TransferState.DONE, t2.error
    assert torch.equal(_bits(pool, [5, 6, 100]), _bits(src, [70, 3, 99]))
    _close_and_check(recv)
    sender.close_and_check()


@pytest.mark.skipif(not HAVE_NIXL, reason="nixl not installed")
def test_cuda_nixl_sender_serves_a_staged_receiver(peers, thread_guard):
    """A GPU worker whose auto fell back to staging still pulls from a NIXL prefill worker."""
    sender = peers("sender", "nixl", num_blocks=64, seed=1, dtype="bfloat16", lib="cuda", **LLAMA_1B)
    layout = _layout()
    pool = make_pool(layout, 64, 2, "cuda")
    recv = make_receiver(pool, layout, KVTransferConfig(backend="tcp"))
    remote, local = [3, 40, 41, 42, 7], [0, 1, 2, 60, 30]
    sender.call("expect", "m", remote, 60)
    t = recv.read(sender.peer_info, "m", remote, local, timeout_s=60, capability=cap("m"))
    assert t.wait(60) == TransferState.DONE, t.error
    assert sender.call("wait", "m", 10) == (DONE, None)
    assert torch.equal(_bits(pool, local), _bits(make_pool(layout, 64, 1, "cuda"), remote))
    _close_and_check(recv)
    sender.close_and_check()


def test_cpu_and_cuda_pools_refuse_each_other(thread_guard):
    layout = _layout()
    cpu_layout = KVLayout(**{**layout.to_dict(), "device": "cpu"})
    cpu_pool = make_pool(cpu_layout, 4, 1, "torch")
    cuda_pool = make_pool(layout, 4, 2, "cuda")
    before = cuda_pool.clone()
    with make_sender(cpu_pool, cpu_layout, KVTransferConfig(backend="tcp")) as s, \
            make_receiver(cuda_pool, layout, KVTransferConfig(backend="tcp")) as r:
        lease = s.expect("x", [0])
        t = r.read(s.peer_info(), "x", [0], [0], timeout_s=10, capability=lease.capability)
        assert t.wait(10) == TransferState.FAILED
        assert "incompatible KV layout (differs in: device)" in t.error, t.error  # names the field, not our value
    assert torch.equal(cuda_pool.view(torch.int16), before.view(torch.int16))
