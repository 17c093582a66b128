"""API keys of the public fronts (router/auth.py) and their config (router/front_security.py)."""
from __future__ import annotations

import os

import pytest

from router import auth
from router.auth import ApiKeyError, ApiKeys
from router.front_security import FrontSecurityConfig, is_loopback, warn_if_exposed
from router.request_builder import effective_cache_salt

KEY_A = "sk-tenant-a-0123456789"
KEY_A2 = "sk-tenant-a-rotated-9876543210"
KEY_B = "sk-tenant-b-0123456789"


def write(path, text: str):
    path.write_text(text)
    return str(path)


def test_keys_map_to_tenants_from_a_file_and_the_environment(tmp_path):
    keys = ApiKeys(write(tmp_path / "keys", f"# comment\n\nalice:{KEY_A}\nalice:{KEY_A2}\n"),
                   env={auth.ENV_VAR: f"bob:{KEY_B}, {'x' * 20}"})
    assert keys.enabled
    assert keys.tenant_of(KEY_A) == keys.tenant_of(KEY_A2) == "alice"
    assert keys.tenant_of(KEY_B) == "bob"
    assert keys.tenant_of("x" * 20).startswith("key-")  # a bare key is its own tenant
    assert keys.tenant_of(KEY_A + "x") is None and keys.tenant_of("") is None and keys.tenant_of(None) is None
    assert keys.tenant_of_authorization(f"Bearer {KEY_B}") == "bob"
    assert keys.tenant_of_authorization(f"bearer  {KEY_B} ") == "bob"
    assert keys.tenant_of_authorization(f"Basic {KEY_B}") is None
    assert keys.tenant_of_authorization(KEY_B) is None


def test_no_keys_means_open_fronts():
    keys = ApiKeys(env={})
    assert not keys.enabled
    assert keys.tenant_of(KEY_A) is None


@pytest.mark.parametrize("text", ["alice:short", ":" + KEY_A, "alice:has space in it 1234"])
def test_unusable_keys_are_refused_naming_the_entry(tmp_path, text):
    with pytest.raises(ApiKeyError, match="entry 1"):
        ApiKeys(write(tmp_path / "keys", text + "\n"), env={})


def test_an_empty_key_file_is_refused(tmp_path):
    with pytest.raises(ApiKeyError, match="no API key"):
        ApiKeys(write(tmp_path / "keys", "# nothing\n"), env={})


def test_the_key_file_is_reloaded_when_it_changes(tmp_path, monkeypatch):
    path = write(tmp_path / "keys", f"alice:{KEY_A}\n")
    keys = ApiKeys(path, env={})
    write(tmp_path / "keys", f"alice:{KEY_A2}\n")  # rotation: the old key is gone
    stat = os.stat(path)
    os.utime(path, (stat.st_atime, stat.st_mtime + 5))
    assert keys.tenant_of(KEY_A) == "alice"  # checked at most once a second
    monkeypatch.setattr(auth, "RELOAD_CHECK_S", 0.0)
    assert keys.tenant_of(KEY_A) is None
    assert keys.tenant_of(KEY_A2) == "alice"


def test_a_broken_reload_keeps_the_previous_keys(tmp_path, monkeypatch):
    path = write(tmp_path / "keys", f"alice:{KEY_A}\n")
    keys = ApiKeys(path, env={})
    write(tmp_path / "keys", "alice:short\n")
    stat = os.stat(path)
    os.utime(path, (stat.st_atime, stat.st_mtime + 5))
    monkeypatch.setattr(auth, "RELOAD_CHECK_S", 0.0)
    assert keys.tenant_of(KEY_A) == "alice"


def test_security_config_is_validated(tmp_path):
    cert = write(tmp_path / "cert.pem", "x")
    with pytest.raises(ValueError, match="both"):
        FrontSecurityConfig(tls_cert_file=cert)
    with pytest.raises(ValueError, match="cannot read"):
        FrontSecurityConfig(api_key_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="entry 1"):
        FrontSecurityConfig(api_key_file=write(tmp_path / "keys", "alice:short\n"))
    assert FrontSecurityConfig(tls_cert_file=cert, tls_key_file=cert).tls


def test_exposure_warnings_only_beyond_loopback(tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("router.example")
    assert warn_if_exposed("127.0.0.1", FrontSecurityConfig(), ApiKeys(env={})) == []
    warnings = warn_if_exposed("0.0.0.0", FrontSecurityConfig(), ApiKeys(env={}))
    assert len(warnings) == 2 and "API keys" in warnings[0] and "TLS" in warnings[1]
    keyed = ApiKeys(write(tmp_path / "keys", f"alice:{KEY_A}\n"), env={})
    assert [w for w in warn_if_exposed("0.0.0.0", FrontSecurityConfig(), keyed) if "without API keys" in w] == []


def test_tenants_never_share_a_salt_whatever_they_send():
    assert effective_cache_salt(None, "") == ""
    assert effective_cache_salt(None, "mine") == "mine"
    assert effective_cache_salt("alice", "") != effective_cache_salt("bob", "")
    assert effective_cache_salt("alice", "s") != effective_cache_salt("bob", "s")
    # A client salt cannot impersonate another tenant's combination.
    assert effective_cache_salt("bob", '"alice", "') != effective_cache_salt("alice", "")
