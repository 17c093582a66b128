"""Child-process side of the two-process tests.

A child hosts one sender or receiver and obeys commands sent over a
multiprocessing pipe. Faults (stalls) are installed by monkeypatching inside
the child only, so the production code carries no test hooks.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np

SMOLLM2 = dict(model_id="HuggingFaceTB/SmolLM2-135M-Instruct", block_size=16,
               num_layers=30, num_kv_heads=3, head_dim=64)


def config_for(backend: str, **overrides):
    """KVTransferConfig of a test backend name ("tcp-staged": tcp with staging="always", sharing
    its staging buffers with a same-host peer; "tcp-staged-socket": the same through the socket;
    "cuda-ipc": a tcp side with the same-host CUDA IPC mode on; "tcp-tls": tcp over mutual TLS,
    ``tls`` naming the (cert, key, CA) files). Every other name has CUDA IPC off, so a test of a
    backend on CUDA pools measures that backend's own path."""
    from kv_transfer import KVTLSFiles, KVTransferConfig
    if backend == "cuda-ipc":
        return KVTransferConfig(backend="tcp", **{"cuda_ipc": True, **overrides})
    overrides = {"cuda_ipc": False, **overrides}
    if backend == "tcp-staged-socket":
        return KVTransferConfig(backend="tcp", staging="always", **{"staging_shm": False, **overrides})
    if backend == "tcp-staged":
        return KVTransferConfig(backend="tcp", staging="always", **overrides)
    if backend == "tcp-tls":
        return KVTransferConfig(backend="tcp", **{"tls": KVTLSFiles(*kv_tls_files()), **overrides})
    return KVTransferConfig(backend=backend, **overrides)


def kv_tls_files(name: str = "worker", ca: str = "ca") -> tuple[str, str, str]:
    """(cert, key, CA) of a certificate ``name`` from a throwaway CA ``ca``, made once per test run
    in a directory named by ``$PDSERVE_TEST_KV_PKI`` (child processes inherit it)."""
    from common.cluster_auth.dev_pki import make_ca, make_cert
    root = os.environ.get("PDSERVE_TEST_KV_PKI")
    if root is None:
        root = os.environ["PDSERVE_TEST_KV_PKI"] = tempfile.mkdtemp(prefix="pdserve-kv-pki-")
    directory = Path(root) / ca
    if not (directory / f"{name}.pem").exists():
        directory.mkdir(exist_ok=True)
        if not (directory / f"{ca}.pem").exists():
            make_ca(directory, ca)
        make_cert(directory, ca, name)
    return str(directory / f"{name}.pem"), str(directory / f"{name}.key"), str(directory / f"{ca}.pem")


def make_pool(layout, num_blocks: int, seed: int, lib: str = "numpy"):
    """Deterministic pool of random bits (same seed -> same bytes in any process; for
    ``lib="cuda"``, in any process on the same kind of GPU)."""
    if lib == "cuda":
        import torch
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed)
        raw = torch.randint(0, 256, (num_blocks * layout.block_nbytes,), dtype=torch.uint8,
                            device="cuda", generator=gen)
        return raw.view(getattr(torch, layout.dtype)).reshape(layout.shape(num_blocks))
    raw = np.random.default_rng(seed).integers(0, 256, num_blocks * layout.block_nbytes,
                                               dtype=np.uint8)
    if lib == "torch":
        import torch
        return torch.from_numpy(raw).view(getattr(torch, layout.dtype)).reshape(layout.shape(num_blocks))
    np_dtype = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}[layout.dtype]
    return raw.view(np_dtype).reshape(layout.shape(num_blocks))


def pool_bytes(pool) -> memoryview:
    """Byte view of a numpy or torch pool (a host copy of a CUDA one)."""
    if isinstance(pool, np.ndarray):
        return memoryview(pool).cast("B")
    return memoryview(pool.reshape(-1).view(__import__("torch").uint8).cpu().numpy())


def block_digest(pool, block_nbytes: int, ids) -> list[str]:
    """sha256 of each listed block."""
    mv = pool_bytes(pool)
    return [hashlib.sha256(mv[b * block_nbytes:(b + 1) * block_nbytes]).hexdigest() for b in ids]


def _install_fault(fault: str, stalled, unstall) -> None:
    """Monkeypatch a stall into this process's kv_transfer."""
    def stall(should_stop=None):
        stalled.set()
        end = time.monotonic() + 60
        while not unstall.wait(0.01) and time.monotonic() < end:
            if should_stop is not None and should_stop():
                raise InterruptedError("stopped while stalled")

    if fault == "stall_tcp_send":  # stall halfway through streaming the blocks
        import kv_transfer.tcp_path as tp
        orig = tp.send_views

        def send_views(sock, views, should_stop=None):
            flat = [v[i:i + 65536] for v in views for i in range(0, v.nbytes, 65536)]
            half = len(flat) // 2
            n = orig(sock, flat[:half], should_stop)
            stall(should_stop)
            return n + orig(sock, flat[half:], should_stop)
        tp.send_views = send_views
        orig_msg = tp.send_msg

        def shut(sock) -> bool:  # the transfer's interrupt shut the socket down (abort, deadline)
            import select
            import socket
            if not select.select([sock], [], [], 0)[0]:
                return False
            try:
                return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except OSError:
                return True

        def send_msg(sock, header, payload=b""):  # shared buffers: stall before the first batch
            if header.get("type") == "batch" and header.get("k") == 0:
                stall(lambda: shut(sock))
            return orig_msg(sock, header, payload)
        tp.send_msg = send_msg
    elif fault == "stall_after_grant":  # grant served, then the connection thread hangs
        from kv_transfer.sender import ControlSender
        orig_grant = ControlSender._handle_read

        def handle_read(self, *a, **k):
            orig_grant(self, *a, **k)
            stall()
        ControlSender._handle_read = handle_read
    elif fault == "stall_in_pull":  # receiver hangs while pulling
        import kv_transfer.nixl_path as nb
        import kv_transfer.tcp_path as tp
        orig_tcp_pull = tp.pull_blocks

        def tcp_pull(*a, **k):
            stall()
            return orig_tcp_pull(*a, **k)
        tp.pull_blocks = tcp_pull
        orig_nixl_pull = nb.NixlPullPath.pull

        def nixl_pull(self, *a, **k):
            stall()
            return orig_nixl_pull(self, *a, **k)
        nb.NixlPullPath.pull = nixl_pull
    elif fault:
        raise ValueError(f"unknown fault {fault}")


def run_peer(conn, spec: dict, stalled, unstall) -> None:
    """Child main: build the side described by ``spec`` and serve commands."""
    try:
        os.environ.update(spec.get("env", {}))
        from kv_transfer import KVLayout, make_receiver, make_sender
        _install_fault(spec.get("fault", ""), stalled, unstall)
        layout = KVLayout(**spec["layout"])
        pool = make_pool(layout, spec["num_blocks"], spec["seed"], spec.get("lib", "numpy"))
        cfg = config_for(spec["backend"], **spec.get("config", {}))
        side = (make_sender if spec["role"] == "sender" else make_receiver)(pool, layout, cfg)
        threads_before = threading.active_count()
        conn.send(("ok", {"pid": os.getpid(), "peer_info": getattr(side, "peer_info", dict)(),
                          "backend": side.backend_name}))
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    transfers = {}
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "expect":
                tid, ids, timeout = args
                transfers[tid] = side.expect(tid, ids, timeout)
                out = {tid: transfers[tid].capability}
            elif cmd == "expect_many":
                items, timeout = args
                for tid, ids in items:
                    transfers[tid] = side.expect(tid, ids, timeout)
                out = {tid: transfers[tid].capability for tid, _ in items}
            elif cmd == "read":
                info, tid, remote, local, timeout, capability = args
                transfers[tid] = side.read(info, tid, remote, local, timeout, capability=capability)
                out = None
            elif cmd == "wait":
                tid, timeout = args
                t = transfers[tid]
                out = (int(t.wait(timeout)), t.error)
            elif cmd == "wait_all":
                (timeout,) = args
                out = {tid: (int(t.wait(timeout)), t.error) for tid, t in transfers.items()}
                transfers.clear()
            elif cmd == "abort":
                (tid,) = args
                t = transfers[tid]
                out = (int(t.abort("aborted by test")), t.error)
            elif cmd == "digest":
                (ids,) = args
                out = block_digest(pool, layout.block_nbytes, ids)
            elif cmd == "unstall":
                unstall.set()
                out = None
            elif cmd == "stats":
                out = side.stats()
            elif cmd == "close":
                side.close()
                out = {**side.stats(), "extra_threads": threading.active_count() - threads_before}
            else:
                raise ValueError(f"unknown command {cmd}")
            conn.send(("ok", out))
        except Exception:
            conn.send(("err", traceback.format_exc()))
