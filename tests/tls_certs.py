"""A throwaway CA and a server certificate it signed (localhost, 127.0.0.1), made with the openssl CLI."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
SERVER_EXTENSIONS = ("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                     "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")


@dataclass
class TlsFiles:
    ca: str
    """The CA certificate clients trust."""
    cert: str
    key: str


def make_tls_files(directory: Path, name: str = "server") -> TlsFiles:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl is not installed")
    d = Path(directory)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", *EC_KEY, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=pdserve test CA")
    run("req", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", "/CN=localhost")
    (d / f"{name}.ext").write_text(SERVER_EXTENSIONS)
    run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return TlsFiles(str(d / "ca.pem"), str(d / f"{name}.pem"), str(d / f"{name}.key"))
