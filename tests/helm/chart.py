"""Render the pdserve chart with the real `helm` binary, for tests."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "pdserve"
KUBE_VERSION = "1.35.0"
# The values files the chart is shown with: name -> files under the chart's ci/.
CASES = {
    "defaults": [],
    "raycluster": ["raycluster-values.yaml"],
    "external-redis": ["external-redis-values.yaml"],
    "monitoring": ["monitoring-values.yaml"],
    "security": ["security-values.yaml"],
    "internal-tls": ["internal-tls-values.yaml"],
    "internal-tls-off": ["internal-tls-off-values.yaml"],
    "kv-tiers": ["kv-tiers-values.yaml"],
    "planner": ["planner-values.yaml"],
    "raycluster-planner": ["raycluster-planner-values.yaml"],
}
GENERATED = re.compile(r"^(  (?:redis-password|cluster-secret|ca\.crt|tls\.crt|tls\.key): ).+$", re.MULTILINE)


def find_helm() -> str:
    """$PDSERVE_HELM, then <repo>/.venv/bin/helm (what `make test` installs), then PATH."""
    for candidate in (os.environ.get("PDSERVE_HELM"), REPO / ".venv" / "bin" / "helm", shutil.which("helm")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError("no helm binary: run `python deploy/helm/tools/install_helm.py` (make test does), "
                       "or point PDSERVE_HELM at one")


def helm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run helm; `env`: variables added to this process's environment."""
    return subprocess.run([find_helm(), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env} if env else None)


def values_args(case: str, chart: Path = CHART) -> list[str]:
    return [arg for name in CASES[case] for arg in ("-f", str(chart / "ci" / name))]


def template(*args: str, chart: Path = CHART, raw: bool = False, env: dict[str, str] | None = None) -> str:
    """`helm template` output; raises with helm's message on failure. Unless `raw`, the bundled
    Redis's generated password, the generated cluster secret and the generated internal CA and
    certificate (random at every render) read GENERATED, so renders compare."""
    done = helm("template", "pdserve", str(chart), "--namespace", "llm", "--kube-version", KUBE_VERSION, *args, env=env)
    if done.returncode != 0:
        raise ValueError(done.stderr.strip())
    return done.stdout if raw else GENERATED.sub(r"\1R0VORVJBVEVE", done.stdout)


def objects(rendered: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def pod_specs(objs: list[dict]) -> list[tuple[str, dict]]:
    """(object name/group, pod spec) of every pod template, RayCluster groups included."""
    specs = []
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "StatefulSet"):
            specs.append((name, o["spec"]["template"]["spec"]))
        elif o["kind"] == "RayCluster":
            specs.append((name + "/head", o["spec"]["headGroupSpec"]["template"]["spec"]))
            specs += [(f"{name}/{g['groupName']}", g["template"]["spec"]) for g in o["spec"]["workerGroupSpecs"]]
    return specs


def assert_schema_refuses(setting: str, message: str) -> None:
    """`helm template --set SETTING` fails the values schema, with `message` in what helm says."""
    with pytest.raises(ValueError) as refused:
        template("--set", setting)
    assert "values don't meet the specifications of the schema" in str(refused.value)
    assert message in str(refused.value)
