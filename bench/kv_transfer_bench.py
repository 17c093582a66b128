"""Benchmark of kv_transfer: bandwidth and latency per backend vs memcpy.

Two processes: a child hosts the sender (prefill side) with a pool of random
KV blocks; this process hosts the receiver (decode side) and times ``read()`` ->
DONE (which includes the sender's ack) for random, non-contiguous block-id
sets. Every pull is checked bit-exact against the sender's pool (rebuilt here
from its seed), outside the timed region.

``--device cpu`` (default): SmolLM2-135M block shape, 1, 16, 256 and 4,096
blocks plus the 128 blocks of one 2,048-token prompt. The reference is a plain
memcpy (``numpy.copyto``) of the same number of bytes in this process, in the
same run; ``pvm_readv`` is the kernel's own cross-process copy
(``process_vm_readv`` of the same blocks from the sender process, what UCX's
``cma`` transport uses), the ceiling for any zero-copy path between two
processes on one host.

``--device cuda``: both pools on the GPU (two processes on one GPU), Llama-1B
block shape (16 layers, 8 KV heads, head dim 64, block 16, bf16: 512 KiB a
block), 1, 16, 128 and 1,024 blocks. Backends ``nixl`` (VRAM; ``cuda_ipc``
between the processes) when it imports, and ``tcp``, which on a CUDA pool is the
pinned-host staging fallback (``tcp-staged``), and ``cuda-ipc``, the same-host
CUDA IPC mode (the receiver maps the sender's pool, one copy kernel). References, same run, same
blocks: a device-to-device gather (``index_select``) in this process, and
pinned-host memcpy (device->host and host->device) of the same bytes, the
ceiling of the staging path's copies. (``tcp-staged`` on ``--device cpu`` runs
the staging pipeline on host pools: its cost over plain ``tcp``.)

    PYTHONPATH=. .venv/bin/python bench/kv_transfer_bench.py \
        [--device cpu|cuda] [--backends nixl,tcp[,tcp-staged][,tcp-auth,nixl-auth,tcp-auth-tls]] \
        [--dtype bfloat16] \
        [--sizes 1,16,256,4096] [--json bench/results/kv_transfer.json]

A ``-auth`` backend runs with a cluster key on both sides (issue #20): the HMAC challenge-response
on each new connection and a capability on each read. For TCP variants the bench also times a new
connection + handshake + one-block pull (a fresh receiver per sample): the per-connection price.
A ``-tls`` backend (``tcp-tls``, ``tcp-auth-tls``) speaks mutual TLS 1.3 on the control connection
and the data stream, with certificates of a throwaway CA made for the run: the price of encryption.

Every child process and every pipe read is bounded by a timeout.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kv_transfer import KVLayout, KVTransferConfig, TransferState, make_receiver, make_sender  # noqa: E402

SMOLLM2 = dict(model_id="HuggingFaceTB/SmolLM2-135M-Instruct", block_size=16, num_layers=30,
               num_kv_heads=3, head_dim=64)
LLAMA_1B = dict(model_id="llama-1b-shape", block_size=16, num_layers=16, num_kv_heads=8, head_dim=64)
PROMPT_TOKENS = 2048
PIPE_TIMEOUT_S = 180.0
PULL_TIMEOUT_S = 120.0


def _pool(layout: KVLayout, num_blocks: int, seed: int):
    """Deterministic pool of random bits on ``layout.device`` (rebuilt from the seed to verify)."""
    if layout.device == "cuda":
        import torch
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed)
        raw = torch.randint(0, 256, (num_blocks * layout.block_nbytes,), dtype=torch.uint8, device="cuda",
                            generator=gen)
        return raw.view(getattr(torch, layout.dtype)).reshape(layout.shape(num_blocks))
    dtype = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}[layout.dtype]
    pool = np.empty(layout.shape(num_blocks), dtype)
    flat = pool.reshape(-1).view(np.uint8)
    rng = np.random.default_rng(seed)
    chunk = 64 << 20
    for i in range(0, flat.size, chunk):  # touch every page before timing
        n = min(chunk, flat.size - i)
        flat[i:i + n] = rng.integers(0, 256, n, dtype=np.uint8)
    return pool


def _addr(pool) -> int:
    return int(pool.data_ptr()) if hasattr(pool, "data_ptr") else int(pool.ctypes.data)


BENCH_KEY = b"kv-transfer-bench-cluster-key-32"
HANDSHAKES = 30


def _config(backend: str, tuning: dict | None = None) -> KVTransferConfig:
    """``tcp-staged``: the TCP path through host staging buffers even for a host pool.
    ``cuda-ipc``: the same-host CUDA IPC mode (on a TCP side); every other row has it off,
    so each row measures its own path. ``tcp-socket``: staged blocks through the socket even
    on one host (as between hosts); plain ``tcp`` shares the staging buffers on one host.
    ``nixl-pool``: NIXL with the whole pool registered once (``nixl`` registers each lease).
    A ``-auth`` suffix: both sides hold a cluster key (HMAC challenge-response on every connection);
    ``-tls`` (after it, if both): mutual TLS 1.3 with the certificate in ``tuning["tls"]``."""
    tuning = dict(tuning or {})
    tls_files = tuning.pop("tls", None)
    base, tls = backend.removesuffix("-tls"), backend.endswith("-tls")
    base, auth = base.removesuffix("-auth"), base.endswith("-auth")
    tuning.update(auth_key=BENCH_KEY if auth else None, tls=tls_files if tls else None)
    if base == "tcp-staged":
        return KVTransferConfig(backend="tcp", staging="always", cuda_ipc=False, **tuning)
    if base == "cuda-ipc":
        return KVTransferConfig(backend="tcp", cuda_ipc=True, **tuning)
    if base == "nixl-pool":  # the whole pool registered once, vs the default per-lease registration
        return KVTransferConfig(backend="nixl", cuda_ipc=False, nixl_expose="pool", **tuning)
    if base == "tcp-socket":
        return KVTransferConfig(backend="tcp", cuda_ipc=False, staging_shm=False, **tuning)
    return KVTransferConfig(backend=base, cuda_ipc=False, **tuning)


def _recv(conn, proc, timeout: float = PIPE_TIMEOUT_S):
    """``conn.recv()`` that gives up after ``timeout`` seconds, or at once when ``proc`` died."""
    end = time.monotonic() + timeout
    while not conn.poll(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"the sender process died (exit code {proc.exitcode})")
        if time.monotonic() > end:
            raise TimeoutError(f"no answer from the sender process in {timeout:.0f}s")
    return conn.recv()


def _sender_main(conn, backend: str, layout_dict: dict, num_blocks: int, tuning: dict) -> None:
    try:
        layout = KVLayout(**layout_dict)
        pool = _pool(layout, num_blocks, 1)
        sender = make_sender(pool, layout, _config(backend, tuning))
        conn.send(("ok", (sender.peer_info(), sender.backend_name, _addr(pool))))
    except Exception as e:
        conn.send(("err", repr(e)))
        return
    held = []
    while conn.poll(PIPE_TIMEOUT_S * 4):  # the parent is gone if it stays silent this long
        msg = conn.recv()
        if msg is None:
            break
        held = [t for t in held if not t.state.is_terminal]
        caps = {}
        for tid, ids in msg:
            held.append(sender.expect(tid, ids, 600))
            caps[tid] = held[-1].capability
        conn.send(caps)
    sender.close()
    conn.send(sender.stats())


class _Verifier:
    """Checks that local blocks equal the sender's blocks (bit for bit)."""

    def __init__(self, layout: KVLayout, recv_pool, pool_blocks: int) -> None:
        self.src = _pool(layout, pool_blocks, 1)  # the sender's pool, rebuilt from its seed
        self.recv = recv_pool
        self.cuda = layout.device == "cuda"
        if not self.cuda:
            self.src_blocks = self.src.reshape(pool_blocks, -1).view(np.uint8)
            self.recv_blocks = recv_pool.reshape(pool_blocks, -1).view(np.uint8)

    def check(self, remote: list[int], local: list[int]) -> bool:
        if self.cuda:
            import torch
            ri = torch.tensor(remote, device="cuda")
            li = torch.tensor(local, device="cuda")
            return bool(torch.equal(self.recv.view(torch.int16)[li], self.src.view(torch.int16)[ri]))
        pairs = zip(remote, local, strict=True)
        return all(np.array_equal(self.recv_blocks[lo], self.src_blocks[r]) for r, lo in pairs)


def _time_memcpy(dst: np.ndarray, src: np.ndarray, n: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst[:n], src[:n])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _time_process_vm_readv(pid: int, remote_base: int, dst: np.ndarray, block_nbytes: int,
                           remote: list[int], local: list[int]) -> float:
    """One process_vm_readv sweep of the same blocks: the kernel's cross-process copy."""
    libc = ctypes.CDLL(None, use_errno=True)
    n = len(remote)
    liov = (_IoVec * n)(*[_IoVec(int(dst.ctypes.data) + b * block_nbytes, block_nbytes) for b in local])
    riov = (_IoVec * n)(*[_IoVec(remote_base + b * block_nbytes, block_nbytes) for b in remote])
    t0 = time.perf_counter()
    done = 0
    for k in range(0, n, 512):
        m = min(512, n - k)
        got = libc.process_vm_readv(pid, ctypes.byref(liov, k * ctypes.sizeof(_IoVec)), m,
                                    ctypes.byref(riov, k * ctypes.sizeof(_IoVec)), m, 0)
        if got < 0:
            raise OSError(ctypes.get_errno(), "process_vm_readv")
        done += got
    dt = time.perf_counter() - t0
    if done != n * block_nbytes:
        raise OSError("short process_vm_readv")
    return dt


def _reps(n: int, cuda: bool = False) -> int:
    if cuda:
        return 50 if n == 1 else 20 if n <= 16 else 10 if n <= 128 else 5
    return 200 if n == 1 else 50 if n <= 16 else 10 if n <= 256 else 3


def run_backend(backend: str, layout: KVLayout, cases: list[tuple[str, int]], pool_blocks: int,
                recv_pool, verifier: _Verifier, rng: np.random.Generator, tuning: dict | None = None) -> dict:
    cuda = layout.device == "cuda"
    tuning = tuning or {}
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_sender_main, args=(child, backend, layout.to_dict(), pool_blocks, tuning),
                       daemon=True)
    proc.start()
    child.close()
    recv = None
    try:
        status, value = _recv(conn, proc)
        if status != "ok":
            raise RuntimeError(f"sender could not start: {value}")
        info, sender_backend, remote_base = value
        recv = make_receiver(recv_pool, layout, _config(backend, tuning))
        results = {"sender_backend": sender_backend, "receiver_backend": recv.backend_name,
                   "receiver_selection": recv.selection}
        for label, n in cases:
            reps = _reps(n, cuda)
            plan = [(f"{backend}-{label}-{i}", rng.choice(pool_blocks, n, replace=False).tolist(),
                     rng.choice(pool_blocks, n, replace=False).tolist()) for i in range(reps + 2)]
            conn.send([(tid, remote) for tid, remote, _ in plan])
            caps = _recv(conn, proc)
            times = []
            for i, (tid, remote, local) in enumerate(plan):
                t0 = time.perf_counter()
                t = recv.read(info, tid, remote, local, timeout_s=PULL_TIMEOUT_S, capability=caps[tid])
                state = t.wait(PULL_TIMEOUT_S + 5)
                dt = time.perf_counter() - t0
                if state != TransferState.DONE:
                    raise RuntimeError(f"{tid}: {state.name} {t.error}")
                if not verifier.check(remote, local):
                    raise RuntimeError(f"{tid}: blocks differ from the sender's after the pull")
                if i >= 2:  # two warm-up transfers (connection, first touch)
                    times.append(dt)
            med = statistics.median(times)
            nbytes = n * layout.block_nbytes
            results[label] = {"blocks": n, "bytes": nbytes, "reps": reps, "median_s": med,
                              "min_s": min(times), "gb_per_s": nbytes / med / 1e9, "verified": len(plan)}
            if cuda:
                continue
            try:
                cma = statistics.median(
                    _time_process_vm_readv(proc.pid, remote_base, recv_pool, layout.block_nbytes,
                                           remote, local) for _, remote, local in plan[2:])
                results[label]["process_vm_readv_gb_per_s"] = nbytes / cma / 1e9
            except OSError as e:
                results[label]["process_vm_readv_error"] = repr(e)
        results["cuda_ipc_pulls"] = recv.stats()["cuda_ipc_pulls"]
        if backend.startswith("cuda-ipc") != (results["cuda_ipc_pulls"] > 0):
            raise RuntimeError(f"{backend}: {results['cuda_ipc_pulls']} pulls went over CUDA IPC")
        if not backend.startswith("nixl"):  # a fresh receiver per sample: its agent would dominate
            results["handshake"] = _time_handshakes(conn, proc, info, backend, layout, recv_pool, tuning)
        recv.close()
        conn.send(None)
        leak = _recv(conn, proc)
        if recv.stats()["in_flight"] or leak["in_flight"] or leak.get("registered_regions"):
            raise RuntimeError(f"leak after benchmark: {recv.stats()} {leak}")
        return results
    finally:
        if recv is not None:
            recv.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        conn.close()


def _time_handshakes(conn, proc, info: dict, backend: str, layout: KVLayout, recv_pool, tuning: dict) -> dict:
    """Connect + handshake + a one-block pull on a new connection (a fresh receiver), the cost a
    decode worker pays once per prefill worker: with ``-auth`` it includes the HMAC exchange,
    with ``-tls`` the TLS handshake."""
    plan = [(f"hs-{backend}-{i}", [i % 8]) for i in range(HANDSHAKES + 2)]
    conn.send(plan)
    caps = _recv(conn, proc)
    times = []
    for i, (tid, ids) in enumerate(plan):
        recv = make_receiver(recv_pool, layout, _config(backend, tuning))
        try:
            t0 = time.perf_counter()
            t = recv.read(info, tid, ids, ids, timeout_s=PULL_TIMEOUT_S, capability=caps[tid])
            if t.wait(PULL_TIMEOUT_S + 5) != TransferState.DONE:
                raise RuntimeError(f"{tid}: {t.error}")
            if i >= 2:
                times.append(time.perf_counter() - t0)
        finally:
            recv.close()
    return {"samples": len(times), "median_s": statistics.median(times), "min_s": min(times)}


def cpu_references(layout: KVLayout, cases: list[tuple[str, int]], pool_blocks: int, recv_pool) -> dict:
    memcpy_src = _pool(layout, pool_blocks, 3)
    memcpy = {}
    for label, n in cases:
        med = _time_memcpy(recv_pool, memcpy_src, n, max(3, _reps(n)))
        memcpy[label] = {"blocks": n, "bytes": n * layout.block_nbytes, "median_s": med,
                         "gb_per_s": n * layout.block_nbytes / med / 1e9}
    return memcpy


def cuda_references(layout: KVLayout, cases: list[tuple[str, int]], pool_blocks: int, recv_pool,
                    rng: np.random.Generator) -> dict:
    """Device-to-device gather of random blocks, and pinned-host memcpy both ways, per size."""
    import torch
    bs = layout.block_nbytes
    blocks = recv_pool.view(torch.uint8).reshape(pool_blocks, bs)
    max_n = max(n for _, n in cases)
    scratch = torch.empty((max_n, bs), dtype=torch.uint8, device="cuda")
    pinned = torch.empty(max_n * bs, dtype=torch.uint8, pin_memory=True)
    flat = scratch.view(-1)

    def timed(fn, reps: int) -> float:
        times = []
        for i in range(reps + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def gather(idx, n: int):
        return lambda: torch.index_select(blocks, 0, idx, out=scratch[:n])

    def copy(dst, src):
        return lambda: dst.copy_(src, non_blocking=True)

    refs = {}
    for label, n in cases:
        nbytes = n * bs
        idx = torch.tensor(rng.choice(pool_blocks, n, replace=False), device="cuda")
        reps = _reps(n, cuda=True)
        t_gather = timed(gather(idx, n), reps)
        t_d2h = timed(copy(pinned[:nbytes], flat[:nbytes]), reps)
        t_h2d = timed(copy(flat[:nbytes], pinned[:nbytes]), reps)
        refs[label] = {"blocks": n, "bytes": nbytes, "d2d_gather_gb_per_s": nbytes / t_gather / 1e9,
                       "d2d_gather_median_s": t_gather, "pinned_d2h_gb_per_s": nbytes / t_d2h / 1e9,
                       "pinned_h2d_gb_per_s": nbytes / t_h2d / 1e9}
    return refs


def _print_cpu(out: dict, dtype: str, block_nbytes: int) -> None:
    print(f"kv_transfer benchmark: {dtype}, block = {block_nbytes:,} bytes "
          f"(SmolLM2-135M, 16 tokens), random non-contiguous block ids, median of reps, every pull verified")
    print("(-auth: both sides hold a cluster key; HMAC challenge-response per connection, capability per read;"
          " -tls: mutual TLS 1.3 on the connection)")
    head = f"{'blocks':>8} {'MB':>9} {'memcpy GB/s':>12} {'pvm_readv':>10}"
    for b in out["backends"]:
        head += f" {b + ' GB/s':>10} {b + ' ms':>10} {'%memcpy':>8}"
    print(head)
    for label, m in out["memcpy"].items():
        pvr = [r[label].get("process_vm_readv_gb_per_s") for r in out["backends"].values() if "error" not in r]
        pvr = [v for v in pvr if v]
        row = (f"{(label if label != 'prompt' else '2048tok'):>8} {m['bytes'] / 1e6:>9.2f} "
               f"{m['gb_per_s']:>12.2f} {(f'{max(pvr):.2f}' if pvr else 'n/a'):>10}")
        for res in out["backends"].values():
            if "error" in res:
                row += f" {'n/a':>10} {'n/a':>10} {'':>8}"
                continue
            r = res[label]
            row += (f" {r['gb_per_s']:>10.2f} {r['median_s'] * 1e3:>10.3f}"
                    f" {100 * r['gb_per_s'] / m['gb_per_s']:>7.0f}%")
        print(row)
    for b, res in out["backends"].items():
        if "handshake" in res:
            hs = res["handshake"]
            print(f"{b}: new connection + handshake + 1-block pull: median {hs['median_s'] * 1e3:.3f} ms "
                  f"(min {hs['min_s'] * 1e3:.3f} ms, {hs['samples']} samples)")


def _print_cuda(out: dict, block_nbytes: int) -> None:
    print(f"kv_transfer benchmark, CUDA pools in two processes on one GPU ({out['host'].get('gpu')}): bfloat16, "
          f"block = {block_nbytes:,} bytes (Llama-1B shape, 16 tokens), random non-contiguous block ids, "
          "median of reps, every pull verified bit-exact")
    head = f"{'blocks':>7} {'MB':>8} {'d2d gather':>11} {'pinned D2H':>11} {'pinned H2D':>11}"
    names = {b: b if b in ("cuda-ipc", "tcp-socket") else (res.get("receiver_backend") or b)
             for b, res in out["backends"].items()}
    for b in out["backends"]:
        head += f" {names[b] + ' GB/s':>16} {names[b] + ' ms':>14} {'%gather':>8}"
    print(head + "   (GB/s unless marked)")
    for label, ref in out["references"].items():
        row = (f"{label:>7} {ref['bytes'] / 1e6:>8.2f} {ref['d2d_gather_gb_per_s']:>11.1f} "
               f"{ref['pinned_d2h_gb_per_s']:>11.1f} {ref['pinned_h2d_gb_per_s']:>11.1f}")
        for res in out["backends"].values():
            if "error" in res:
                row += f" {'n/a':>16} {'n/a':>14} {'':>8}"
                continue
            r = res[label]
            row += (f" {r['gb_per_s']:>16.2f} {r['median_s'] * 1e3:>14.3f}"
                    f" {100 * r['gb_per_s'] / ref['d2d_gather_gb_per_s']:>7.0f}%")
        print(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backends", default=None, help="default cpu: nixl,tcp; cuda: cuda-ipc,nixl,tcp,tcp-socket")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--sizes", default=None, help="block counts (default cpu: 1,16,256,4096; cuda: 1,16,128,1024)")
    ap.add_argument("--socket-buffer-mb", type=float, default=0, help="SO_SNDBUF/SO_RCVBUF (0: kernel autotuning)")
    ap.add_argument("--staging-chunk-mb", type=float, default=32, help="MiB per staging buffer")
    ap.add_argument("--json", default=None, help="default bench/results/kv_transfer[_cuda].json")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    tuning = {"socket_buffer_bytes": int(args.socket_buffer_mb * (1 << 20)),
              "staging_chunk_bytes": int(args.staging_chunk_mb * (1 << 20))}
    if "-tls" in (args.backends or ""):
        from common.cluster_auth.dev_pki import make_cluster_pki
        from kv_transfer import KVTLSFiles
        worker = make_cluster_pki(tempfile.mkdtemp(prefix="kv-bench-pki-"))["worker"]
        tuning["tls"] = KVTLSFiles(worker.cert, worker.key, worker.ca)
    if cuda:
        import torch
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device")
        layout = KVLayout(dtype="bfloat16", device="cuda", **LLAMA_1B)
        sizes = [int(s) for s in (args.sizes or "1,16,128,1024").split(",")]
        cases = [(str(n), n) for n in sizes]
        pool_blocks = max(2 * max(sizes), 64)  # room for random, non-contiguous picks
    else:
        layout = KVLayout(dtype=args.dtype, **SMOLLM2)
        sizes = [int(s) for s in (args.sizes or "1,16,256,4096").split(",")]
        cases = [(str(n), n) for n in sizes] + [("prompt", PROMPT_TOKENS // layout.block_size)]
        pool_blocks = max(n for _, n in cases)
    json_path = args.json or f"bench/results/kv_transfer{'_cuda' if cuda else ''}.json"
    rng = np.random.default_rng(0)
    recv_pool = _pool(layout, pool_blocks, 2)
    host = {"cpus": os.cpu_count(), "python": platform.python_version()}
    out = {"device": args.device, "layout": layout.to_dict(), "block_nbytes": layout.block_nbytes,
           "pool_blocks": pool_blocks, "host": host, "backends": {},
           "tuning": {k: v for k, v in tuning.items() if k != "tls"}}
    if cuda:
        import torch
        host.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
        out["references"] = cuda_references(layout, cases, pool_blocks, recv_pool, rng)
    else:
        out["memcpy"] = cpu_references(layout, cases, pool_blocks, recv_pool)
    verifier = _Verifier(layout, recv_pool, pool_blocks)
    for backend in (args.backends or ("cuda-ipc,nixl,tcp,tcp-socket" if cuda else "nixl,tcp")).split(","):
        try:
            out["backends"][backend] = run_backend(backend, layout, cases, pool_blocks, recv_pool, verifier, rng,
                                                   tuning)
        except Exception as e:  # e.g. nixl not installed
            out["backends"][backend] = {"error": repr(e)}
    if cuda:
        _print_cuda(out, layout.block_nbytes)
    else:
        _print_cpu(out, args.dtype, layout.block_nbytes)
    for b, res in out["backends"].items():
        print(f"{b}: {res['error']}" if "error" in res else f"{b}: {res['receiver_selection']}")
    os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
