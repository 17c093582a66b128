"""The public fronts' certificate, re-read when its files change (rotation without a restart).

gRPC asks `grpc_fetcher` on new handshakes (dynamic server credentials) and gets a
new configuration only when the files changed; the HTTP front's SSLContext gets
`load_cert_chain` again from `watch_http`, which polls the files. Connections
already open keep the certificate they were made with; new ones get the new one.
A half-written or mismatched pair (the key replaced before the certificate) is
skipped with a warning, and tried again at the next change.
"""
from __future__ import annotations

import asyncio
import logging
import os
import ssl

import grpc

logger = logging.getLogger(__name__)
HTTP_CHECK_S = 5.0


class CertificateFiles:
    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self._grpc_seen = self._http_seen = self.signature()

    def signature(self) -> tuple:
        """What changes when either file is replaced (Kubernetes swaps a Secret's files by symlink)."""
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in map(os.stat, (self.cert_file, self.key_file)))

    def read(self) -> tuple[bytes, bytes]:
        """(private key, certificate chain) as PEM bytes."""
        with open(self.key_file, "rb") as key, open(self.cert_file, "rb") as cert:
            return key.read(), cert.read()

    # ---- gRPC ------------------------------------------------------------------
    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(grpc.ssl_server_certificate_configuration([self.read()]),
                                                   self.grpc_fetcher)

    def grpc_fetcher(self):
        """Called by gRPC on new handshakes: a new configuration when the files changed, else None."""
        try:
            signature = self.signature()
            if signature == self._grpc_seen:
                return None
            _check_pair(self.cert_file, self.key_file)
            key, cert = self.read()
        except (OSError, ssl.SSLError) as exc:
            logger.warning("TLS certificate not reloaded for gRPC: %s", exc)
            return None
        self._grpc_seen = signature
        logger.info("TLS certificate reloaded for gRPC from %s", self.cert_file)
        return grpc.ssl_server_certificate_configuration([(key, cert)])

    # ---- HTTP (uvicorn) ----------------------------------------------------------
    async def watch_http(self, context: ssl.SSLContext, interval_s: float = HTTP_CHECK_S) -> None:
        """Reload `context`'s certificate whenever the files change; runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                signature = self.signature()
                if signature != self._http_seen:
                    context.load_cert_chain(self.cert_file, self.key_file)
                    self._http_seen = signature
                    logger.info("TLS certificate reloaded for HTTP from %s", self.cert_file)
            except (OSError, ssl.SSLError) as exc:
                logger.warning("TLS certificate not reloaded for HTTP: %s", exc)


def _check_pair(cert_file: str, key_file: str) -> None:
    """Raise ssl.SSLError unless the key matches the certificate (what gRPC would fail on later)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
