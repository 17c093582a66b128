"""A real Prometheus server (the Debian package's /usr/bin/prometheus) for tests, and the PromQL
expressions the shipped dashboards and alert rules contain."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
FILES = REPO / "deploy" / "helm" / "pdserve" / "files"
PROMETHEUS = "/usr/bin/prometheus"
RATE_INTERVAL = "20s"
"""What `$__rate_interval` becomes (Grafana makes it >= 4 scrape intervals; we scrape every second)."""
RANGE = "5m"
"""What `$__range` (the dashboard's time range, for instant queries) becomes."""
COMPARISON = re.compile(r"^(?P<series>.+?)\s*(>|<|>=|<=|==|!=)\s*[0-9.]+$", re.S)
METRIC = re.compile(r"pdserve:[A-Za-z0-9_:]+")


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target of every dashboard, Grafana variables substituted."""
    out = []
    for path in sorted((FILES / "grafana").glob("*.json")):
        dash = json.loads(path.read_text())
        for panel in _panels(dash["panels"]):
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL).replace("$__range", RANGE)
                out.append((f"{path.name}: {panel['title']} [{target['refId']}]", expr))
    return out


def _panels(panels):
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def rule_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every rule; for alerts, the series side of the final comparison."""
    out = []
    for path in sorted((FILES / "prometheus").glob("*.yaml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("alert") or rule.get("record")
                expr = rule["expr"].strip()
                if "alert" in rule:
                    match = COMPARISON.match(expr)
                    assert match, f"{path.name}: {name}: expected '<series> <op> <number>'"
                    expr = match.group("series")
                out.append((f"{path.name}: {name}", expr))
    return out


def rule_files() -> list[Path]:
    return sorted((FILES / "prometheus").glob("*.yaml"))


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


class Prometheus:
    """`prometheus` scraping the given targets every second, with the shipped rule files loaded."""

    def __init__(self, workdir: Path, targets: dict[str, list[str]], port: int) -> None:
        if not Path(PROMETHEUS).exists() and not shutil.which("prometheus"):
            raise AssertionError(f"{PROMETHEUS} is missing: install the Debian package "
                                 "(apt-get install prometheus); .ci/run does")
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(p) for p in rule_files()],
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": hosts}]}
                                     for job, hosts in targets.items()]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS if Path(PROMETHEUS).exists() else "prometheus",
             f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.url + "/-/ready", timeout=2)
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("prometheus did not become ready")

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/PATH; returns the JSON body (errors included: HTTP 400 carries errorType)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = urllib.request.urlopen(url, timeout=30).read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
        return json.loads(body)

    def query(self, expr: str, at: float | None = None) -> dict:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", **params)

    def wait_for_scrape(self, jobs: list[str], timeout: float = 30) -> None:
        """Until every target of these jobs was scraped successfully and recently."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            active = self.api("targets")["data"]["activeTargets"]
            mine = [t for t in active if t["labels"]["job"] in jobs]
            if mine and all(t["health"] == "up" for t in mine):
                return
            time.sleep(0.5)
        raise AssertionError(f"targets not up: {self.api('targets')['data']['activeTargets']}")

    def wait_for_scrapes_after(self, since: float, jobs: list[str], scrapes: int = 2, timeout: float = 30) -> None:
        """Until every target of these jobs was scraped `scrapes` times after `since` (wall-clock seconds):
        what a rate over the latest samples needs, without sleeping for a guessed number of intervals."""
        deadline = time.monotonic() + timeout
        for _ in range(scrapes):
            while True:
                mine = [t for t in self.api("targets")["data"]["activeTargets"] if t["labels"]["job"] in jobs]
                last = [_timestamp(t["lastScrape"]) for t in mine]
                if mine and all(t["health"] == "up" for t in mine) and min(last) > since:
                    since = max(last)
                    break
                assert time.monotonic() < deadline, f"no scrape of {jobs} after {since}"
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def _timestamp(rfc3339: str) -> float:
    """Prometheus's `lastScrape` (RFC 3339, nanosecond fraction) as Unix seconds."""
    from datetime import datetime
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", rfc3339)
    assert match, rfc3339
    head, frac, zone = match.groups()
    stamp = datetime.fromisoformat(head + ("+00:00" if zone == "Z" else zone))
    return stamp.timestamp() + (float(frac) if frac else 0.0)
