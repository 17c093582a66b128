"""The HMAC helpers alone, no network: secret files, derived keys, gRPC tokens, handle signatures,
the KV handshake proofs and capabilities."""
from __future__ import annotations

import os
import stat

import pytest

from common.cluster_auth import ClusterAuthConfig, ClusterKeys, handles, registrations, tokens, write_secret_file
from common.cluster_auth.secret import ENV_FILE, ENV_VALUE, secret_file_for_cluster
from common.protocol import worker_pb2
from kv_transfer import auth as kv_auth

KEYS = ClusterKeys.from_secret(b"s" * 32)
OTHER = ClusterKeys.from_secret(b"t" * 32)


def test_secret_file_is_private_random_and_loads(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_FILE, raising=False)
    monkeypatch.delenv(ENV_VALUE, raising=False)
    a, b = write_secret_file(str(tmp_path)), write_secret_file(str(tmp_path))
    assert stat.S_IMODE(os.stat(a).st_mode) == 0o600
    assert open(a).read() != open(b).read() and len(open(a).read()) == 64
    keys = ClusterAuthConfig(a).load()
    assert keys == ClusterKeys.from_secret(open(a, "rb").read())
    assert len({keys.kv, keys.grpc, keys.handle, keys.events, keys.registry}) == 5, "one key per purpose"
    assert "kv=" not in repr(keys) and open(a).read() not in repr(keys)
    assert ClusterAuthConfig().load() is None  # nothing configured: unauthenticated


def test_secret_from_env_and_validation(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_FILE, raising=False)
    monkeypatch.setenv(ENV_VALUE, "x" * 40)
    assert ClusterAuthConfig().load() == ClusterKeys.from_secret(b"x" * 40)
    path = secret_file_for_cluster(ClusterAuthConfig(), str(tmp_path))  # `serve`: env secret -> a file
    assert open(path, "rb").read() == b"x" * 40
    path_file = write_secret_file(str(tmp_path))
    monkeypatch.setenv(ENV_FILE, path_file)
    assert ClusterAuthConfig().load() == ClusterKeys.from_secret(open(path_file, "rb").read())
    with pytest.raises(ValueError, match="not a readable file"):
        ClusterAuthConfig(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="at least 16"):
        ClusterKeys.from_secret(b"short")


AUD = "10.0.0.7:7001"
BODY = b"\n\x03abc"


def test_grpc_tokens():
    method = "/pdserve.v1.Worker/Prefill"
    token = tokens.mint(KEYS.grpc, method, AUD, BODY, now=1000)
    claim = tokens.check(KEYS.grpc, method, [AUD], token, now=1000)
    assert claim and claim.audience == AUD and claim.body_digest == tokens.body_digest(BODY)
    assert claim.body_digest != tokens.body_digest(BODY + b"x")  # the body is the caller's to compare
    assert tokens.check(KEYS.grpc, method, ["127.0.0.1:1", AUD], token, now=1000).audience == AUD
    assert tokens.check(KEYS.grpc, method, [AUD], token, now=1000 + tokens.MAX_SKEW_S)
    assert not tokens.check(KEYS.grpc, method, [AUD], token, now=1000 + tokens.MAX_SKEW_S + 1)  # too old
    assert not tokens.check(KEYS.grpc, "/pdserve.v1.Worker/Decode", [AUD], token, now=1000)  # other method
    assert not tokens.check(KEYS.grpc, method, ["10.0.0.7:7002", "10.0.0.8:7001"], token, now=1000)  # other worker
    assert not tokens.check(OTHER.grpc, method, [AUD], token, now=1000)  # other secret
    parts = token.split(".")
    other_body = ".".join([*parts[:3], tokens.body_digest(b"other"), parts[4]])
    assert not tokens.check(KEYS.grpc, method, [AUD], other_body, now=1000)  # the digest is under the MAC
    forged = token[:-1] + ("0" if token[-1] != "0" else "1")
    assert not tokens.check(KEYS.grpc, method, [AUD], forged, now=1000)
    non_hex = token.replace(parts[3], "g" * 64)
    for junk in (None, "", "v2", "v2.x.y.z.w", "v1" + token[2:], 5, "v2." + "9" * 400, non_hex):
        assert not tokens.check(KEYS.grpc, method, [AUD], junk, now=1000)
    assert tokens.mint(KEYS.grpc, method, AUD, BODY, now=1000) != token  # fresh nonce per call


def test_a_token_is_accepted_once():
    method = "/pdserve.v1.Worker/Prefill"

    def claim(now: float) -> tokens.Claim:
        return tokens.check(KEYS.grpc, method, [AUD], tokens.mint(KEYS.grpc, method, AUD, BODY, now=now), now=now)

    guard = tokens.ReplayGuard()
    first, second = claim(1000), claim(1000)
    assert guard.first_use(first, now=1000) and guard.first_use(second, now=1000)
    assert not guard.first_use(first, now=1030)  # a replay within the window
    assert guard.num_replays == 1 and len(guard) == 2
    assert guard.first_use(claim(1200), now=1200)
    assert len(guard) == 1  # the expired nonces are forgotten (their tokens no longer check anyway)
    small = tokens.ReplayGuard(max_entries=3)
    minted = [claim(1000) for _ in range(5)]
    assert all(small.first_use(c, now=1000) for c in minted)
    assert len(small) <= 3  # bounded: the oldest are forgotten early
    assert not small.first_use(minted[-1], now=1000)


def test_worker_registrations_are_signed():
    fields = {"role": "decode", "address": AUD, "epoch": 17, "events": "pdserve:kv_events:x:17"}
    stored = {k: str(v).encode() for k, v in fields.items()}  # as Redis hands them back
    stored[registrations.SIGNATURE_FIELD] = registrations.sign(KEYS.registry, fields).encode()
    assert registrations.verify(KEYS.registry, stored)
    assert not registrations.verify(OTHER.registry, stored)
    for name in fields:
        assert not registrations.verify(KEYS.registry, {**stored, name: b"10.6.6.6:7001"}), name
    assert not registrations.verify(KEYS.registry, {k: v for k, v in stored.items() if k != "signature"})
    assert not registrations.verify(KEYS.registry, {**stored, "signature": b"\xff"})


def _handle(**changes) -> worker_pb2.KVHandle:
    fields = dict(peer=worker_pb2.KVPeer(host="10.0.0.1", port=5), transfer_id="req-1", capability="ab" * 16,
                  block_ids=[3, 4, 5], num_tokens=40, worker_address="10.0.0.1:7")
    return worker_pb2.KVHandle(**{**fields, **changes})


def test_handle_signature_binds_every_field_and_the_prompt():
    prompt = list(range(40))
    signed = _handle()
    handles.sign(KEYS.handle, signed, prompt)
    assert len(signed.signature) == 32
    assert handles.verify(KEYS.handle, signed, prompt)
    assert not handles.verify(OTHER.handle, signed, prompt)
    assert not handles.verify(KEYS.handle, signed, prompt[:-1] + [99])  # another prompt
    for change in (dict(peer=worker_pb2.KVPeer(host="evil", port=5)),
                   dict(peer=worker_pb2.KVPeer(host="10.0.0.1", port=6)),
                   dict(peer=worker_pb2.KVPeer(host="10.0.0.1", port=5, tls=True)), dict(transfer_id="req-2"),
                   dict(capability="cd" * 16), dict(block_ids=[3, 4, 6]), dict(num_tokens=41),
                   dict(worker_address="10.0.0.2:7")):
        tampered = _handle(**change)
        tampered.signature = signed.signature
        assert not handles.verify(KEYS.handle, tampered, prompt), change
    unsigned = _handle()
    assert not handles.verify(KEYS.handle, unsigned, prompt)


def test_kv_handshake_proofs_and_capabilities():
    nr, ns = kv_auth.new_nonce(), kv_auth.new_nonce()
    p = kv_auth.proof(KEYS.kv, "receiver", nr, ns)
    assert kv_auth.proof_ok(KEYS.kv, "receiver", nr, ns, p)
    assert not kv_auth.proof_ok(KEYS.kv, "sender", nr, ns, p)  # a reflected proof is not the sender's
    assert not kv_auth.proof_ok(OTHER.kv, "receiver", nr, ns, p)
    assert not kv_auth.proof_ok(KEYS.kv, "receiver", nr, kv_auth.new_nonce(), p)  # replay on a new nonce
    assert not kv_auth.proof_ok(KEYS.kv, "receiver", nr, ns, "")
    assert not kv_auth.proof_ok(KEYS.kv, "receiver", "short", ns, p)
    # without a key on this side only an empty proof passes: a keyed peer is not "authenticated"
    assert kv_auth.proof(None, "receiver", nr, ns) == ""
    assert kv_auth.proof_ok(None, "receiver", nr, ns, "") and not kv_auth.proof_ok(None, "receiver", nr, ns, p)
    cap = kv_auth.new_capability()
    assert len(cap) == 32 and cap != kv_auth.new_capability()
    assert kv_auth.capability_ok(cap, cap)
    assert not kv_auth.capability_ok(cap, cap[:-1] + "x") and not kv_auth.capability_ok(cap, "")
    assert not kv_auth.capability_ok(cap, None) and not kv_auth.capability_ok("", "")


def test_binding_beyond_loopback_without_a_secret_warns(caplog):
    from common.cluster_auth.secret import warn_if_exposed
    with caplog.at_level("WARNING", logger="common.cluster_auth.secret"):
        warn_if_exposed("decode worker gRPC", "127.0.0.1", None)
        warn_if_exposed("decode worker gRPC", "0.0.0.0", KEYS)
        assert not caplog.records
        warn_if_exposed("decode worker gRPC", "0.0.0.0", None)
    assert "without authentication" in caplog.records[0].getMessage()


def test_worker_proof():
    proof = tokens.worker_proof(KEYS.grpc, "c" * 32, AUD)
    assert tokens.worker_proof_ok(KEYS.grpc, "c" * 32, AUD, proof)
    assert not tokens.worker_proof_ok(KEYS.grpc, "d" * 32, AUD, proof)
    assert not tokens.worker_proof_ok(KEYS.grpc, "c" * 32, "10.6.6.6:7001", proof)  # a relay's address
    assert not tokens.worker_proof_ok(OTHER.grpc, "c" * 32, AUD, proof)
    assert not tokens.worker_proof_ok(KEYS.grpc, "c" * 32, AUD, None)


def test_tls_config_wants_all_three_files(tmp_path):
    from common.cluster_auth.tls import InternalTLSConfig
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    assert not InternalTLSConfig().enabled
    assert InternalTLSConfig(str(pem), str(pem), str(pem)).enabled
    with pytest.raises(ValueError, match="together"):
        InternalTLSConfig(str(pem), str(pem))
    with pytest.raises(ValueError, match="not a readable file"):
        InternalTLSConfig(str(pem), str(pem), str(tmp_path / "missing.pem"))
