"""pdserve processes started as an operator (or a kubelet) would: `pdserve <command> ...`, each
ready once it prints `ready: ... at ADDRESS`; killed, stopped, drained and restarted on the same
address, as a pod restarted behind its Service."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

READY = re.compile(r"^ready: .*? at (\S+)")  # at the line start: a traceback may quote the print
OUTPUT_LINES_KEPT = 2000


@dataclass
class ManagedProcess:
    """One `pdserve` process; `address` once ready."""

    name: str
    args: list[str]
    popen: subprocess.Popen | None = None
    address: str = ""
    output: list[str] = field(default_factory=list)
    log_path: str | None = None
    """Append everything it prints to this file too (kept across restarts)."""

    def start(self, timeout: float = 600) -> ManagedProcess:
        """Run it and wait for its ready line; raises RuntimeError (with its last output) if it never comes."""
        self.address = ""
        self.popen = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *self.args], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      env=dict(os.environ, PYTHONUNBUFFERED="1"))
        found = threading.Event()
        threading.Thread(target=self._pump, args=(self.popen, found), daemon=True).start()
        found.wait(timeout)
        if not self.address:
            self.kill()
            raise RuntimeError(f"{self.name} did not become ready:\n{''.join(self.output[-40:])}")
        return self

    def _pump(self, popen: subprocess.Popen, found: threading.Event) -> None:
        log = open(self.log_path, "a") if self.log_path else None  # noqa: SIM115 - closed below
        for line in popen.stdout:
            if log is not None:
                log.write(line)
                log.flush()
            self.output.append(line)
            del self.output[:-OUTPUT_LINES_KEPT]
            match = READY.match(line)
            if match and not found.is_set():
                self.address = match.group(1)
                found.set()
        found.set()
        if log is not None:
            log.close()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def send(self, sig: int) -> None:
        if self.alive:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: no drain, nothing freed (what an OOM kill or a lost node looks like)."""
        if self.alive:
            self.popen.kill()
            self.popen.wait(10)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        """SIGTERM (drain, then exit) and wait; SIGKILL after `timeout`. A stopped process is continued first."""
        self.signal_stop(sig)
        return self.wait_stopped(timeout)

    def signal_stop(self, sig: int = signal.SIGTERM) -> None:
        """Ask it to stop (continued first, if it was stopped) without waiting."""
        if self.alive:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.send_signal(sig)

    def wait_stopped(self, timeout: float = 30) -> int | None:
        """Wait for it to exit; SIGKILL after `timeout`."""
        if self.alive:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        return None if self.popen is None else self.popen.returncode

    def restart(self, timeout: float = 600) -> ManagedProcess:
        """Start it again on the same port (its address as peers know it stays valid)."""
        if self.alive:
            raise RuntimeError(f"{self.name} is still running")
        port = self.address.rsplit(":", 1)[1] if self.address else "0"
        self.args = [*_without(self.args, "--port"), "--port", port]
        return self.start(timeout)


def _without(args: list[str], flag: str) -> list[str]:
    """`args` minus `flag VALUE`."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def stop_all(procs: Iterable[ManagedProcess], timeout: float = 30) -> None:
    """Stop several at once: each drains in parallel with the others, not one after another."""
    procs = list(procs)
    for proc in procs:
        proc.signal_stop()
    for proc in procs:
        proc.wait_stopped(timeout)
