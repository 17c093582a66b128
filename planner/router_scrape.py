"""Reads every router's /metrics over HTTP (`pdserve planner`). A URL whose host name resolves to
several addresses (a Kubernetes headless Service: one per router pod) is read at each of them."""
from __future__ import annotations

import socket
import urllib.parse
import urllib.request
from collections.abc import Sequence


def expand(url: str) -> list[str]:
    """The URL once per address its host resolves to (IPv4 and IPv6, deduplicated, sorted)."""
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname or not parts.port:
        raise ValueError(f"router metrics URL needs a host and a port: {url!r}")
    infos = socket.getaddrinfo(parts.hostname, parts.port, type=socket.SOCK_STREAM)
    hosts = sorted({info[4][0] for info in infos})
    return [urllib.parse.urlunsplit(parts._replace(netloc=f"[{h}]:{parts.port}" if ":" in h else f"{h}:{parts.port}"))
            for h in hosts]


def read_routers(urls: Sequence[str], timeout_s: float = 5.0) -> list[str]:
    """The metrics text of every router reachable; raises when none answers (a router that is
    down leaves the sum short, but the others' figures still count)."""
    texts, errors = [], []
    for url in urls:
        try:
            targets = expand(url)
        except (OSError, ValueError) as exc:
            errors.append(f"{url}: {exc}")
            continue
        for target in targets:
            try:
                with urllib.request.urlopen(target, timeout=timeout_s) as response:  # noqa: S310 - our own routers
                    texts.append(response.read().decode())
            except OSError as exc:
                errors.append(f"{target}: {exc}")
    if not texts:
        raise ConnectionError("no router metrics could be read: " + "; ".join(errors))
    return texts
