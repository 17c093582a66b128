"""The cluster secret: read from a file (flag or env var), never from the command line.

Every internal key is derived from it with HMAC-SHA256 under a label, so a key leaked from one
purpose (e.g. KV handshakes) says nothing about another (e.g. handle signatures).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_FILE = "PDSERVE_CLUSTER_SECRET_FILE"
"""Env var naming the secret file (used when no --cluster-secret-file is given)."""
ENV_VALUE = "PDSERVE_CLUSTER_SECRET"
"""Env var holding the secret itself (e.g. a Kubernetes secretKeyRef); the file wins if both are set."""
MIN_SECRET_BYTES = 16
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ClusterKeys:
    """Keys derived from the cluster secret, one per purpose."""

    kv: bytes = field(repr=False)
    """HMAC key of the KV transfer control channel's challenge-response."""
    grpc: bytes = field(repr=False)
    """HMAC key of the per-call tokens on router -> worker gRPC."""
    handle: bytes = field(repr=False)
    """HMAC key of the router's KV handle signatures."""
    events: bytes = field(repr=False)
    """HMAC key of the KV event batches a worker writes to Redis."""
    registry: bytes = field(repr=False)
    """HMAC key of the registrations a worker writes to Redis."""

    @classmethod
    def from_secret(cls, secret: bytes) -> ClusterKeys:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret must have at least {MIN_SECRET_BYTES} bytes")
        return cls(kv=_derive(secret, "kv-handshake"), grpc=_derive(secret, "grpc-token"),
                   handle=_derive(secret, "kv-handle"), events=_derive(secret, "kv-events"),
                   registry=_derive(secret, "worker-registry"))


@dataclass(frozen=True)
class ClusterAuthConfig:
    """Where a process finds the cluster secret. Validated on construction (the file must be readable)."""

    secret_file: str | None = field(default=None, metadata={
        "flag": "--cluster-secret-file",
        "help": "file holding the secret shared by the router and workers: authenticates worker gRPC, KV "
                "transfers and KV handles (or env PDSERVE_CLUSTER_SECRET_FILE / PDSERVE_CLUSTER_SECRET; none: "
                "internal links unauthenticated). `serve` generates one when none is given"})
    """File holding the secret (raw bytes or text; surrounding whitespace is stripped). None: the
    PDSERVE_CLUSTER_SECRET_FILE or PDSERVE_CLUSTER_SECRET env var, else no authentication."""

    def __post_init__(self) -> None:
        if self.secret_file is not None:
            path = Path(self.secret_file)
            if not path.is_file() or not os.access(path, os.R_OK):
                raise ValueError(f"--cluster-secret-file {self.secret_file!r} is not a readable file")

    def load(self) -> ClusterKeys | None:
        """The keys, or None when no secret is configured anywhere."""
        secret = self.read_secret()
        return None if secret is None else ClusterKeys.from_secret(secret)

    def read_secret(self) -> bytes | None:
        path = self.secret_file or os.environ.get(ENV_FILE)
        if path:
            mode = os.stat(path).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                logger.warning("cluster secret file %s is readable by group/others; chmod 600 it", path)
            return Path(path).read_bytes().strip()
        value = os.environ.get(ENV_VALUE)
        return value.strip().encode() if value else None


def write_secret_file(directory: str, secret: bytes | None = None) -> str:
    """Write `secret` (default: a fresh random one, 256 bits as hex) to a new mode-0600 file in
    `directory`; returns its path."""
    fd, path = _mkstemp(directory)
    with os.fdopen(fd, "wb") as f:
        f.write(secret if secret is not None else secrets.token_hex(32).encode())
    return path


def secret_file_for_cluster(config: ClusterAuthConfig, directory: str) -> str:
    """The secret file every process of a local cluster is given: the configured one, or one written
    to `directory` holding the secret of PDSERVE_CLUSTER_SECRET, or a fresh throwaway secret."""
    path = config.secret_file or os.environ.get(ENV_FILE)
    if path:
        return os.path.abspath(path)
    value = os.environ.get(ENV_VALUE)
    return write_secret_file(directory, value.strip().encode() if value else None)


def warn_if_exposed(what: str, host: str, keys: ClusterKeys | None) -> None:
    """Log a warning when `what` binds a non-loopback `host` without authentication."""
    if keys is None and host not in LOOPBACK_HOSTS:
        logger.warning("%s binds %s without authentication: anyone who reaches it can use it. Give every "
                       "component the same --cluster-secret-file (or %s).", what, host, ENV_FILE)


def _derive(secret: bytes, label: str) -> bytes:
    return hmac.new(secret, f"pdserve/{label}".encode(), hashlib.sha256).digest()


def _mkstemp(directory: str) -> tuple[int, str]:
    import tempfile
    return tempfile.mkstemp(prefix="cluster-secret-", dir=directory)  # mkstemp creates it 0600
