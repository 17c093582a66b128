"""The chart lints, renders valid Kubernetes objects for every values case, and matches its goldens."""
from __future__ import annotations

import os
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest

from tests.helm.chart import CASES, CHART, KUBE_VERSION, by_kind, helm, objects, pod_specs, values_args
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
    for group in groups.values():
        assert group["rayStartParams"]["num-gpus"] == "1"
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
