"""`pdserve chaos`: start a cluster of worker processes and a router, offer load, inject the fault
schedule while it runs, then check nothing leaked and report what the clients saw.

Workers are plain `pdserve prefill-worker/decode-worker` processes restarted on the same port after
a fault (as a kubelet restarts a pod behind its Service); one fault at a time, each only once the
previous victim is back in the router's rotation."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

from common.cluster_auth.secret import write_secret_file
from loadtest.chaos.config import ChaosConfig
from loadtest.chaos.faults import FaultRecord, inject, wait_back
from loadtest.chaos.leaks import wait_until_idle
from loadtest.chaos.processes import ManagedProcess
from loadtest.chaos.report import table, verdict
from loadtest.chaos.schedule import fault_plan
from loadtest.datasets import load_prompts
from loadtest.runner import run_async


class ChaosCluster:
    """The processes of one chaos run: workers by role, one router with a metrics port."""

    def __init__(self, config: ChaosConfig, secret_file: str) -> None:
        self.config = config
        self.secret_file = secret_file
        self.workers: dict[str, list[ManagedProcess]] = {"prefill": [], "decode": []}
        self.router: ManagedProcess | None = None
        self.metrics_url = ""

    def start(self) -> None:
        cfg = self.config
        for role, count in (("prefill", cfg.num_prefill), ("decode", cfg.num_decode)):
            self.workers[role] = [ManagedProcess(f"{role}[{i}]", [
                f"{role}-worker", "--cluster-secret-file", self.secret_file,
                "--drain-timeout-s", str(cfg.drain_timeout_s), *cfg.worker_args], log_path=self._log(f"{role}-{i}"))
                for i in range(count)]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(ManagedProcess.start, self.all_workers))
        metrics_port = _free_port()
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.router = ManagedProcess("router", [
            "router", "--port", "0", "--metrics-port", str(metrics_port), "--health-interval-s", "0.5",
            "--cluster-secret-file", self.secret_file, "--stream-timeout-s", str(cfg.stream_timeout_s),
            "--max-migrations", str(cfg.max_migrations),
            "--prefill-workers", ",".join(w.address for w in self.workers["prefill"]),
            "--decode-workers", ",".join(w.address for w in self.workers["decode"]), *cfg.router_args],
            log_path=self._log("router")).start()

    def _log(self, name: str) -> str | None:
        if self.config.log_dir is None:
            return None
        os.makedirs(self.config.log_dir, exist_ok=True)
        return os.path.join(self.config.log_dir, f"{name}.log")

    @property
    def all_workers(self) -> list[ManagedProcess]:
        return self.workers["prefill"] + self.workers["decode"]

    def metrics(self) -> dict[str, dict[tuple, float]]:
        """The router's samples: name -> {label items: value}."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        out: dict[str, dict[tuple, float]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out

    def in_rotation(self, worker: ManagedProcess) -> bool:
        samples = self.metrics().get("pdserve:worker_healthy", {})
        return any(dict(labels).get("worker") == worker.address and v == 1.0 for labels, v in samples.items())

    def stop(self) -> None:
        for proc in [self.router, *self.all_workers]:
            if proc is not None:
                proc.stop(timeout=30)


def run_chaos(config: ChaosConfig) -> int:
    """The whole run; prints the table, writes the JSON; exit status 0 only when it passed."""
    secret_dir = tempfile.mkdtemp(prefix="pdserve-chaos-")
    cluster = ChaosCluster(config, write_secret_file(secret_dir, None))
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so the cluster's processes are stopped too
    try:
        print(f"starting {config.num_prefill} prefill + {config.num_decode} decode workers and a router",
              flush=True)
        cluster.start()
        print(f"ready: chaos load at {cluster.router.address}; faults every {config.fault_every_s:g} s "
              f"({', '.join(config.faults)})", flush=True)
        report = run_with_faults(cluster, config)
    finally:
        cluster.stop()
        shutil.rmtree(secret_dir, ignore_errors=True)
    print(table(report), flush=True)
    if config.output:
        with open(config.output, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if verdict(report) else 1


def run_with_faults(cluster: ChaosCluster, config: ChaosConfig) -> dict:
    load = dataclasses.replace(config.load, url=cluster.router.address, duration_s=config.duration_s)
    prompts = load_prompts(load.dataset, load.num_prompts + load.num_warmups, load.seed)
    before = cluster.metrics().get("pdserve:request_migrations_total", {})
    done = threading.Event()
    records: list[FaultRecord] = []
    start = time.monotonic()
    injector = threading.Thread(target=_fault_loop, args=(cluster, config, start, done, records), daemon=True)
    injector.start()
    try:
        result = asyncio.run(run_async(load, prompts))
    finally:
        done.set()
        injector.join()
    leaks = wait_until_idle([w.address for w in cluster.all_workers if w.alive], config.leak_timeout_s,
                            cluster.secret_file)
    after = cluster.metrics().get("pdserve:request_migrations_total", {})
    migrations = {dict(k).get("reason", ""): v - before.get(k, 0.0) for k, v in after.items()}
    s = result.summary
    return {
        "num_prefill": config.num_prefill, "num_decode": config.num_decode, "duration_s": config.duration_s,
        "request_rate": load.request_rate, "fault_every_s": config.fault_every_s, "seed": config.seed,
        "requests": {"sent": len(result.records), "completed": s["completed"],
                     "failed": len(result.records) - s["completed"], "failures_by_status": s["failures_by_status"]},
        "migrations": {k: v for k, v in migrations.items() if v},
        "faults": [r.to_json() for r in records],
        "leaks": {a: list(v) for a, v in leaks.items()},
        "latency_ms": {"ttft_p50": s["median_ttft_ms"], "ttft_p99": s["p99_ttft_ms"],
                       "itl_p50": s["median_itl_ms"], "itl_p99": s["p99_itl_ms"]},
        "load": s,
    }


def _fault_loop(cluster: ChaosCluster, config: ChaosConfig, start: float, done: threading.Event,
                records: list[FaultRecord]) -> None:
    for fault in fault_plan(config):
        if done.wait(max(0.0, start + fault.at_s - time.monotonic())) \
                or time.monotonic() - start >= config.duration_s:  # the previous fault outlasted the load
            return
        worker = cluster.workers[fault.role][fault.index]
        record = FaultRecord(fault.kind, f"{fault.role}[{fault.index}] {worker.address}", time.monotonic() - start)
        records.append(record)
        print(f"[{record.started_s:6.1f} s] {fault.describe()} ({worker.address})", flush=True)
        try:
            inject(fault.kind, worker, config)
            if wait_back(lambda w=worker: cluster.in_rotation(w)):
                record.back_s = time.monotonic() - start
        except Exception as exc:  # noqa: BLE001 - reported as the fault's error, the run goes on
            record.error = repr(exc)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
