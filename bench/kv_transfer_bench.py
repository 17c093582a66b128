"""Benchmark of kv_transfer: bandwidth and latency per backend vs memcpy.

Two processes: a child hosts the sender (prefill side) with a pool of random
KV blocks in the SmolLM2-135M shape; this process hosts the receiver (decode
side) and times ``read()`` -> DONE (which includes the sender's ack) for
random, non-contiguous block-id sets of 1, 16, 256 and 4,096 blocks, plus the
128 blocks of one 2,048-token prompt. The reference is a plain memcpy
(``numpy.copyto``) of the same number of bytes in this process, in the same run;
``pvm_readv`` is the kernel's own cross-process copy (``process_vm_readv`` of the
same blocks from the sender process, what UCX's ``cma`` transport uses), the
ceiling for any zero-copy path between two processes on one host.

    PYTHONPATH=. .venv/bin/python bench/kv_transfer_bench.py \
        [--backends nixl,tcp] [--dtype bfloat16] [--sizes 1,16,256,4096] \
        [--json bench/results/kv_transfer.json]
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
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kv_transfer import KVLayout, KVTransferConfig, TransferState, make_receiver, make_sender  # noqa: E402

SMOLLM2 = dict(model_id="HuggingFaceTB/SmolLM2-135M-Instruct", block_size=16, num_layers=30,
               num_kv_heads=3, head_dim=64)
PROMPT_TOKENS = 2048


def _pool(layout: KVLayout, num_blocks: int, seed: int) -> np.ndarray:
    dtype = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}[layout.dtype]
    pool = np.empty(layout.shape(num_blocks), dtype)
    flat = pool.reshape(-1).view(np.uint8)
    rng = np.random.default_rng(seed)
    chunk = 64 << 20
    for i in range(0, flat.size, chunk):  # touch every page before timing
        n = min(chunk, flat.size - i)
        flat[i:i + n] = rng.integers(0, 256, n, dtype=np.uint8)
    return pool


def _sender_main(conn, backend: str, layout_dict: dict, num_blocks: int) -> None:
    layout = KVLayout(**layout_dict)
    pool = _pool(layout, num_blocks, 1)
    sender = make_sender(pool, layout, KVTransferConfig(backend=backend))
    conn.send((sender.peer_info(), int(pool.ctypes.data)))
    held = []
    while True:
        msg = conn.recv()
        if msg is None:
            break
        held = [t for t in held if not t.state.is_terminal]
        for tid, ids in msg:
            held.append(sender.expect(tid, ids, 600))
        conn.send(len(held))
    sender.close()
    conn.send(sender.stats())


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


def _reps(n: int) -> int:
    return 200 if n == 1 else 50 if n <= 16 else 10 if n <= 256 else 3


def run_backend(backend: str, layout: KVLayout, sizes: list[int], pool_blocks: int,
                recv_pool: np.ndarray, rng: np.random.Generator) -> dict:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_sender_main, args=(child, backend, layout.to_dict(), pool_blocks),
                       daemon=True)
    proc.start()
    try:
        info, remote_base = conn.recv()
        recv = make_receiver(recv_pool, layout, KVTransferConfig(backend=backend))
        results = {}
        for label, n in [(str(n), n) for n in sizes] + [("prompt", PROMPT_TOKENS // layout.block_size)]:
            reps = _reps(n)
            plan = [(f"{backend}-{label}-{i}", rng.choice(pool_blocks, n, replace=False).tolist(),
                     rng.choice(pool_blocks, n, replace=False).tolist()) for i in range(reps + 2)]
            conn.send([(tid, remote) for tid, remote, _ in plan])
            conn.recv()
            times = []
            for i, (tid, remote, local) in enumerate(plan):
                t0 = time.perf_counter()
                t = recv.read(info, tid, remote, local, timeout_s=600)
                state = t.wait(600)
                dt = time.perf_counter() - t0
                if state != TransferState.DONE:
                    raise RuntimeError(f"{tid}: {state.name} {t.error}")
                if i >= 2:  # two warm-up transfers (connection, first touch)
                    times.append(dt)
            med = statistics.median(times)
            nbytes = n * layout.block_nbytes
            results[label] = {"blocks": n, "bytes": nbytes, "reps": reps, "median_s": med,
                              "min_s": min(times), "gb_per_s": nbytes / med / 1e9}
            try:
                cma = statistics.median(
                    _time_process_vm_readv(proc.pid, remote_base, recv_pool, layout.block_nbytes,
                                           remote, local) for _, remote, local in plan[2:])
                results[label]["process_vm_readv_gb_per_s"] = nbytes / cma / 1e9
            except OSError as e:
                results[label]["process_vm_readv_error"] = repr(e)
        recv.close()
        conn.send(None)
        leak = conn.recv()
        if recv.stats()["in_flight"] or leak["in_flight"] or leak.get("registered_regions"):
            raise RuntimeError(f"leak after benchmark: {recv.stats()} {leak}")
        return results
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="nixl,tcp")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--sizes", default="1,16,256,4096")
    ap.add_argument("--json", default="bench/results/kv_transfer.json")
    args = ap.parse_args()
    layout = KVLayout(dtype=args.dtype, **SMOLLM2)
    sizes = [int(s) for s in args.sizes.split(",")]
    pool_blocks = max(sizes + [PROMPT_TOKENS // layout.block_size])
    rng = np.random.default_rng(0)
    recv_pool = _pool(layout, pool_blocks, 2)
    memcpy_src = _pool(layout, pool_blocks, 3)
    memcpy = {}
    for label, n in [(str(n), n) for n in sizes] + [("prompt", PROMPT_TOKENS // layout.block_size)]:
        med = _time_memcpy(recv_pool, memcpy_src, n, max(3, _reps(n)))
        memcpy[label] = {"blocks": n, "bytes": n * layout.block_nbytes, "median_s": med,
                         "gb_per_s": n * layout.block_nbytes / med / 1e9}
    del memcpy_src
    out = {"layout": layout.to_dict(), "block_nbytes": layout.block_nbytes, "memcpy": memcpy,
           "host": {"cpus": os.cpu_count(), "python": platform.python_version()}, "backends": {}}
    for backend in args.backends.split(","):
        try:
            out["backends"][backend] = run_backend(backend, layout, sizes, pool_blocks, recv_pool, rng)
        except Exception as e:  # e.g. nixl not installed
            out["backends"][backend] = {"error": repr(e)}
    print(f"kv_transfer benchmark: {args.dtype}, block = {layout.block_nbytes:,} bytes "
          f"(SmolLM2-135M, 16 tokens), random non-contiguous block ids, median of reps")
    head = f"{'blocks':>8} {'MB':>9} {'memcpy GB/s':>12} {'pvm_readv':>10}"
    for b in out["backends"]:
        head += f" {b + ' GB/s':>10} {b + ' ms':>10} {'%memcpy':>8}"
    print(head)
    for label, m in memcpy.items():
        pvr = [r[label].get("process_vm_readv_gb_per_s") for r in out["backends"].values()
               if "error" not in r]
        pvr = [v for v in pvr if v]
        row = (f"{(label if label != 'prompt' else '2048tok'):>8} {m['bytes'] / 1e6:>9.2f} "
               f"{m['gb_per_s']:>12.2f} {(f'{max(pvr):.2f}' if pvr else 'n/a'):>10}")
        for b, res in out["backends"].items():
            if "error" in res:
                row += f" {'n/a':>10} {'n/a':>10} {'':>8}"
                continue
            r = res[label]
            row += (f" {r['gb_per_s']:>10.2f} {r['median_s'] * 1e3:>10.3f}"
                    f" {100 * r['gb_per_s'] / m['gb_per_s']:>7.0f}%")
        print(row)
    for b, res in out["backends"].items():
        if "error" in res:
            print(f"{b}: {res['error']}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
