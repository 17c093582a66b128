"""Bind only what was asked: `pdserve serve --host 127.0.0.1` on a host with a second interface.

Host 1 is a network namespace with loopback and a veth (10.x) that holds its default route, as a
machine's external interface does; host 2 is a stranger on that network. The real `serve` runs on
host 1 with every address on 127.0.0.1 and moves a prompt's KV from its prefill to its decode worker
(NIXL/UCX when nixl is installed). Then every socket listening on host 1 (serve, Ray's processes,
the worker actors, UCX) must be bound to loopback, and none of their ports may answer on host 1's
10.x address from host 2. Before the fix Ray's GCS, raylet, core workers and autoscaler metrics
listened on every interface, its runtime-env agent and each worker's UCX on the 10.x address.
"""
from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from tests.cluster.harness import WORKER_FLAGS
from tests.multihost.conftest import PROBE
from tests.multihost.netns import Hosts, lines_until_ready

ROUTER_PORT, HTTP_PORT, METRICS_PORT = 50051, 8000, 9400
PROMPT = ", ".join(str(i) for i in range(60))  # ~230 tokens: prefilled remotely, its KV pulled by decode
LISTEN, UDP_BOUND = "0A", "07"


def sockets(pid: int) -> list[tuple[str, str, int, int]]:
    """(protocol, local address, port, inode) of every listening TCP and bound UDP socket in the
    network namespace of `pid`."""
    found = []
    for proto, state in (("tcp", LISTEN), ("tcp6", LISTEN), ("udp", UDP_BOUND), ("udp6", UDP_BOUND)):
        for line in Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != state:
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # per 32-bit word, host order
            ip = ipaddress.ip_address(raw)
            ip = getattr(ip, "ipv4_mapped", None) or ip  # a dual-stack socket's ::ffff:127.0.0.1
            found.append((proto, str(ip), int(port, 16), int(fields[9])))
    return found


def socket_owners(pids: list[int]) -> dict[int, int]:
    """Socket inode -> the pid (of `pids`) holding it."""
    owners = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owners[int(target[8:-1])] = pid
        except OSError:  # gone meanwhile
            continue
    return owners


@pytest.fixture
def hosts():
    hosts = Hosts(2)
    try:  # host 1's veth holds the default route: Ray takes its address for the node's unless told
        subprocess.run(["ip", "-n", hosts.names[0], "route", "add", "default", "dev", "eth0"], check=True,
                       timeout=30)
        yield hosts
    finally:
        hosts.kill_all(1)
        hosts.close()


def test_serve_on_loopback_listens_on_loopback_only(hosts, tmp_path):
    temp = tempfile.mkdtemp(prefix="pdbind", dir="/tmp")  # Ray's session files (short: its socket paths)
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_TMPDIR=temp, RAY_USAGE_STATS_ENABLED="0")
    proc = hosts.popen(1, [sys.executable, "-m", "pdserve.cli", "serve", "--prefill", "1", "--decode", "1",
                           "--host", "127.0.0.1", "--port", str(ROUTER_PORT), "--http-port", str(HTTP_PORT),
                           "--metrics-port", str(METRICS_PORT), *WORKER_FLAGS],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = lines_until_ready(proc)
        assert any(line.startswith("ready:") for line in output), "".join(output[-40:])
        # 1. a prompt whose KV moves from the prefill worker to the decode worker (UCX wires up)
        (tmp_path / "in.jsonl").write_text(json.dumps({"id": "b", "prompt": PROMPT, "temperature": 0,
                                                       "max_tokens": 4, "ignore_eos": True}) + "\n")
        done = hosts.run(1, [sys.executable, "-m", "pdserve.cli", "generate", "--url", f"127.0.0.1:{ROUTER_PORT}",
                             "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")],
                         timeout=300, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads((tmp_path / "out.jsonl").read_text())["usage"]["prompt_tokens"] > 200
        decode_metrics = next(line.split(" at ")[1].strip() for line in output
                              if line.startswith("decode worker metrics at"))
        metrics = hosts.run(1, [*PROBE, decode_metrics], timeout=60, capture_output=True, text=True).stdout
        backend = "nixl" if importlib.util.find_spec("nixl") else "tcp"
        assert f'pdserve:kv_transfer_backend_info{{backend="{backend}"' in metrics  # UCX is in play with nixl

        # 2. every listener on host 1 is serve's or a descendant's, and on loopback
        tree = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
        owners = socket_owners(tree)
        listening = sockets(proc.pid)
        assert {(a, p) for _, a, p, _ in listening} >= {("127.0.0.1", port)
                                                       for port in (ROUTER_PORT, HTTP_PORT, METRICS_PORT)}
        workers = {owners.get(inode) for _, a, _, inode in listening} - {proc.pid, None}
        assert len(workers) >= 4, listening  # Ray's GCS and raylet, the two worker actors at least
        strays = [s for s in listening if s[3] not in owners]
        assert not strays, strays
        exposed = [(proto, address, port, owners[inode], psutil.Process(owners[inode]).name())
                   for proto, address, port, inode in listening if not ipaddress.ip_address(address).is_loopback]
        assert not exposed, exposed

        # 3. from host 2, no port of host 1 answers on its 10.x address
        ports = sorted({p for proto, _, p, _ in listening if proto.startswith("tcp")})
        probe = ("import socket, sys\nopen_ = []\nfor port in map(int, sys.argv[2:]):\n"
                 "    try:\n        socket.create_connection((sys.argv[1], port), timeout=3).close()\n"
                 "        open_.append(port)\n    except OSError:\n        pass\nprint(open_)")
        answered = hosts.run(2, [sys.executable, "-c", probe, hosts.addresses[0], *map(str, ports)], timeout=300,
                             capture_output=True, text=True)
        assert answered.returncode == 0 and answered.stdout.strip() == "[]", (answered.stdout, answered.stderr)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        hosts.kill_all(1)
        shutil.rmtree(temp, ignore_errors=True)
