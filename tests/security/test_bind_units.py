"""Bind only what was asked, the parts without a cluster: which devices UCX may use, the refusal to
join other hosts' Ray without token auth (a real `pdserve serve` process), and where a worker of a
joined cluster binds. The whole `serve` on a host with a second interface: test_listen_addresses.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.cluster_auth import ClusterAuthConfig
from common.cluster_auth.secret import write_secret_file
from kv_transfer.nixl_devices import UCX_NET_DEVICES, interface_of, ucx_devices_for, ucx_net_devices
from pdserve.cluster import ClusterConfig, RayCluster
from pdserve.cluster_placement import NodeSlot, free_ports
from pdserve.ray_network import check_ray_auth
from router.config import RouterConfig
from worker_runtime.config import WorkerConfig


def test_ucx_devices_follow_the_bind_address(tmp_path):
    assert interface_of("127.0.0.1") == "lo" and interface_of("localhost") == "lo"
    assert ucx_net_devices("127.0.0.1", rdma_root=str(tmp_path / "none")) == "lo"
    for dev, ports in (("mlx5_1", ["1"]), ("mlx5_0", ["1", "2"])):  # RDMA ports stay usable: no TCP listener
        for port in ports:
            (tmp_path / "ib" / dev / "ports" / port).mkdir(parents=True)
    assert ucx_net_devices("127.0.0.1", rdma_root=str(tmp_path / "ib")) == "lo,mlx5_0:1,mlx5_0:2,mlx5_1:1"
    assert ucx_net_devices("0.0.0.0") is None and ucx_net_devices("::") is None  # every interface was asked for
    assert ucx_net_devices("203.0.113.77") is None  # no interface holds it: UCX's default, with a warning


def test_ucx_devices_are_set_only_while_the_agent_is_made_and_never_over_the_operators():
    env: dict = {}
    with ucx_devices_for("127.0.0.1", env) as devices:
        assert env[UCX_NET_DEVICES] == devices and devices.split(",")[0] == "lo"
    assert UCX_NET_DEVICES not in env
    env = {UCX_NET_DEVICES: "mlx5_0:1"}
    with ucx_devices_for("127.0.0.1", env) as devices:
        assert devices is None and env[UCX_NET_DEVICES] == "mlx5_0:1"
    assert env == {UCX_NET_DEVICES: "mlx5_0:1"}


@pytest.mark.parametrize("address, mode, refused", [
    ("10.0.0.1:6390", "", True), ("auto", "", True), ("ray://10.0.0.1:10001", "disabled", True),
    ("10.0.0.1:6390", "token", False), ("auto", "TOKEN", False),
    ("127.0.0.1:6379", "", False), ("localhost:6379", "", False), ("[::1]:6379", "", False), (None, "", False)])
def test_joining_other_hosts_needs_ray_token_auth(address, mode, refused):
    if refused:
        with pytest.raises(ValueError, match="RAY_AUTH_MODE=token"):
            check_ray_auth(address, mode)
    else:
        check_ray_auth(address, mode)


def test_serve_refuses_another_hosts_ray_without_token_auth():
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--ray-address", "10.0.0.1:6390"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "RAY_AUTH_MODE=token" in done.stderr, done.stderr[-2000:]


class _Actor:
    """Stands in for `ray.remote(WorkerProcess)`: records the worker config it is started with."""

    started: list = []

    @classmethod
    def options(cls, **options):
        return cls

    @classmethod
    def remote(cls, worker: WorkerConfig, log_level: str):
        cls.started.append(worker)
        return worker


def test_a_joined_clusters_worker_binds_its_nodes_address_not_every_interface(tmp_path):
    auth = ClusterAuthConfig(write_secret_file(str(tmp_path)))
    config = ClusterConfig(RouterConfig(metrics_port=9400), WorkerConfig("decode", auth=auth),
                           ray_address="10.0.0.1:6390", ray_auth_mode="token")
    cluster = RayCluster(config)
    cluster._template, cluster._actor_cls = config.worker, _Actor
    worker = cluster._spawn("decode", NodeSlot("ab" * 28, "10.0.0.2", (50100, 9500)))
    assert (worker.host, worker.advertise_host, worker.port, worker.metrics_port) == ("10.0.0.2", "10.0.0.2",
                                                                                      50100, 9500)
    assert (worker.kv_transfer.host, worker.kv_transfer.public_host) == ("10.0.0.2", "10.0.0.2")
    local = cluster._spawn("prefill", None)  # a worker on this machine stays on the template's loopback
    assert (local.host, local.kv_transfer.host) == ("127.0.0.1", "127.0.0.1")


def test_node_ports_are_probed_on_the_address_the_worker_binds():
    ports = free_ports(2, "127.0.0.1")
    assert len(set(ports)) == 2
    with pytest.raises(OSError):  # an address this machine does not hold (a node behind NAT) fails the probe
        free_ports(1, "203.0.113.77")
