"""A throwaway CA and a server certificate it signed (localhost, 127.0.0.1), made with the openssl CLI."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.cluster_auth.dev_pki import make_ca, make_cert


@dataclass
class TlsFiles:
    ca: str
    """The CA certificate clients trust."""
    cert: str
    key: str


def make_tls_files(directory: Path, name: str = "server") -> TlsFiles:
    make_ca(directory)
    files = make_cert(directory, "ca", name)
    return TlsFiles(files.ca, files.cert, files.key)
