"""The network devices a NIXL agent's UCX may use: the interface of the KV side's bind address.

UCX's TCP transport opens a listener (unauthenticated, port chosen by the OS) on every interface
it may use, and by default it may use them all: a worker whose KV control channel was bound to
127.0.0.1 still had a UCX port open on the host's external address. :func:`ucx_net_devices`
names what a side bound to ``host`` may use instead: the interface that holds ``host``, plus every
RDMA port (InfiniBand, RoCE, EFA: they open no TCP listener, and they carry the fast path between
hosts). :func:`ucx_devices_for` applies it, as ``UCX_NET_DEVICES``, while an agent is created (UCX
reads it then). A wildcard host (``0.0.0.0``, ``::``) asked for every interface and keeps UCX's
default; so does an operator's own ``UCX_NET_DEVICES``.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("pdserve.kv_transfer")

UCX_NET_DEVICES = "UCX_NET_DEVICES"
_SIOCGIFADDR = 0x8915
_WILDCARDS = ("0.0.0.0", "::", "")


def interface_of(address: str) -> str | None:
    """The network interface holding ``address`` (an IP or a name resolving to one); None if none does."""
    try:
        ip = ipaddress.ip_address(socket.getaddrinfo(address, None)[0][4][0].split("%")[0])
    except (OSError, ValueError):
        return None
    for _, name in socket.if_nameindex():
        if ip in _addresses(name):
            return name
    if ip.is_loopback:  # 127.0.0.2 and the like: routed to the loopback interface
        return next((name for _, name in socket.if_nameindex() if _is_loopback(name)), None)
    return None


def rdma_ports(root: str = "/sys/class/infiniband") -> list[str]:
    """UCX names (``mlx5_0:1``) of every RDMA port on this machine."""
    base = Path(root)
    if not base.is_dir():
        return []
    return sorted(f"{dev.name}:{port.name}" for dev in base.iterdir() for port in (dev / "ports").glob("*"))


def ucx_net_devices(host: str, rdma_root: str = "/sys/class/infiniband") -> str | None:
    """``UCX_NET_DEVICES`` for a KV side bound to ``host``: its interface and the RDMA ports. None:
    leave UCX's default (a wildcard host, or an address no interface holds, which is logged)."""
    if host in _WILDCARDS:
        return None
    interface = interface_of(host)
    if interface is None:
        logger.warning("no network interface holds %s: UCX may listen on every interface", host)
        return None
    return ",".join([interface, *rdma_ports(rdma_root)])


@contextlib.contextmanager
def ucx_devices_for(host: str, environ: dict | None = None) -> Iterator[str | None]:
    """Within the block, ``UCX_NET_DEVICES`` restricts UCX to what :func:`ucx_net_devices` names for
    ``host`` (an operator's own value is left alone); yields the devices set, or None."""
    env = os.environ if environ is None else environ
    devices = None if UCX_NET_DEVICES in env else ucx_net_devices(host)
    if devices is None:
        yield None
        return
    env[UCX_NET_DEVICES] = devices
    try:
        yield devices
    finally:
        env.pop(UCX_NET_DEVICES, None)


def _addresses(interface: str) -> set:
    """The interface's IPv4 address (SIOCGIFADDR) and its IPv6 addresses (/proc/net/if_inet6)."""
    found = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            ifreq = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
            found.add(ipaddress.ip_address(ifreq[20:24]))
        except OSError:  # no IPv4 address
            pass
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as table:
        for line in table:
            fields = line.split()
            if len(fields) == 6 and fields[5] == interface:
                found.add(ipaddress.ip_address(bytes.fromhex(fields[0])))
    return found


def _is_loopback(interface: str) -> bool:
    try:
        return Path(f"/sys/class/net/{interface}/type").read_text().strip() == "772"  # ARPHRD_LOOPBACK
    except OSError:
        return interface == "lo"
