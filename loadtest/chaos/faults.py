"""Carry out one fault on a worker process and bring the worker back, as a kubelet would."""
from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from loadtest.chaos.config import ChaosConfig
from loadtest.chaos.processes import ManagedProcess


@dataclass
class FaultRecord:
    kind: str
    worker: str
    """role[index] address"""
    started_s: float
    """Seconds after the load began."""
    back_s: float | None = None
    """When the worker was back in the router's rotation (None: it never came back)."""
    error: str = ""

    def to_json(self) -> dict:
        return {"kind": self.kind, "worker": self.worker, "started_s": round(self.started_s, 2),
                "back_s": None if self.back_s is None else round(self.back_s, 2), "error": self.error}


def inject(kind: str, worker: ManagedProcess, config: ChaosConfig) -> None:
    """The fault itself; returns once the worker process runs again (restarted or continued)."""
    if kind == "kill":
        worker.kill()
        time.sleep(config.restart_delay_s)
        worker.restart()
    elif kind == "stop":
        worker.send(signal.SIGSTOP)
        time.sleep(config.stop_s)
        worker.send(signal.SIGCONT)
    elif kind == "drain":
        worker.stop(signal.SIGTERM, timeout=config.drain_timeout_s + 30)
        time.sleep(config.restart_delay_s)
        worker.restart()
    else:
        raise ValueError(f"unknown fault {kind!r}")


def wait_back(in_rotation: Callable[[], bool], timeout_s: float = 120.0) -> bool:
    """Poll until the router has the worker in rotation again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if in_rotation():
            return True
        time.sleep(0.2)
    return False
