"""Several "hosts" on one machine: Linux network namespaces on a bridge, each with its own address.

Names and the private /24 are unique per run (from the pid); traffic stays between the namespaces
made here. Everything is torn down by ``close()`` (processes started in a namespace, the namespaces,
their veth pairs and the bridge), also after a failure half-way through ``__init__``.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def require_netns() -> None:
    """Fail (never skip) with what is missing when namespaces cannot be made here."""
    if shutil.which("ip") is None:
        raise RuntimeError("the multi-host tests need iproute2's `ip` command (Debian: iproute2)")
    if os.geteuid() != 0:
        raise RuntimeError("the multi-host tests make network namespaces and need root")
    probe = f"pdprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"cannot make a network namespace here: {exc.stderr.strip()}") from exc
    _ip("netns", "del", probe)


class Hosts:
    """``count`` namespaces ``<prefix>1..N`` with addresses 10.<net>.<sub>.1..N on one bridge."""

    def __init__(self, count: int) -> None:
        require_netns()
        tag = os.getpid() % 100000
        self.prefix = f"pdh{tag}x"
        self.bridge = f"pdbr{tag}"
        self.subnet = f"10.{200 + tag % 50}.{tag // 50 % 250}"  # distinct for pids less than 12,500 apart
        self.names = [f"{self.prefix}{i}" for i in range(1, count + 1)]
        self.addresses = [f"{self.subnet}.{i}" for i in range(1, count + 1)]
        self._veths: list[str] = []
        self._procs: list[subprocess.Popen] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, (ns, address) in enumerate(zip(self.names, self.addresses, strict=True), 1):
                veth = f"pdv{tag}x{i}"
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._veths.append(veth)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def popen(self, host: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in namespace ``host`` (1-based), in a process group of its own."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host - 1], *argv], start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: int, argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.names[host - 1], *argv], timeout=timeout, **kwargs)

    def kill_matching(self, pattern: str) -> None:
        """SIGKILL every process whose command line contains ``pattern`` (e.g. a private temp dir)."""
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
                continue
            try:
                cmdline = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if pattern in cmdline:
                try:
                    os.kill(int(pid_dir.name), signal.SIGKILL)
                except OSError:
                    pass

    def pids(self, host: int) -> list[int]:
        """The processes running in namespace ``host`` (1-based)."""
        done = subprocess.run(["ip", "netns", "pids", self.names[host - 1]], capture_output=True, text=True,
                              timeout=30, check=True)
        return [int(p) for p in done.stdout.split()]

    def kill_all(self, host: int) -> list[int]:
        """SIGKILL every process in namespace ``host`` (1-based), as if the machine died; their pids."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return pids

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait(10)
        for veth in self._veths:
            subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=30)
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        deadline = time.monotonic() + 10
        while any(Path(f"/run/netns/{ns}").exists() for ns in self.names) and time.monotonic() < deadline:
            time.sleep(0.1)


def lines_until_ready(proc: subprocess.Popen, timeout: float = 600) -> list[str]:
    """The lines `proc` (text stdout) prints, a list that keeps filling, once it printed its `ready:`
    line (or exited, or `timeout` passed: check the list)."""
    output: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            output.append(line)
            if line.startswith("ready:"):
                ready.set()
        ready.set()
    threading.Thread(target=pump, daemon=True).start()
    ready.wait(timeout)
    return output
