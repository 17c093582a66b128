"""A Ray cluster across three hosts (network namespaces, tests/multihost/netns.py): the head on host 1,
a node declaring the prefill pool on host 2 and one declaring the decode pool on host 3."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.multihost.netns import Hosts, lines_until_ready

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
HEAD_PORT = 6390
POOLS = {2: "prefill", 3: "decode"}
PROBE = [sys.executable, "-c", "import sys, urllib.request; "
         "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"]
"""Prints the body of an HTTP GET of its one argument (run inside a host: metrics endpoints)."""


@dataclasses.dataclass
class RayHosts:
    hosts: Hosts
    env: dict
    """Environment of every Ray process and client (the cluster's auth token)."""
    temp: str
    """Every Ray node's temp dir lies below it (short: Ray's socket paths live there)."""
    pools: dict = dataclasses.field(default_factory=lambda: dict(POOLS))
    """host -> the pool its Ray node declares (`pdserve_<pool>`); a host not in it declares none."""

    @property
    def head(self) -> str:
        return self.hosts.addresses[0]

    def start_node(self, host: int, temp_name: str | None = None, attempts: int = 1) -> None:
        """`ray start` on ``host``: the head on host 1, else a node declaring its pool (POOLS). With
        ``attempts`` > 1 a start that fails (`ray start` gives a raylet 30 s to register, which a busy
        machine may miss) is retried after killing what it left on the host, in a fresh temp dir."""
        temp_dir = f"{self.temp}/{temp_name or f'h{host}'}"
        for attempt in range(1, attempts + 1):
            done = self._start_node(host, temp_dir if attempt == 1 else f"{temp_dir}-{attempt}")
            if done.returncode == 0 or attempt == attempts:
                break
            self.hosts.kill_all(host)
        assert done.returncode == 0, f"ray start on host {host} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"

    @contextlib.contextmanager
    def serve(self, *flags: str):
        """`pdserve serve --ray-address HEAD FLAGS` on host 1; yields the lines it printed (a list that
        keeps filling) once it is ready. On exit: SIGINT (drain and stop) and a clean exit asserted."""
        proc = self.hosts.popen(1, [sys.executable, "-m", "pdserve.cli", "serve", "--ray-address",
                                    f"{self.head}:{HEAD_PORT}", *flags],
                                env=dict(self.env, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            output = lines_until_ready(proc)
            assert proc.poll() is None and any(line.startswith("ready:") for line in output), "".join(output[-40:])
            yield output
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait() == 0, "".join(output[-30:])

    def _start_node(self, host: int, temp_dir: str):
        resources = ["--resources", json.dumps({f"pdserve_{self.pools[host]}": 4})] if host in self.pools else []
        if host == 1:
            argv = [RAY, "start", "--head", "--node-ip-address", self.head, "--port", str(HEAD_PORT),
                    "--num-cpus", "1", "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp_dir,
                    *resources]
        else:
            argv = [RAY, "start", "--address", f"{self.head}:{HEAD_PORT}", "--node-ip-address",
                    self.hosts.addresses[host - 1], "--num-cpus", "2", *resources,
                    "--disable-usage-stats", "--temp-dir", temp_dir]
        return self.hosts.run(host, argv, timeout=180, env=self.env, capture_output=True, text=True)


@contextlib.contextmanager
def ray_cluster(pools: dict | None = None, **env: str):
    """Three hosts with a Ray node each (RayHosts.start_node), torn down on exit; `pools`: what each host's node
    declares (default POOLS); `env` is added to the environment of every Ray process and client."""
    hosts = Hosts(3)
    temp = tempfile.mkdtemp(prefix="pdmh", dir="/tmp")
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0",
               RAY_raylet_start_wait_time_s="120", **env)  # the GCS's wait for a raylet: a busy machine is slow
    cluster = RayHosts(hosts, env, temp, dict(POOLS if pools is None else pools))
    try:
        for host in (1, 2, 3):
            cluster.start_node(host, attempts=2)
        yield cluster
    finally:
        for host in (3, 2, 1):
            hosts.kill_all(host)
        hosts.kill_matching(temp)
        hosts.close()
        shutil.rmtree(temp, ignore_errors=True)


class OneCluster:
    """The package's three-host Ray cluster, one at a time: `get(pools)` gives the running one when its nodes
    declare `pools`, else stops it and starts one that does (the modules asking for other pools run last)."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.cluster: RayHosts | None = None

    def get(self, pools: dict) -> RayHosts:
        if self.cluster is None or self.cluster.pools != pools:
            self.close()
            self.cluster = self._stack.enter_context(ray_cluster(pools=pools))
        for host in (1, 2, 3):  # a test that killed a host and failed before restarting it
            if host > 1 and not self.cluster.hosts.pids(host):
                self.cluster.start_node(host, temp_name=f"h{host}-{secrets.token_hex(3)}", attempts=2)
        return self.cluster

    def close(self) -> None:
        self._stack.close()
        self.cluster = None


@pytest.fixture(scope="package")
def ray_clusters():
    """One three-host Ray cluster at a time for the package (starting one takes tens of seconds)."""
    clusters = OneCluster()
    yield clusters
    clusters.close()


@pytest.fixture
def ray_hosts(ray_clusters):
    """The package's cluster with the prefill pool on host 2 and the decode pool on host 3 (POOLS), a node started
    again on any host whose processes all died."""
    return ray_clusters.get(dict(POOLS))
