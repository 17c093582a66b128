"""A throwaway PKI made with the ``openssl`` CLI: a CA and certificates it signed (EC P-256).

For a cluster that lives and dies with one process (``pdserve serve --internal-tls``), the
benchmarks and the tests. Production clusters get their certificates from cert-manager
(``deploy/helm``: ``tls.enabled``) or their own CA.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
#: Names every local certificate carries: the addresses a one-host cluster dials.
LOCAL_NAMES = "IP:127.0.0.1,DNS:localhost"


@dataclass(frozen=True)
class CertFiles:
    """One certificate: its chain, its key and the CA it chains to (PEM paths)."""

    cert: str
    key: str
    ca: str


def _openssl(directory: Path, *args: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is needed to make certificates; install it (Debian: openssl)")
    subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True, timeout=60)


def make_ca(directory: str | Path, name: str = "ca", days: int = 2) -> str:
    """A self-signed CA ``name.pem`` / ``name.key`` in ``directory``; returns the certificate's path."""
    d = Path(directory)
    _openssl(d, "req", "-x509", *_EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", str(days),
             "-subj", f"/CN=pdserve {name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign")
    os.chmod(d / f"{name}.key", 0o600)
    return str(d / f"{name}.pem")


def make_cert(directory: str | Path, ca: str, name: str, names: str = LOCAL_NAMES, days: int = 2) -> CertFiles:
    """A certificate ``name`` signed by the CA ``ca`` of ``directory``, good for both ends of a TLS
    connection (serverAuth and clientAuth), with subject alternative names ``names``."""
    d = Path(directory)
    (d / f"{name}.ext").write_text(f"subjectAltName={names}\nbasicConstraints=CA:FALSE\n"
                                   "keyUsage=digitalSignature,keyEncipherment\n"
                                   "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl(d, "req", *_EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    _openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", str(days), "-extfile", f"{name}.ext")
    os.chmod(d / f"{name}.key", 0o600)
    return CertFiles(str(d / f"{name}.pem"), str(d / f"{name}.key"), str(d / f"{ca}.pem"))


def make_cluster_pki(directory: str | Path) -> dict[str, CertFiles]:
    """A fresh CA and one certificate for the workers and one for the router (local names)."""
    make_ca(directory)
    return {role: make_cert(directory, "ca", role) for role in ("worker", "router")}
