"""API keys of the public fronts: who is calling (their tenant), or None.

Keys come from a file (`--api-key-file`) and/or the environment variable
PDSERVE_API_KEYS, never from the command line. Both hold entries `TENANT:KEY`
(file: one per line, `#` comments and blank lines ignored; env: comma-separated).
An entry without a `:` is a key alone, its own tenant (named after a digest of
the key). Several keys may map to one tenant: that is how a key is rotated
(add the new one, move clients over, remove the old one). The file is re-read
when it changes (checked at most once a second), so rotation needs no restart.

Presented keys are compared in constant time: each is hashed (SHA-256) and the
digest compared with every configured digest by `hmac.compare_digest`, with no
early exit, so neither the position nor a common prefix of a key shows in the
timing.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)
ENV_VAR = "PDSERVE_API_KEYS"
RELOAD_CHECK_S = 1.0
MIN_KEY_CHARS = 16


class ApiKeyError(ValueError):
    """An API key file or variable that cannot be used."""


@dataclass(frozen=True)
class _Key:
    digest: bytes
    tenant: str


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_entries(entries: list[str], source: str) -> list[_Key]:
    """`TENANT:KEY` or `KEY` entries -> keys; raises ApiKeyError naming the source and entry."""
    keys = []
    for number, entry in enumerate(entries, 1):
        entry = entry.strip()
        if not entry or entry.startswith("#"):
            continue
        tenant, sep, key = entry.partition(":")
        if not sep:
            key, tenant = entry, "key-" + _digest(entry).hex()[:12]
        tenant, key = tenant.strip(), key.strip()
        if not tenant:
            raise ApiKeyError(f"{source}, entry {number}: empty tenant before ':'")
        if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
            raise ApiKeyError(f"{source}, entry {number}: a key needs at least {MIN_KEY_CHARS} characters "
                              "and no spaces")
        keys.append(_Key(_digest(key), tenant))
    return keys


class ApiKeys:
    """The configured keys; `enabled` is False when there are none (the fronts then stay open)."""

    def __init__(self, key_file: str | None = None, env: dict[str, str] | None = None) -> None:
        self.key_file = key_file
        env_value = (os.environ if env is None else env).get(ENV_VAR, "")
        self._env_keys = parse_entries(env_value.split(","), f"${ENV_VAR}")
        self._file_keys: list[_Key] = []
        self._file_mtime: float | None = None
        self._checked_at = 0.0
        if key_file is not None:
            self._load_file()
            if not self._file_keys and not self._env_keys:
                raise ApiKeyError(f"{key_file} holds no API key")

    @property
    def enabled(self) -> bool:
        return self.key_file is not None or bool(self._env_keys)

    @property
    def tenants(self) -> set[str]:
        return {k.tenant for k in [*self._env_keys, *self._file_keys]}

    def tenant_of(self, key: str | None) -> str | None:
        """The tenant of a presented key; None for a missing or unknown key."""
        self._maybe_reload()
        if not key:
            return None
        presented = _digest(key)
        found = None
        for entry in [*self._env_keys, *self._file_keys]:  # no early exit: constant time over the keys
            if hmac.compare_digest(presented, entry.digest):
                found = entry.tenant
        return found

    def tenant_of_authorization(self, header: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer KEY` value; None when absent, malformed or unknown."""
        if not header:
            return None
        scheme, _, key = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.tenant_of(key.strip())

    def _maybe_reload(self) -> None:
        if self.key_file is None or time.monotonic() - self._checked_at < RELOAD_CHECK_S:
            return
        try:
            self._load_file()
        except (OSError, ApiKeyError) as exc:  # keep serving with the keys we have
            logger.warning("API key file %s not reloaded: %s", self.key_file, exc)

    def _load_file(self) -> None:
        self._checked_at = time.monotonic()
        mtime = os.stat(self.key_file).st_mtime
        if mtime == self._file_mtime:
            return
        with open(self.key_file, encoding="utf-8") as f:
            keys = parse_entries(f.read().splitlines(), self.key_file)
        if self._file_mtime is not None:
            logger.info("API key file %s reloaded: %d keys", self.key_file, len(keys))
        self._file_keys, self._file_mtime = keys, mtime
