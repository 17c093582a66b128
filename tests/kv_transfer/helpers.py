"""Helpers of the kv_transfer tests: backends, child-process peers, leak checks."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal

import pytest

from .peers import SMOLLM2, kv_tls_files, run_peer

HAVE_NIXL = importlib.util.find_spec("nixl") is not None
#: "tcp-staged" is the TCP data path through host staging buffers (what a CUDA pool uses),
#: run on CPU pools with ``staging="always"``: same pipeline, host copies instead of CUDA ones.
#: Two processes of one host share the staging buffers (blocks skip the socket);
#: "tcp-staged-socket" turns that off, so the blocks cross the socket as between hosts.
#: "tcp-tls" is the TCP data path over mutual TLS (certificates of a throwaway CA, see ``kv_tls_files``).
BACKENDS = ["tcp", "tcp-staged", "tcp-staged-socket", "tcp-tls",
            pytest.param("nixl", marks=pytest.mark.skipif(not HAVE_NIXL, reason="nixl not installed"))]


def label(backend: str) -> str:
    """The ``backend_name`` a side built from a test backend name reports."""
    return "tcp-staged" if backend.startswith("tcp-staged") else "tcp" if backend == "tcp-tls" else backend


#: Transfer id -> the capability a child sender issued for it (the router's job in a cluster:
#: hand the capability from the prefill worker's handle to the decode worker).
CAPABILITIES: dict[str, str] = {}


def cap(transfer_id: str) -> str:
    """The capability a child sender's ``expect`` issued for ``transfer_id``."""
    return CAPABILITIES[transfer_id]


def _context():
    """Children forked from a fork server that has imported the peers' modules once (~0.05 s a child,
    against ~1.5 s for a fresh interpreter each; torch and nixl, where a peer needs them, are imported
    there too). The fork server is single-threaded and never touches CUDA, so a child starts as clean
    as a spawned one; it has the environment of the fork server's start, so a peer passes on its
    ``PDSERVE_TEST_*`` variables in the spec."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["pytest", "tests.kv_transfer.helpers", "kv_transfer", "torch", "nixl"])
    return ctx


class Peer:
    """Handle on a child process hosting one kv_transfer side."""

    def __init__(self, role: str, backend: str, num_blocks: int = 64, seed: int = 1,
                 fault: str = "", dtype: str = "float32", lib: str = "numpy", config: dict | None = None,
                 **layout_overrides):
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.stalled, self.unstall = ctx.Event(), ctx.Event()
        self.layout = {**SMOLLM2, "dtype": dtype, **layout_overrides}
        if backend == "tcp-tls":
            kv_tls_files()  # made here, before the child starts: it finds them through the environment
        spec = dict(role=role, backend=backend, num_blocks=num_blocks, seed=seed, fault=fault,
                    layout=self.layout, lib=lib, config=config or {},
                    env={k: v for k, v in os.environ.items() if k.startswith("PDSERVE_TEST_")})
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
        out = self._reply(timeout)
        if cmd[0] in ("expect", "expect_many"):
            CAPABILITIES.update(out)
        return out

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
    assert stats.get("staging_in_use", 0) == 0, stats
    if closed:
        for key in ("registered_regions", "prepped_dlists", "remote_agents", "connections", "links",
                    "cuda_ipc_mapped", "shm_mapped", "staging_sets"):
            assert stats.get(key, 0) == 0, (key, stats)
        assert stats.get("extra_threads", 0) <= 0, stats


def socket_fds() -> int:
    """Open socket file descriptors of this process."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return fds
