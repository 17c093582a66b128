"""Configuration of a kv_transfer sender or receiver."""

from __future__ import annotations

import dataclasses
import socket

from .tls import KVTLSFiles

BACKENDS = ("auto", "nixl", "tcp")
STAGING = ("auto", "always")
NIXL_EXPOSE = ("lease", "pool")


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """Settings shared by both sides; validated on construction."""

    backend: str = dataclasses.field(default="auto", metadata={
        "flag": "--kv-transfer-backend", "choices": BACKENDS,
        "help": "auto: NIXL if it imports and a self-test works, else TCP"})
    """``"auto"`` (NIXL if it imports and a self-test works, else TCP), ``"nixl"`` or ``"tcp"``.
    TCP moves CUDA KV too, through pinned host staging buffers (see ``staging``)."""
    host: str = dataclasses.field(default="127.0.0.1", metadata={
        "flag": "--kv-transfer-host", "flag_default": None,
        "help": "interface of the KV transfer listener (default: the gRPC host)"})
    """Address the sender's control listener binds to."""
    port: int = dataclasses.field(default=0, metadata={
        "flag": "--kv-transfer-port", "help": "port of the KV transfer listener (0: any free port)"})
    """Port of the sender's control listener; 0 picks a free one."""
    advertise_host: str | None = dataclasses.field(default=None, metadata={
        "flag": "--advertise-host", "help": "host peers dial for KV transfers"})
    """Host written into the peer info handed to receivers (default: ``host``, or the
    primary address when ``host`` is ``0.0.0.0``); set it behind NAT / in Kubernetes."""
    default_timeout_s: float = 30.0
    """Deadline of a transfer when the caller gives none (seconds from creation)."""
    connect_timeout_s: float = 5.0
    """Receiver: cap on connecting + handshaking with a sender (one attempt)."""
    connect_attempts: int = 4
    """Receiver: handshakes tried per transfer while the sender cuts one short or answers ``busy``
    (strangers filling its port, its caps), 50 ms apart and doubling, within the transfer's deadline.
    A refused TCP connect (no sender there) or a failed proof is not retried."""
    pre_auth_timeout_s: float = 2.0
    """Sender: a connection must prove it holds the key (TLS, ``auth``, ``hello``, a few ms for a real
    peer) within this time, however slowly its bytes trickle in; else it is closed."""
    max_pre_auth_connections: int = 64
    """Sender: connections kept while they have not proven the key (any address). A newcomer to a full
    pool drops the oldest connection of the address holding the most of it (see :mod:`kv_transfer.admission`)."""
    max_connections: int = 256
    """Sender: proven receiver connections served at once (one thread each); a proven peer over it is
    refused with ``busy`` (it retries). Strangers never count here."""
    max_connections_per_peer: int = 64
    """Sender: proven connections one peer address may hold open; more are refused with ``busy``."""
    idle_timeout_s: float = 300.0
    """A sender closes a connection that has sent nothing for this long after its handshake; a
    receiver reconnects a link it has not used for half of it rather than reuse it."""
    auth_key: bytes | None = dataclasses.field(default=None, repr=False)
    """Key of the control channel's HMAC handshake (derived from the cluster secret, at least 16
    bytes; both sides need the same). None: the link is not authenticated (a loopback-only
    cluster) and a peer that does authenticate is refused."""
    tls: KVTLSFiles | None = None
    """Mutual TLS 1.3 on the control connection and the TCP data path (see :mod:`kv_transfer.tls`);
    both sides must agree. None: plaintext (the HMAC handshake still authenticates)."""
    max_handshake_payload_bytes: int = 4 << 20
    """Largest payload a receiver accepts in the sender's ``hello_ok`` (NIXL agent metadata, KBs)."""
    abort_wait_s: float = 2.0
    """How long ``abort()`` waits for a backend thread to stop touching the blocks."""
    socket_buffer_bytes: int = 0
    """SO_SNDBUF / SO_RCVBUF asked for on data sockets; 0 leaves them to kernel autotuning."""
    nixl_backends: tuple[str, ...] = ("UCX",)
    """NIXL backend plugins to create in the agent."""
    nixl_progress_thread: bool = False
    """Let NIXL run its own progress thread (off: progress on ``check_xfer_state``)."""
    nixl_expose: str = "lease"
    """What a NIXL sender registers for its peers to READ. ``"lease"``: only the blocks of each
    granted transfer, registered at the grant (their metadata rides on it) and deregistered when
    the transfer ends, so a peer holds keys to nothing else (about 50 us a grant on CPU).
    ``"pool"``: the whole pool once, at start (a peer that passed the handshake can READ any block
    while connected: for networks where every peer is trusted)."""
    nixl_self_test: bool = True
    """With ``backend="auto"``, run a loopback NIXL transfer before choosing NIXL."""
    cuda_ipc: bool = True
    """CUDA pools: a receiver on the sender's host (same boot, pid and IPC namespaces) maps the
    sender's pool with CUDA IPC and pulls with one copy kernel, ahead of NIXL and TCP (see
    :mod:`kv_transfer.cuda_ipc`). Off: such peers use the backend's own path."""
    staging: str = "auto"
    """TCP data path: ``"auto"`` stages only device (CUDA) memory through host buffers;
    ``"always"`` stages host memory too (runs the staging pipeline on CPU: tests, benchmarks)."""
    staging_shm: bool = True
    """Staging buffers are shared memory: between two staged sides of one host (same boot and
    pid namespace) the blocks skip the socket (see :mod:`kv_transfer.shm_buffer`)."""
    staging_chunk_bytes: int = 32 << 20
    """Bytes per staging buffer (two per transfer in progress, four when shared with a receiver
    on this host; rounded down to whole blocks, at least one): the unit of the copy pipeline.
    On an H100 32 MiB moved shared-buffer pulls of 1,024 blocks at ~31 GB/s against ~15-19 at
    8 MiB, where per-batch handoffs dominate (BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.host:
            raise ValueError("host must be non-empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        for name in ("default_timeout_s", "connect_timeout_s", "pre_auth_timeout_s", "abort_wait_s",
                     "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("connect_attempts", "max_pre_auth_connections", "max_connections", "max_connections_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.auth_key is not None and (not isinstance(self.auth_key, bytes) or len(self.auth_key) < 16):
            raise ValueError("auth_key must be bytes, at least 16 of them")
        if self.tls is not None and not isinstance(self.tls, KVTLSFiles):
            raise ValueError("tls must be a KVTLSFiles (certificate, key and CA files) or None")
        if self.max_handshake_payload_bytes < 0:
            raise ValueError("max_handshake_payload_bytes must be >= 0")
        if self.socket_buffer_bytes != 0 and self.socket_buffer_bytes < 4096:
            raise ValueError("socket_buffer_bytes must be 0 (kernel autotuning) or >= 4096")
        if self.staging not in STAGING:
            raise ValueError(f"staging must be one of {STAGING}, got {self.staging!r}")
        if self.staging_chunk_bytes <= 0:
            raise ValueError("staging_chunk_bytes must be > 0")
        if self.nixl_expose not in NIXL_EXPOSE:
            raise ValueError(f"nixl_expose must be one of {NIXL_EXPOSE}, got {self.nixl_expose!r}")
        if not self.nixl_backends:
            raise ValueError("nixl_backends must name at least one backend")
        object.__setattr__(self, "nixl_backends", tuple(self.nixl_backends))

    @property
    def public_host(self) -> str:
        """Host receivers should connect to: ``advertise_host``, else ``host``, else
        (when bound to all interfaces) this machine's primary address."""
        if self.advertise_host:
            return self.advertise_host
        if self.host not in ("0.0.0.0", "::"):
            return self.host
        return _primary_address()


def _primary_address() -> str:
    """Address of the interface holding the default route (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.254.254.254", 1))
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()
