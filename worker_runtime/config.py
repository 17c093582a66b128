"""Configuration of one worker process (prefill or decode role)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from common.cluster_auth import ClusterAuthConfig
from common.cluster_auth.tls import InternalTLSConfig
from engine.config import EngineConfig
from kv_transfer import KVTransferConfig

ROLES = ("prefill", "decode")


@dataclass
class WorkerConfig:
    role: str
    """"prefill" (prompts to their first token, KV kept under a lease) or "decode"."""
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"group": "engine"})
    host: str = field(default="127.0.0.1", metadata={"help": "interface the worker's gRPC server binds to"})
    """Interface the gRPC server binds to."""
    port: int = field(default=0, metadata={"help": "gRPC port (0: any free port)"})
    """gRPC port; 0 picks a free one."""
    advertise_host: str | None = field(default=None, metadata={
        "help": "host the router and peers should dial (its gRPC and KV transfer ports)"})
    """Host others should dial (default: host, or this machine's address when host is 0.0.0.0)."""
    auth_names: tuple[str, ...] = field(default=(), metadata={
        "flag": "--auth-name", "append": True, "metavar": "HOST", "group": "security",
        "help": "another host routers may dial this worker by (e.g. a Service DNS name): cluster tokens "
                "addressed to HOST:PORT are accepted too (repeatable)"})
    """Other hosts routers may dial this worker by (e.g. a Service DNS name): with a cluster secret it
    accepts tokens addressed to NAME:PORT for these too, besides its advertised and bound address."""
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig, metadata={"group": "KV transfer"})
    lease_s: float = field(default=30.0, metadata={
        "help": "how long a prefill worker keeps a prompt's KV for a decode worker to pull"})
    """Prefill: how long a prompt's blocks wait for a decode worker to pull them."""
    pull_timeout_s: float = field(default=20.0, metadata={"help": "decode: deadline of one KV pull"})
    """Decode: deadline of one KV pull (keep it below the prefill lease)."""
    peer_pull_timeout_s: float = field(default=2.0, metadata={
        "help": "prefill: deadline of a peer prefix pull; past it the prefix is computed here"})
    """Prefill: deadline of pulling a cached prefix from another worker (router/README.md, "Peer prefix
    pulls"); past it the prefix is computed here instead."""
    max_num_requests: int = field(default=1024, metadata={
        "help": "requests a worker holds at once; more get RESOURCE_EXHAUSTED"})
    """Requests a worker accepts at once (queued + running + transfers); more get RESOURCE_EXHAUSTED."""
    grammar_timeout_s: float = field(default=10.0, metadata={
        "help": "structured outputs: longest a request's schema, regex or grammar may take to compile "
                "(longer: INVALID_ARGUMENT)"})
    """Structured outputs: a constraint compiling longer than this fails its request INVALID_ARGUMENT."""
    num_threads: int = field(default=0, metadata={"help": "torch threads (0: torch's default)"})
    """torch intra-op threads; 0 keeps torch's default."""
    drain_timeout_s: float = field(default=30.0, metadata={
        "help": "on SIGTERM: how long a worker's in-flight requests may take to finish"})
    """On SIGTERM: how long in-flight requests may take to finish before the process exits."""
    metrics_port: int | None = field(default=None, metadata={"help": "serve Prometheus metrics here"})
    """Serve Prometheus metrics at http://HOST:PORT/metrics (None: no metrics server; 0: any free port)."""
    redis_url: str | None = field(default=None, metadata={
        "group": "registry (Redis)",
        "help": "share the worker registry and KV events through this Redis (redis://host:port/db)"})
    """Register in this Redis (heartbeat with a TTL) and publish KV events to it, so routers
    sharing it discover this worker; without it routers are given the address."""
    registry_ttl_s: float = field(default=3.0, metadata={
        "group": "registry (Redis)",
        "help": "lifetime of a worker's registration in Redis (renewed every third of it)"})
    """Lifetime of the registration; renewed every third of it."""
    redis_password_file: str | None = field(default=None, metadata={
        "group": "registry (Redis)",
        "help": "file holding the Redis password (else $REDIS_PASSWORD; keep it out of --redis-url, "
                "which any local user can read in the process list)"})
    """Redis password, read from this file (else $REDIS_PASSWORD, else the one in redis_url)."""
    auth: ClusterAuthConfig = field(default_factory=ClusterAuthConfig, metadata={"group": "security"})
    """Where the cluster secret is (gRPC tokens, KV handshake, handle signatures); none: unauthenticated."""
    tls: InternalTLSConfig = field(default_factory=InternalTLSConfig, metadata={"group": "security"})
    """mTLS on the gRPC port (callers must present a certificate from the CA); none: plaintext."""
    kv_tls: bool = field(default=True, metadata={
        "flag": "--no-kv-tls", "group": "security",
        "help": "with --internal-tls-*: keep the KV transfer links plaintext (HMAC-authenticated only); by "
                "default they speak mutual TLS with the same certificate"})
    """With ``tls``: the KV control channel and TCP data path speak mutual TLS 1.3 with the same
    certificate (its extended key usage must allow clientAuth too); off: only the HMAC handshake."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port out of range: {self.metrics_port}")
        for name in ("lease_s", "pull_timeout_s", "peer_pull_timeout_s", "drain_timeout_s", "registry_ttl_s",
                     "grammar_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.pull_timeout_s >= self.lease_s:
            raise ValueError("pull_timeout_s must be shorter than lease_s")
        if self.max_num_requests < 1:
            raise ValueError("max_num_requests must be >= 1")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        if self.redis_password_file is not None and not os.access(self.redis_password_file, os.R_OK):
            raise ValueError(f"redis_password_file: cannot read {self.redis_password_file!r}")
        if any(not name or ":" in name or "/" in name for name in self.auth_names):
            raise ValueError(f"auth_names must be host names without a port, got {self.auth_names!r}")
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0")
