"""In-process tests of the pieces: config, layout hash, state machine, validation,
backend selection and sender restart. Fast; the data path is covered by
test_kv_transfer_two_process.py."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import threading
import time

import numpy as np
import pytest

from kv_transfer import (
    BackendUnavailableError,
    KVLayout,
    KVTransferConfig,
    Transfer,
    TransferState,
    make_receiver,
    make_sender,
)
from kv_transfer.copiers import split_batches
from kv_transfer.factory import select_backend
from kv_transfer.staging import NUM_SHARED_BUFFERS

from .helpers import BACKENDS, HAVE_NIXL, assert_no_leak
from .peers import SMOLLM2, config_for, make_pool

LAYOUT = KVLayout(dtype="float32", **SMOLLM2)
if importlib.util.find_spec("torch") is not None:
    import torch as _torch
    if not _torch.cuda.is_available():  # the staging gather kernel runs under Triton's interpreter
        os.environ["TRITON_INTERPRET"] = "1"


def test_states_are_ordered():
    assert TransferState.FAILED < TransferState.WAITING < TransferState.TRANSFERRING < TransferState.DONE
    assert min(TransferState.DONE, TransferState.FAILED) == TransferState.FAILED


def test_config_validated():
    with pytest.raises(ValueError):
        KVTransferConfig(backend="rdma")
    with pytest.raises(ValueError):
        KVTransferConfig(port=70000)
    with pytest.raises(ValueError):
        KVTransferConfig(default_timeout_s=0)
    assert KVTransferConfig(host="0.0.0.0").public_host not in ("0.0.0.0", "")
    assert KVTransferConfig(host="0.0.0.0", advertise_host="pod-1").public_host == "pod-1"


def test_layout_hash_covers_every_field():
    assert LAYOUT.block_nbytes == 30 * 2 * 16 * 3 * 64 * 4
    base = LAYOUT.compat_hash()
    assert base == KVLayout(dtype="float32", **SMOLLM2).compat_hash()
    for field, value in [("model_id", "other"), ("dtype", "bfloat16"), ("block_size", 32),
                         ("num_layers", 29), ("num_kv_heads", 2), ("head_dim", 128), ("device", "cuda"),
                         ("kv_scales", "0123456789abcdef")]:
        other = KVLayout(**{**LAYOUT.to_dict(), field: value})
        assert other.compat_hash() != base, field
        assert field in LAYOUT.describe_mismatch(other)
    with pytest.raises(ValueError):
        KVLayout(**{**LAYOUT.to_dict(), "layout": "layer_major"})
    with pytest.raises(ValueError):
        KVLayout(**{**LAYOUT.to_dict(), "device": "mps"})


def test_layout_of_engine_kv_cache():
    torch = pytest.importorskip("torch")
    kv = torch.zeros((5, 30, 2, 16, 3, 64), dtype=torch.bfloat16)
    layout = KVLayout.of_kv_cache(kv, SMOLLM2["model_id"])
    assert layout == KVLayout(dtype="bfloat16", **SMOLLM2)
    assert KVLayout.of_kv_cache(np.zeros((1, 30, 2, 16, 3, 64), np.float32), "m").dtype == "float32"
    assert layout.device == "cpu"
    with pytest.raises(ValueError):
        KVLayout.of_kv_cache(torch.zeros((5, 30, 16, 3, 64)), "m")


def test_fp8_layout_has_half_of_bf16_bytes_and_its_scales():
    torch = pytest.importorskip("torch")
    kv = torch.zeros((5, 30, 2, 16, 3, 64), dtype=torch.float8_e4m3fn)
    ones, halves = [(1.0, 1.0)] * 30, [(0.5, 1.0)] * 30
    fp8 = KVLayout.of_kv_cache(kv, "m", ones)
    assert fp8.dtype == "float8_e4m3fn" and fp8.kv_scales
    assert 2 * fp8.block_nbytes == KVLayout(**{**fp8.to_dict(), "dtype": "bfloat16"}).block_nbytes
    assert fp8 == KVLayout.of_kv_cache(kv, "m", list(ones))  # the digest is of the values
    assert fp8.mismatched_fields(KVLayout.of_kv_cache(kv, "m", halves)) == ["kv_scales"]


def test_transfer_moves_forward_only():
    t = Transfer("t", "receiver", [1], timeout_s=10)
    assert t.poll() == TransferState.WAITING
    assert t.set_transferring() and t.poll() == TransferState.TRANSFERRING
    assert t.succeed(5) and t.poll() == TransferState.DONE
    assert not t.fail("late") and t.state == TransferState.DONE and t.bytes_moved == 5
    t = Transfer("t", "receiver", [1], timeout_s=0.05)
    time.sleep(0.06)
    assert t.poll() == TransferState.FAILED and "deadline" in t.error
    t = Transfer("t", "receiver", [1], timeout_s=10)
    assert t.begin_io()
    t.abort_wait_s = 0
    t.request_stop("abort")  # busy: stays non-terminal until the backend lets go
    assert t.state == TransferState.WAITING
    t.end_io()
    assert t.state == TransferState.FAILED and t.error == "abort"


def test_kv_buffer_validation():
    with pytest.raises(ValueError, match="shape"):
        make_sender(np.zeros((4, 30, 2, 16, 3, 32), np.float32), LAYOUT, KVTransferConfig(backend="tcp"))
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="dtype"):
        make_sender(torch.zeros(LAYOUT.shape(2), dtype=torch.bfloat16), LAYOUT,
                    KVTransferConfig(backend="tcp"))
    with pytest.raises(ValueError, match="layout says device 'cuda'"):
        make_sender(torch.zeros(LAYOUT.shape(2)), KVLayout(**{**LAYOUT.to_dict(), "device": "cuda"}),
                    KVTransferConfig(backend="tcp"))
    with pytest.raises(ValueError, match="contiguous"):
        make_sender(torch.zeros(LAYOUT.shape(4)).transpose(0, 1).contiguous().transpose(0, 1)[:2],
                    LAYOUT, KVTransferConfig(backend="tcp"))


def test_read_argument_validation(thread_guard):
    with make_receiver(np.zeros(LAYOUT.shape(4), np.float32), LAYOUT, KVTransferConfig(backend="tcp")) as r:
        info = {"backend": "tcp", "host": "127.0.0.1", "port": 1}
        with pytest.raises(ValueError, match="out of range"):
            r.read(info, "x", [0], [4])
        with pytest.raises(ValueError, match="duplicate"):
            r.read(info, "x", [0, 1], [2, 2])
        with pytest.raises(ValueError, match="remote block ids but"):
            r.read(info, "x", [0, 1], [2])
        with pytest.raises(ValueError, match="no common data path"):
            r.read({**info, "backend": "nixl", "modes": ["nixl"]}, "x", [0], [0])
        assert_no_leak(r.stats())


def test_auto_selection_is_logged(caplog, thread_guard):
    caplog.set_level(logging.INFO, logger="pdserve.kv_transfer")
    pool = np.zeros(LAYOUT.shape(2), np.float32)
    with make_sender(pool, LAYOUT, KVTransferConfig(backend="auto")) as s:
        expected = "nixl" if HAVE_NIXL else "tcp"
        assert s.backend_name == expected
        assert "self-test" in s.selection if HAVE_NIXL else "unavailable" in s.selection
    assert any(f"backend {expected}" in r.getMessage() for r in caplog.records)
    assert_no_leak(s.stats(), closed=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_restart_drops_stale_peer(backend, thread_guard):
    """Same address, new sender instance: old handle refused, new one works, old agent dropped."""
    cfg = config_for(backend)
    src, dst = make_pool(LAYOUT, 4, 1), make_pool(LAYOUT, 4, 2)
    r = make_receiver(dst, LAYOUT, cfg)
    s1 = make_sender(src, LAYOUT, cfg)
    port = s1.port
    lease = s1.expect("a", [0])
    assert r.read(s1.peer_info(), "a", [0], [0], capability=lease.capability).wait(30) == TransferState.DONE
    old_info = s1.peer_info()
    s1.close()
    s2 = make_sender(src, LAYOUT, config_for(backend, port=port))
    lease = s2.expect("b", [1])
    t = r.read(old_info, "b", [1], [1], timeout_s=10, capability=lease.capability)
    assert t.wait(10) == TransferState.FAILED  # stale handle: never silently served by s2
    t = r.read(s2.peer_info(), "b", [1], [1], timeout_s=10, capability=lease.capability)
    assert t.wait(30) == TransferState.DONE, t.error
    assert dst[1].tobytes() == src[1].tobytes()
    stats = r.stats()
    assert stats["links"] == 1 and stats.get("remote_agents", 1) == 1, stats
    for side in (r, s2):
        side.close()
        assert_no_leak(side.stats(), closed=True)


@pytest.mark.skipif(not HAVE_NIXL, reason="nixl not installed")
def test_auto_falls_back_to_tcp_when_self_test_fails(monkeypatch, caplog, thread_guard):
    import kv_transfer.nixl_agent as na
    built = []
    orig_init = na.NixlAgent.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        built.append(self)

    def broken_self_test(self):
        raise RuntimeError("loopback transfer ended in state ERR")
    monkeypatch.setattr(na.NixlAgent, "__init__", init)
    monkeypatch.setattr(na.NixlAgent, "self_test", broken_self_test)
    caplog.set_level(logging.INFO, logger="pdserve.kv_transfer")
    pool = np.zeros(LAYOUT.shape(2), np.float32)
    with make_receiver(pool, LAYOUT, KVTransferConfig(backend="auto")) as r:
        assert r.backend_name == "tcp"
        assert "self-test failed" in r.selection and "state ERR" in r.selection
    assert any("backend tcp (nixl self-test failed" in rec.getMessage() for rec in caplog.records)
    assert built and all(a.agent is None and not a.registered for a in built)  # NIXL side freed


def test_select_backend_is_pure_and_never_refuses_a_pool():
    missing = "nixl unavailable: nixl does not import: ModuleNotFoundError(\"No module named 'nixl'\")"
    sel = select_backend("auto", "cuda", missing)
    assert (sel.backend, sel.staged, sel.label) == ("tcp", True, "tcp-staged")
    assert "nixl does not import" in sel.reason and "CUDA KV moves through pinned host staging" in sel.reason
    sel = select_backend("auto", "cuda", "nixl self-test failed: RuntimeError('loopback VRAM ...')")
    assert sel.label == "tcp-staged" and "self-test failed" in sel.reason
    sel = select_backend("auto", "cpu", missing)
    assert (sel.label, sel.reason) == ("tcp", missing)
    assert select_backend("auto", "cuda", None).label == "nixl"
    assert select_backend("auto", "cuda", None).reason.startswith("nixl imports and its loopback self-test")
    assert select_backend("nixl", "cuda", None).reason == "requested by config"
    assert select_backend("tcp", "cuda", None).label == "tcp-staged"
    assert select_backend("tcp", "cpu", missing).label == "tcp"
    assert select_backend("tcp", "cpu", None, staging="always").label == "tcp-staged"
    with pytest.raises(BackendUnavailableError, match="does not import"):
        select_backend("nixl", "cuda", missing)


def test_split_batches_packs_runs_in_transfer_order():
    batches = split_batches([4, 5, 6, 9, 2, 3, 7], 3, 10)
    assert [b.runs for b in batches] == [[(4, 3, 0)], [(9, 1, 0), (2, 2, 10)], [(7, 1, 0)]]
    assert [b.nbytes for b in batches] == [30, 30, 10]
    assert split_batches([], 3, 10) == []


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pools in ``fake_cuda`` (a set of ids) report device "cuda"; their staging copier is
    the host one (the memory is host memory). No GPU needed."""
    import kv_transfer.memory as memory
    import kv_transfer.staging as staging
    fake: set[int] = set()
    real = memory.device_of
    monkeypatch.setattr(memory, "device_of", lambda buf: ("cuda", 0) if id(buf) in fake else real(buf))
    monkeypatch.setitem(staging.COPIERS, "cuda", staging.HostCopier)
    return fake


@pytest.fixture
def no_nixl(monkeypatch):
    """``import nixl`` fails, as on a host without NIXL."""
    for name in ("nixl", "nixl._api"):
        monkeypatch.setitem(sys.modules, name, None)


def test_auto_without_nixl_stages_a_cuda_pool_and_says_why(fake_cuda, no_nixl, caplog, thread_guard):
    caplog.set_level(logging.INFO, logger="pdserve.kv_transfer")
    layout = KVLayout(**{**LAYOUT.to_dict(), "device": "cuda"})
    src, dst = make_pool(layout, 8, 1), make_pool(layout, 8, 2)
    fake_cuda.update({id(src), id(dst)})
    cfg = KVTransferConfig(backend="auto", staging_chunk_bytes=2 * layout.block_nbytes)
    with make_sender(src, layout, cfg) as s, make_receiver(dst, layout, cfg) as r:
        for side in (s, r):
            assert side.region.is_cuda and side.backend_name == "tcp-staged"
            assert side.backend_info()["backend"] == "tcp-staged"
            assert "nixl unavailable: nixl does not import" in side.selection_reason
            assert "CUDA KV moves through pinned host staging buffers" in side.selection_reason
        assert s.peer_info()["modes"] == ["tcp"]
        lease = s.expect("c", [7, 0, 3, 4, 5])
        t = r.read(s.peer_info(), "c", [7, 0, 3, 4, 5], [1, 2, 6, 5, 0], timeout_s=30, capability=lease.capability)
        assert t.wait(30) == TransferState.DONE, t.error
        assert lease.wait(10) == TransferState.DONE
        assert dst[[1, 2, 6, 5, 0]].tobytes() == src[[7, 0, 3, 4, 5]].tobytes()
        assert r.stats()["staging_sets"] == 1 and s.stats()["staging_sets"] == 1
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("backend tcp-staged (nixl unavailable" in m for m in messages), messages
    for side in (s, r):
        assert_no_leak(side.stats(), closed=True)


def test_cpu_and_cuda_pools_refuse_each_other(fake_cuda, thread_guard):
    cuda_layout = KVLayout(**{**LAYOUT.to_dict(), "device": "cuda"})
    src, dst = make_pool(cuda_layout, 4, 1), make_pool(LAYOUT, 4, 2)
    fake_cuda.add(id(src))
    before = dst.tobytes()
    with make_sender(src, cuda_layout, KVTransferConfig(backend="tcp")) as s, \
            make_receiver(dst, LAYOUT, KVTransferConfig(backend="tcp")) as r:
        lease = s.expect("x", [0])
        t = r.read(s.peer_info(), "x", [0], [0], timeout_s=10, capability=lease.capability)
        assert t.wait(10) == TransferState.FAILED
        assert "incompatible KV layout (differs in: device)" in t.error, t.error
    assert dst.tobytes() == before


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("shm", [False, True])
def test_cuda_copier_code_on_cpu_tensors(shm, gather, fake_cuda, monkeypatch, thread_guard):
    """CudaCopier's own code (byte views of the pool, per-run slices or the device gather
    into a scratch buffer, copy directions, stream ordering, events) run on CPU tensors, with
    the CUDA stream API shimmed (the gather kernel under Triton's interpreter); through the
    socket and through shared staging buffers (pinning shimmed off)."""
    torch = pytest.importorskip("torch")
    import contextlib

    import kv_transfer.block_copy as block_copy
    import kv_transfer.copiers as copiers
    import kv_transfer.staging as staging
    calls = []
    if gather:
        pytest.importorskip("triton")
        monkeypatch.setattr(copiers, "GATHER_MIN_RUNS", 1)
        launch, one_at_a_time = block_copy.copy_blocks, threading.Lock()

        def copy_blocks(*a, **k):  # Triton's interpreter is not thread-safe (a GPU runs both sides)
            calls.append(("gather",))
            with one_at_a_time:
                launch(*a, **k)
        monkeypatch.setattr(block_copy, "copy_blocks", copy_blocks)

    class Stream:
        def __init__(self, device=None):
            calls.append(("stream", str(device)))

        def wait_stream(self, other):
            calls.append(("wait_stream", other))

    class Event:
        def record(self, stream):
            calls.append(("record", type(stream).__name__))

        def synchronize(self):
            calls.append(("synchronize",))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: "default")
    monkeypatch.setattr(staging.CudaCopier, "alloc", lambda self, n: torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(staging.CudaCopier, "pin", False)
    monkeypatch.setitem(staging.COPIERS, "cuda", staging.CudaCopier)
    layout = KVLayout(**{**LAYOUT.to_dict(), "dtype": "bfloat16", "device": "cuda"})
    src, dst = make_pool(layout, 12, 1, "torch"), make_pool(layout, 12, 2, "torch")
    fake_cuda.update({id(src), id(dst)})
    cfg = KVTransferConfig(backend="tcp", staging_chunk_bytes=3 * layout.block_nbytes, staging_shm=shm)
    remote, local = [11, 0, 1, 2, 6, 7, 3], [4, 5, 6, 0, 1, 9, 10]
    with make_sender(src, layout, cfg) as s, make_receiver(dst, layout, cfg) as r:
        assert s.backend_name == r.backend_name == "tcp-staged"
        lease = s.expect("g", remote)
        t = r.read(s.peer_info(), "g", remote, local, timeout_s=30, capability=lease.capability)
        assert t.wait(30) == TransferState.DONE, t.error
        assert r.stats()["shm_mapped"] == (NUM_SHARED_BUFFERS if shm else 0)
    assert torch.equal(dst[local].view(torch.int16), src[remote].view(torch.int16))
    assert ("wait_stream", "default") in calls  # copies ordered after the engine's queued work
    # 7 blocks in batches of 3 -> 3 batches per side, one event each, all waited for
    assert sum(c[0] == "record" for c in calls) == 6
    assert sum(c[0] == "synchronize" for c in calls) == 6
    assert sum(c[0] == "gather" for c in calls) == (6 if gather else 0)
