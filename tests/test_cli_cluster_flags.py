"""Cluster commands refuse bad flags before starting anything: exit 2 and the reason.

`pdserve.cli.main` runs in this process (one subprocess per case cost ~0.35 s of imports each); a command
whose flags were wrongly accepted fails the test instead of starting. The last test runs the real
`python -m pdserve.cli` once, so the exit status reaches the shell as 2.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve import cli

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
    (["serve", "--pipeline-across-nodes"], "--pipeline-across-nodes needs --ray-address"),
    (["serve", "--ray-address", "10.0.0.1:6379", "--pipeline-across-nodes", "--decode-pipeline-parallel-size", "2"],
     "decode workers whose stages run on other nodes cannot receive"),
    (["serve", "--internal-tls", *(a for part in ("cert", "key", "ca") for a in (f"--internal-tls-{part}",
                                                                                sys.executable))],
     "--internal-tls makes its own certificates"),
]


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(c[0][:2]) for c in CASES])
def test_bad_flags_exit_2_with_the_reason(args, message, monkeypatch, capsys):
    prepare = cli._prepare

    def never_run(namespace):
        prepare(namespace)
        return lambda: pytest.fail(f"{args} was accepted: the command would have started")

    monkeypatch.setattr(cli, "_prepare", never_run)
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_exit_status_reaches_the_shell():
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", *CASES[0][0]], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert CASES[0][1] in done.stderr
