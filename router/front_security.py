"""TLS and API keys of the router's public fronts (gRPC Generation, OpenAI HTTP).

Both are off unless configured, so a loopback router keeps working with plain
clients (`pdserve generate --url`, `grpcurl -plaintext`); a router bound to any
other address without them logs a warning. Health checks (gRPC grpc.health.v1,
HTTP /health) and metrics stay unauthenticated, for probes and scrapers.
"""
from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass, field

from router.auth import ApiKeys

logger = logging.getLogger(__name__)


@dataclass
class FrontSecurityConfig:
    api_key_file: str | None = field(default=None, metadata={
        "flag": "--api-keys-file",
        "help": "file of TENANT:KEY lines; then Generate, Abort and /v1 need 'authorization: Bearer KEY' "
                "(keys may also come from $PDSERVE_API_KEYS, comma-separated; never on the command line)"})
    """File of `TENANT:KEY` lines (router/auth.py); with it (or $PDSERVE_API_KEYS) every Generate,
    Abort and /v1 call needs `authorization: Bearer KEY`. Re-read when it changes."""
    tls_cert_file: str | None = field(default=None, metadata={
        "help": "PEM certificate: the gRPC and HTTP fronts speak TLS only"})
    """PEM certificate chain of the gRPC and HTTP fronts (with tls_key_file): both then speak TLS only.
    Re-read when the files change (router/tls_reload.py)."""
    tls_key_file: str | None = field(default=None, metadata={"help": "PEM private key of --tls-cert-file"})
    """PEM private key of tls_cert_file."""

    def __post_init__(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("give both tls_cert_file and tls_key_file, or neither")
        for name in ("api_key_file", "tls_cert_file", "tls_key_file"):
            path = getattr(self, name)
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"{name}: cannot read {path!r}")
        ApiKeys(self.api_key_file)  # a malformed key file or $PDSERVE_API_KEYS: ValueError now, not at start

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, config: FrontSecurityConfig, keys: ApiKeys) -> list[str]:
    """Log (and return) a warning per missing protection when the fronts listen beyond loopback."""
    if is_loopback(host):
        return []
    warnings = []
    if not keys.enabled:
        warnings.append(f"the public fronts listen on {host} without API keys: anyone who reaches them can "
                        "generate, and read the prefix cache's timing (give --api-key-file or $PDSERVE_API_KEYS)")
    if not config.tls:
        warnings.append(f"the public fronts listen on {host} without TLS: prompts, outputs and API keys cross "
                        "the network in clear (give --tls-cert-file and --tls-key-file)")
    for warning in warnings:
        logger.warning(warning)
    return warnings
