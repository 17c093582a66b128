"""Fixtures for the kv_transfer tests: backends and child-process peers."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from peers import SMOLLM2, run_peer  # noqa: E402

HAVE_NIXL = importlib.util.find_spec("nixl") is not None
BACKENDS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not HAVE_NIXL, reason="nixl not installed"))]


class Peer:
    """Handle on a child process hosting one kv_transfer side."""

    def __init__(self, role: str, backend: str, num_blocks: int = 64, seed: int = 1,
                 fault: str = "", dtype: str = "float32", lib: str = "numpy", **layout_overrides):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.stalled, self.unstall = ctx.Event(), ctx.Event()
        self.layout = {**SMOLLM2, "dtype": dtype, **layout_overrides}
        spec = dict(role=role, backend=backend, num_blocks=num_blocks, seed=seed, fault=fault,
                    layout=self.layout, lib=lib)
        self.proc = ctx.Process(target=run_peer, args=(child, spec, self.stalled, self.unstall),
                                daemon=True)
        self.proc.start()
        child.close()
        try:
            hello = self._reply(120)
        except BaseException:
            self.kill()
            raise
        self.peer_info = hello["peer_info"]
        self.backend = hello["backend"]

    def _reply(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError("peer process did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer error:\n{value}")
        return value

    def call(self, *cmd, timeout: float = 60):
        """Send a command and return its result."""
        self.conn.send(cmd)
        return self._reply(timeout)

    def kill(self) -> None:
        """SIGKILL the child."""
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        self.conn.close()

    def close_and_check(self) -> dict:
        """Close the side in the child, assert nothing leaked there, stop the child."""
        stats = self.call("close")
        assert_no_leak(stats, closed=True)
        self.conn.close()
        self.proc.join(10)
        return stats


def assert_no_leak(stats: dict, closed: bool = False) -> None:
    """Nothing in flight; after close also nothing registered, prepared or connected."""
    assert stats["in_flight"] == 0, stats
    assert stats.get("nixl_xfers", 0) == 0, stats
    if closed:
        for key in ("registered_regions", "prepped_dlists", "remote_agents", "connections", "links"):
            assert stats.get(key, 0) == 0, (key, stats)
        assert stats.get("extra_threads", 0) <= 0, stats


@pytest.fixture
def peers():
    """Factory of child peers; kills leftovers at teardown."""
    made: list[Peer] = []

    def make(*args, **kwargs) -> Peer:
        p = Peer(*args, **kwargs)
        made.append(p)
        return p
    yield make
    for p in made:
        p.kill()


def _socket_fds() -> int:
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return fds


@pytest.fixture
def thread_guard():
    """Assert the test left no kv_transfer thread and no socket behind in this process."""
    before = {t.ident for t in threading.enumerate()}
    sockets_before = _socket_fds()
    yield
    left = [t.name for t in threading.enumerate()
            if t.ident not in before and t.name.startswith("kv-") and t.is_alive()]
    assert not left, f"threads left behind: {left}"
    assert _socket_fds() <= sockets_before, "sockets left open"
