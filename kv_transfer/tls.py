"""TLS on the KV control channel and the TCP data path (mutual, TLS 1.3, from PEM files).

Both ends present a certificate of the cluster CA (a worker's gRPC certificate serves: it needs
``clientAuth`` as well as ``serverAuth`` in its extended key usage) and refuse a peer whose
certificate does not chain to it. The peer is not checked against the address dialed: handles
name pod IPs, which certificates rarely list. Identity inside the cluster is the HMAC handshake's
(cluster secret) that runs inside TLS; TLS adds encryption and a second, independent credential.

Paths that never cross the network are not wrapped: shared staging buffers and CUDA IPC (one
host, same pid/IPC namespaces). NIXL moves its payloads itself (RDMA / UCX) and is not encrypted
by this: its control messages are, its data relies on network isolation (as in vLLM and Dynamo).
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KVTLSFiles:
    """PEM files of one side: its certificate chain, its key, the CA the peer must chain to."""

    cert_file: str
    key_file: str
    ca_file: str

    def __post_init__(self) -> None:
        for path in (self.cert_file, self.key_file, self.ca_file):
            if not path or not Path(path).is_file():
                raise ValueError(f"KV TLS file {path!r} is not a readable file")

    def context(self, server_side: bool) -> ssl.SSLContext:
        """A TLS 1.3 context that presents our certificate and requires the peer's."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.load_verify_locations(self.ca_file)
        return ctx


def wrap_server(ctx: ssl.SSLContext, sock: socket.socket) -> ssl.SSLSocket:
    """Sender: TLS on an accepted connection. The handshake is left to the caller's ``do_handshake()``,
    so the wrapper can be recorded first (and shut down from another thread while it runs)."""
    return ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)


def wrap_client(ctx: ssl.SSLContext, sock: socket.socket) -> ssl.SSLSocket:
    """Receiver: the TLS handshake on a connected socket (its timeout bounds it)."""
    return ctx.wrap_socket(sock, server_side=False)
