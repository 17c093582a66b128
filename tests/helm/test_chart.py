"""The chart lints, renders valid Kubernetes objects for every values case, and matches its goldens."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdserve.cluster import actor_options
from tests.helm.chart import CASES, CHART, KUBE_VERSION, by_kind, helm, objects, pod_specs, template, values_args
from tests.helm.custom_resources import SCHEMAS

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("case", CASES)
def test_helm_lint_strict(case):
    done = helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *values_args(case))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("case", CASES)
def test_every_object_is_valid(case, rendered):
    objs = objects(rendered[case])
    assert objs
    for obj in objs:
        where = f"{case}: {obj['kind']}/{obj['metadata']['name']}"
        custom = SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        try:
            if custom is not None:
                jsonschema.validate(obj, custom)
            else:
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except jsonschema.ValidationError as exc:
            pytest.fail(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{where}: {exc.message}")


@pytest.mark.parametrize("case", CASES)
def test_rendered_output_matches_golden(case, rendered):
    """PDSERVE_UPDATE_GOLDEN=1 rewrites tests/helm/golden/ from the current chart."""
    golden = GOLDEN / f"{case}.yaml"
    if os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1":
        golden.write_text(rendered[case])
    assert golden.exists(), f"no golden for {case}: run with PDSERVE_UPDATE_GOLDEN=1"
    assert rendered[case] == golden.read_text(), f"{case} differs from {golden} (PDSERVE_UPDATE_GOLDEN=1 to accept)"


def test_kinds_per_mode(rendered):
    kinds = {case: sorted({o["kind"] for o in objects(text)}) for case, text in rendered.items()}
    base = ["Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service", "ServiceAccount"]
    assert kinds["defaults"] == sorted(base + ["StatefulSet"])
    assert kinds["raycluster"] == sorted(base + ["HorizontalPodAutoscaler", "RayCluster", "StatefulSet"])
    assert kinds["external-redis"] == base
    assert {"ServiceMonitor", "PodMonitor"} <= set(kinds["monitoring"])


def test_raycluster_has_head_and_gpu_worker_groups(rendered):
    [ray] = by_kind(objects(rendered["raycluster"]), "RayCluster")
    assert ray["apiVersion"] == "ray.io/v1"
    groups = {g["groupName"]: g for g in ray["spec"]["workerGroupSpecs"]}
    assert sorted(groups) == ["decode", "prefill"]
    assert (groups["prefill"]["replicas"], groups["decode"]["replicas"]) == (2, 4)
    for name, group in groups.items():
        assert group["rayStartParams"]["num-gpus"] == "1"
        declared = json.loads(json.loads(group["rayStartParams"]["resources"]))  # KubeRay's quoted JSON
        assert actor_options(name, True, declared) == {"num_cpus": 1, "num_gpus": 1,
                                                        "resources": {f"pdserve_{name}": 1}}
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "exec pdserve serve" in head["args"][0] and "--ray-address auto" in head["args"][0]
    assert by_kind(objects(rendered["raycluster"]), "HorizontalPodAutoscaler")


@pytest.mark.parametrize("case", ["defaults", "raycluster"])
def test_workers_ask_for_gpus_and_rdma_in_requests_and_limits(case, rendered):
    workers = [(n, s) for n, s in pod_specs(objects(rendered[case])) if "prefill" in n or "decode" in n]
    assert len(workers) == 2
    for name, spec in workers:
        resources = spec["containers"][0]["resources"]
        for part in ("requests", "limits"):
            assert resources[part]["nvidia.com/gpu"] == 1, name
            assert resources[part]["rdma/ib"] == 1, name
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert "UCX_TLS" in env
        assert "IPC_LOCK" in spec["containers"][0]["securityContext"]["capabilities"]["add"]


@pytest.mark.parametrize("case", CASES)
def test_pdserve_pods_probe_grpc_health_and_outlive_their_drain(case, rendered):
    for name, spec in pod_specs(objects(rendered[case])):
        container = spec["containers"][0]
        if "pdserve" not in " ".join(container.get("command", []) + container.get("args", [])):
            continue  # Redis, Ray worker pods (their pdserve workers are Ray actors)
        port = container["ports"][[p["name"] for p in container["ports"]].index("grpc")]["containerPort"]
        assert container["startupProbe"]["grpc"] == {"port": port, "service": ""}, name
        assert container["readinessProbe"]["grpc"] == {"port": port, "service": ""}, name
        assert container["livenessProbe"]["grpc"] == {"port": port, "service": "liveness"}, name
        args = container["args"] if container["command"] == ["pdserve"] else container["args"][0].split()
        drain = max(float(args[i + 1]) for i, a in enumerate(args) if a.endswith("drain-timeout-s"))
        sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert spec["terminationGracePeriodSeconds"] > sleep + drain, name


def test_redis_bundled_or_external_with_password_from_a_secret(rendered):
    defaults = objects(rendered["defaults"])
    [redis] = by_kind(defaults, "StatefulSet")
    assert redis["metadata"]["name"] == "pdserve-redis"
    external = objects(rendered["external-redis"])
    assert not by_kind(external, "StatefulSet")
    for name, spec in pod_specs(external):
        env = {e["name"]: e for e in spec["containers"][0].get("env", [])}
        if "PDSERVE_REDIS_URL" not in env:
            continue
        assert env["PDSERVE_REDIS_URL"]["value"] == "rediss://:$(REDIS_PASSWORD)@redis.infra.svc:6380/2", name
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "pdserve-redis", "key": "password"}
    assert "password" not in rendered["external-redis"].replace("key: password", "")


def test_model_from_a_pvc_or_an_init_container(rendered):
    for name, spec in pod_specs(objects(rendered["raycluster"])):
        if "redis" not in name:
            assert {"name": "model", "persistentVolumeClaim": {"claimName": "llama-3-8b-instruct",
                                                               "readOnly": True}} in spec["volumes"], name
    for name, spec in pod_specs(objects(rendered["external-redis"])):
        [init] = spec["initContainers"]
        env = {e["name"]: e for e in init["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token", name
        assert env["MODEL_DIR"]["value"] == "/models/model"
        assert "--model" in spec["containers"][0]["args"]
        assert spec["containers"][0]["args"][spec["containers"][0]["args"].index("--model") + 1] == "/models/model"


DASHBOARD = '{"title": "pdserve sample", "panels": [{"expr": "sum(rate(pdserve:generation_tokens_total[1m]))"}]}\n'
RULES = """groups:
  - name: pdserve-sample
    rules:
      - alert: PdserveSampleDown
        expr: up{job="pdserve"} == 0
        for: 5m
        labels: {severity: critical}
"""


def chart_copy(tmp_path: Path, with_files: bool) -> Path:
    """The chart with files/ replaced: empty, or one sample dashboard and rule file."""
    chart = tmp_path / "pdserve"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("files"))
    if with_files:
        (chart / "files" / "grafana").mkdir(parents=True)
        (chart / "files" / "prometheus").mkdir()
        (chart / "files" / "grafana" / "sample.json").write_text(DASHBOARD)
        (chart / "files" / "prometheus" / "sample.yaml").write_text(RULES)
    return chart


@pytest.mark.parametrize("with_files", [False, True], ids=["no-files", "sample-files"])
def test_monitoring_objects_follow_the_files(tmp_path, with_files):
    chart = chart_copy(tmp_path, with_files)
    objs = objects(template(*values_args("monitoring", chart), chart=chart))
    assert len(by_kind(objs, "ServiceMonitor")) == len(by_kind(objs, "PodMonitor")) == 1
    for obj in by_kind(objs, "ServiceMonitor") + by_kind(objs, "PodMonitor"):
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    dashboards = [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["labels"].get("grafana_dashboard") == "1"]
    rules = by_kind(objs, "PrometheusRule")
    if not with_files:
        assert not dashboards and not rules
        return
    [configmap] = dashboards
    assert configmap["data"] == {"sample.json": DASHBOARD}
    kubernetes_validate.validate(configmap, KUBE_VERSION, strict=True)
    [rule] = rules
    assert rule["spec"]["groups"] == yaml.safe_load(RULES)["groups"]
    jsonschema.validate(rule, SCHEMAS[("monitoring.coreos.com/v1", "PrometheusRule")])
    monitoring_off = objects(template(*values_args("monitoring", chart), "--set", "monitoring.enabled=false",
                                      chart=chart))
    assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"} & {o["kind"] for o in monitoring_off}


BAD_VALUES = [
    ("prefill.replicas=-1", "at '/prefill/replicas': minimum: got -1, want 0"),
    ("routing.policy=fastest", "at '/routing/policy': value must be one of 'prefix', 'least_loaded'"),
    ("image.repository=", "at '/image/repository': minLength: got 0, want 1"),
    ("redis.mode=sentinel", "at '/redis/mode': value must be one of 'bundled', 'external'"),
    ("redis.mode=external", "at '/redis/external/url'"),
    ("model.source=pvc", "at '/model/pvc/claimName': minLength: got 0, want 1"),
    ("mode=kubernetes", "at '/mode': value must be one of 'deployments', 'raycluster'"),
    ("decode.port=70000", "at '/decode/port': maximum: got 70,000, want 65,535"),
    ("router.replicass=2", "additional properties 'replicass' not allowed"),
]


@pytest.mark.parametrize("setting,message", BAD_VALUES, ids=[s for s, _ in BAD_VALUES])
def test_schema_rejects_bad_values_with_a_clear_message(setting, message):
    with pytest.raises(ValueError) as refused:
        template("--set", setting)
    assert "values don't meet the specifications of the schema" in str(refused.value)
    assert message in str(refused.value)


def test_external_redis_url_with_a_password_is_refused():
    with pytest.raises(ValueError, match="at '/redis/external/url'"):
        template("--set", "redis.mode=external", "--set", "redis.external.url=redis://:hunter2@redis:6379/0")
