"""Mutual TLS on router -> worker gRPC, from PEM files (encryption + certificate identity).

Workers: `--internal-tls-cert/-key/-ca` serve with `require_client_auth` (a caller must present a
certificate signed by the CA). Router: the same flags dial
workers with its client certificate and verify theirs (their certificate must name the address
dialed, e.g. an IP SAN). Independent of the cluster secret, which still gates every call (tokens)
and the KV channel. Workers use the same files for TLS on their KV transfer links (kv_transfer/tls.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc


@dataclass(frozen=True)
class InternalTLSConfig:
    """PEM files of one side of router <-> worker mTLS: all three or none (validated, readable)."""

    cert_file: str | None = field(default=None, metadata={
        "flag": "--internal-tls-cert",
        "help": "PEM certificate this process presents on router <-> worker gRPC and the KV links (mutual TLS, "
                "with --internal-tls-key and --internal-tls-ca)"})
    """This process's certificate chain."""
    key_file: str | None = field(default=None, metadata={
        "flag": "--internal-tls-key", "help": "PEM private key of --internal-tls-cert"})
    """Its private key."""
    ca_file: str | None = field(default=None, metadata={
        "flag": "--internal-tls-ca", "help": "PEM CA the peers' certificates chain to"})
    """CA certificate(s) the peer's certificate must chain to."""
    server_name: str | None = field(default=None, metadata={
        "flag": "--internal-tls-server-name",
        "help": "name the workers' certificates carry, checked instead of the address dialed (e.g. one "
                "certificate for the pool, the chart's <release>-internal)"})
    """Router side: the name the workers' certificates carry, checked instead of the address dialed
    (workers are dialed by pod IP; one certificate for the pool names e.g. ``pdserve-internal``)."""

    def __post_init__(self) -> None:
        given = [f for f in (self.cert_file, self.key_file, self.ca_file) if f]
        if given and len(given) != 3:
            raise ValueError("TLS needs a certificate, its key and a CA file together (or none of them)")
        for path in given:
            if not Path(path).is_file():
                raise ValueError(f"TLS file {path!r} is not a readable file")

    def channel_options(self) -> list[tuple[str, str]]:
        """gRPC channel options of the router's side (the name checked in the workers' certificates)."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return tuple(Path(f).read_bytes() for f in (self.cert_file, self.key_file, self.ca_file))

    def server_credentials(self) -> grpc.ServerCredentials:
        """Worker side: our certificate, and callers must present one signed by the CA."""
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Router side: verify the worker against the CA, present our certificate."""
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
