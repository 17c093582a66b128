"""`pdserve chaos` end to end, briefly: two decode workers (they prefill themselves), one killed under
load and restarted on its port; the run passes (exit 0) with every request completed, no leak, and
says so in its table and JSON report."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # a long scenario: `make test-fast` leaves it out
def test_a_short_chaos_run_kills_restarts_and_reports(smollm2_dir, tmp_path):
    report_file = tmp_path / "chaos.json"
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "chaos", "--prefill", "0", "--decode", "2",
                           "--roles", "decode", "--faults", "kill", "--duration-s", "12", "--first-fault-s", "4",
                           "--fault-every-s", "100", "--request-rate", "2", "--random-input-len", "32",
                           "--random-output-len", "24", "--output", str(report_file),
                           "--worker-args", "--dtype float32 --kv-cache-memory-gib 0.25 --num-threads 1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verdict" in done.stdout and "PASS" in done.stdout
    report = json.loads(report_file.read_text())
    assert report["requests"]["sent"] >= 10 and report["requests"]["failed"] == 0
    assert report["requests"]["completed"] == report["requests"]["sent"]
    [fault] = report["faults"]
    assert fault["kind"] == "kill" and fault["worker"].startswith("decode[") and not fault["error"]
    assert fault["back_s"] is not None and fault["back_s"] > fault["started_s"]
    assert report["leaks"] == {}
