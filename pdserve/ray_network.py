"""How `pdserve serve` starts or joins Ray without opening ports nobody asked for.

A private cluster (no `--ray-address`) runs on this machine only, so every Ray port (GCS, raylet,
object manager, core workers, runtime-env agent, autoscaler metrics) belongs on the loopback
interface. `ray.init` picks the node address by routing towards the internet and turns an explicit
`_node_ip_address="127.0.0.1"` into that address too, and Ray (2.60) then listens on every
interface; Ray's single-machine switch (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, what it uses on
macOS and Windows) makes the node address the loopback one, and every port follows it.

Joining a cluster (`--ray-address`) reaches other hosts, where Ray's own ports are open to the
network whatever flags `ray start` got: `ray start --node-ip-address` still binds GCS and raylet to
every interface (measured with Ray 2.60). Ray's token authentication (Ray >= 2.52, on with
`RAY_AUTH_MODE=token` on every node) is what keeps strangers out there, so `serve` refuses to join
a cluster beyond this machine's loopback without it.
"""
from __future__ import annotations

import ipaddress
import logging
import os
from urllib.parse import urlsplit

LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_MODE_ENV = "RAY_AUTH_MODE"


def loopback_only_ray() -> None:
    """Make the Ray this process starts a single-machine one on the loopback interface: call it
    before Ray is imported (Ray reads the switch then); Ray's processes inherit it."""
    os.environ[LOOPBACK_ONLY_ENV] = "0"


def init_private_ray(num_cpus: int) -> str:
    """Start a private Ray instance (after :func:`loopback_only_ray`), dashboard off; returns its node
    address. Raises, with Ray stopped again, if Ray did not take the loopback address."""
    import ray

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=True)
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback_host(node_ip):
        ray.shutdown()
        raise RuntimeError(f"Ray bound its private cluster to {node_ip}, not the loopback interface "
                           f"(was ray imported before {LOOPBACK_ONLY_ENV} was set?)")
    return node_ip


def check_ray_auth(ray_address: str | None, auth_mode: str) -> None:
    """Refuse (ValueError) to join a Ray cluster other hosts can reach without Ray's token auth."""
    if ray_address is None or auth_mode.strip().lower() == "token" or is_loopback_host(_host_of(ray_address)):
        return
    raise ValueError(f"--ray-address {ray_address}: Ray's ports on the other hosts take anyone's jobs unless the "
                     f"cluster runs with token authentication: start every node, and serve, with "
                     f"{AUTH_MODE_ENV}=token and the same RAY_AUTH_TOKEN (Ray >= 2.52; the chart's RayCluster does)")


def is_loopback_host(host: str) -> bool:
    """`localhost` or a loopback IP address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(address: str) -> str:
    """The host of a Ray address: `HOST:PORT`, `[V6]:PORT`, `ray://HOST:PORT` or `auto`."""
    return urlsplit("//" + address.split("://", 1)[-1]).hostname or address
