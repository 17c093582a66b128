"""Cluster commands refuse bad flags before starting anything: exit 2 and the reason."""
from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    (["serve", "--decode", "0"], "--decode must be >= 1"),
    (["serve", "--prefill", "-1"], "--prefill must be >= 0"),
    (["prefill-worker", "--lease-s", "1", "--pull-timeout-s", "5"], "pull_timeout_s must be shorter than lease_s"),
    (["decode-worker", "--port", "70000"], "port out of range"),
    (["router", "--decode-workers", "nohost"], "worker address must be host:port"),
    (["router", "--decode-workers", "127.0.0.1:1", "--health-interval-s", "0"], "health_interval_s must be > 0"),
    (["generate", "--input", "in.jsonl", "--output", "out.jsonl"], "give --url HOST:PORT"),
    (["router", "--redis-url", "http://127.0.0.1:6379"], "redis_url must start with redis://"),
    (["prefill-worker", "--redis-url", "localhost:6379"], "redis_url must start with redis://"),
    (["router", "--skip-prefill-tokens", "-1"], "skip_prefill_tokens and max_queue_len must be >= 0"),
    (["router", "--overlap-weight", "-2"], "routing weights must be >= 0"),
    (["router", "--queue-timeout-s", "0"], "queue_timeout_s must be > 0"),
    (["router", "--kv-tier-weights", "cpu=lots"], "expected MEDIUM=WEIGHT"),
    (["serve", "--kv-tier-weights", "disk=0.9"], "disk must be in [0, cpu's weight]"),
    (["router", "--routing-policy", "fastest"], "invalid choice: 'fastest'"),
    (["router", "--max-migrations", "-1"], "max_migrations must be an integer >= 0"),
    (["serve", "--stream-timeout-s", "-1"], "stream_timeout_s must be >= 0"),
    (["router", "--tls-cert-file", "/dev/null"], "give both tls_cert_file and tls_key_file"),
    (["router", "--api-key-file", "/nonexistent/keys"], "api_key_file: cannot read"),
    (["router", "--api-keys-file", "/nonexistent/keys"], "api_key_file: cannot read"),
    (["decode-worker", "--internal-tls-cert", sys.executable], "TLS needs a certificate, its key and a CA file"),
    (["decode-worker", "--tls-cert", sys.executable], "TLS needs a certificate, its key and a CA file"),
    (["serve", "--api-key-file", "/dev/null"], "holds no API key"),
    (["router", "--redis-password-file", "/nonexistent/pw"], "redis_password_file: cannot read"),
    (["decode-worker", "--redis-password-file", "/nonexistent/pw"], "redis_password_file: cannot read"),
    (["loadtest", "--url", "127.0.0.1:1", "--tls-ca", "/nonexistent/ca.pem"], "tls_ca_file: cannot read"),
    (["serve", "--internal-tls-cert", sys.executable], "TLS needs a certificate, its key and a CA file together"),
    (["serve", "--internal-tls", *(a for part in ("cert", "key", "ca") for a in (f"--internal-tls-{part}",
                                                                                sys.executable))],
     "--internal-tls makes its own certificates"),
]


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(c[0][:2]) for c in CASES])
def test_bad_flags_exit_2_with_the_reason(args, message):
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr
