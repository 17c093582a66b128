"""Every `pdserve` command line the chart's containers run is accepted by the real CLI:
parsed by its argparse parser and validated into config objects (`pdserve.cli._prepare`),
without starting anything. Arguments are expanded as the kubelet does ($(VAR) from the
container's env; the downward API and Secrets get sample values; files of mounted Secrets
get sample contents at a temporary path; a RayCluster with token authentication gets the
RAY_AUTH_MODE KubeRay sets in its containers)."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.helm.chart import CASES, REPO, objects, pod_specs

SAMPLE_FIELDS = {"status.podIP": "10.0.0.7"}
SAMPLE_SECRET = "s3cret"
SAMPLE_SECRET_FILES = {"api-keys": "sample-tenant:sk-sample-0123456789abcdef\n", "tls.crt": "PEM", "tls.key": "PEM",
                       "ca.crt": "PEM"}
CHECK = """
import contextlib, io, json, os, sys
from pdserve.cli import _prepare, build_parser
results = []
for argv, env in json.load(sys.stdin):
    os.environ.pop("RAY_AUTH_MODE", None)
    os.environ.update(env)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _prepare(build_parser().parse_args(argv))
        results.append("")
    except SystemExit:
        results.append(err.getvalue().strip().splitlines()[-1])
    except ValueError as exc:
        results.append(f"error: {exc}")
print(json.dumps(results))
"""


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(container: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        source = entry.get("valueFrom", {})
        if "value" in entry:
            env[entry["name"]] = expand(entry["value"], env)
        elif "fieldRef" in source:
            env[entry["name"]] = SAMPLE_FIELDS[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            env[entry["name"]] = SAMPLE_SECRET
    return env


def pdserve_argv(container: dict) -> list[str] | None:
    """The arguments after `pdserve` in a container, or None if it runs something else."""
    env = container_env(container)
    command, args = container.get("command", []), [expand(a, env) for a in container.get("args", [])]
    if command == ["pdserve"]:
        return args
    if command[:2] == ["/bin/bash", "-lc"] and args and "exec pdserve " in args[0]:
        return shlex.split(args[0].split("exec pdserve ", 1)[1])
    return None


def with_secret_files(argv: list[str], spec: dict, container: dict, root: Path) -> list[str]:
    """`argv` with paths into the container's Secret volumes moved under `root`, where the files
    the Secrets project (volume `items`) hold sample contents, as the kubelet would mount them."""
    secrets = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
    for mount in container.get("volumeMounts", []):
        secret = secrets.get(mount["name"])
        if secret is None:
            continue
        local = root / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        for item in secret.get("items", []):
            (local / item["path"]).write_text(SAMPLE_SECRET_FILES[item["path"]])
        argv = [str(local) + a[len(mount["mountPath"]):] if a.startswith(mount["mountPath"] + "/") else a
                for a in argv]
    return argv


def kuberay_env(objs: list[dict]) -> dict[str, str]:
    """What KubeRay (>= 1.5.1) adds to a RayCluster's containers for `authOptions` (the token itself aside)."""
    ray_clusters = [o for o in objs if o["kind"] == "RayCluster"]
    token = any(o["spec"].get("authOptions", {}).get("mode") == "token" for o in ray_clusters)
    return {"RAY_AUTH_MODE": "token"} if token else {}


def chart_commands(rendered: dict[str, str], root: Path) -> list[tuple[str, list[str], dict[str, str]]]:
    """(where, argv, the env the CLI reads) of every pdserve container."""
    found = []
    for case in CASES:
        objs = objects(rendered[case])
        for name, spec in pod_specs(objs):
            for container in spec.get("initContainers", []) + spec["containers"]:
                argv = pdserve_argv(container)
                if argv is not None:
                    where = f"{case}: {name}/{container['name']}"
                    env = kuberay_env(objs) if name.startswith("RayCluster/") else {}
                    found.append((where, with_secret_files(argv, spec, container, root / str(len(found))), env))
    return found


def test_chart_runs_every_role_with_the_real_cli(rendered, tmp_path):
    commands = chart_commands(rendered, tmp_path)
    subcommands = {where.split(":")[0]: set() for where, _, _ in commands}
    for where, argv, _ in commands:
        subcommands[where.split(":")[0]].add(argv[0])
    assert subcommands["defaults"] == {"router", "prefill-worker", "decode-worker"}
    assert subcommands["raycluster"] == {"router", "serve"}
    assert all("$(" not in arg for _, argv, _ in commands for arg in argv), "unexpanded $(VAR) in the chart's args"

    done = subprocess.run([sys.executable, "-c", CHECK], input=json.dumps([[argv, env] for _, argv, env in commands]),
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    refused = {where: f"pdserve {shlex.join(argv)}\n    -> {error}"
               for (where, argv, _), error in zip(commands, json.loads(done.stdout), strict=True) if error}
    assert not refused, "the CLI refuses the chart's commands:\n" + "\n".join(f"{w}: {e}" for w, e in refused.items())


def test_the_bundled_redis_command_requires_the_secrets_password(rendered):
    """The chart's Redis container command, run as written (on a free port) with its env from the
    Secret: a real redis-server that refuses clients without the password, which it got on stdin,
    and answers the readiness probe (redis-cli with REDISCLI_AUTH)."""
    import os
    import shutil
    import time

    import pytest
    import redis

    from tests.cluster.harness import free_port

    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server; .ci/run does it)")
    [(spec, container)] = [(s, c) for _, s in pod_specs(objects(rendered["defaults"])) for c in s["containers"]
                           if c["name"] == "redis"]
    port = free_port()
    script = container["args"][0].replace("--port 6379", f"--port {port} --bind 127.0.0.1")
    assert script != container["args"][0]
    env = dict(os.environ, **container_env(container))
    server = subprocess.Popen([*container["command"], script], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(host="127.0.0.1", port=port, password=SAMPLE_SECRET, socket_timeout=5)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).ping()
        cli, *probe_args = container["readinessProbe"]["exec"]["command"]
        probe = [cli, "-p", str(port), *probe_args]
        assert subprocess.run(probe, env=env, capture_output=True, text=True, timeout=10).stdout.strip() == "PONG"
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            assert SAMPLE_SECRET.encode() not in f.read()
    finally:
        server.terminate()
        server.wait(10)
