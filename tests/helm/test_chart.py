"""The chart lints, renders valid Kubernetes objects for every values case, and matches its goldens."""
from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdserve.cluster_placement import actor_options
from tests.helm.chart import (
    CASES,
    CHART,
    KUBE_VERSION,
    assert_schema_refuses,
    by_kind,
    helm,
    objects,
    pod_specs,
    template,
    values_args,
)
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
    # every mode: the generated cluster secret (a Secret); bundled Redis: its generated password too
    base = ["Deployment", "NetworkPolicy", "PodDisruptionBudget", "Secret", "Service", "ServiceAccount"]
    assert kinds["defaults"] == sorted(base + ["StatefulSet"])
    assert kinds["raycluster"] == sorted(base + ["HorizontalPodAutoscaler", "RayCluster", "StatefulSet"])
    assert kinds["external-redis"] == base
    assert {"ServiceMonitor", "PodMonitor"} <= set(kinds["monitoring"])
    assert kinds["security"] == sorted(base + ["Certificate", "StatefulSet"])


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
        if container["name"] == "planner":
            continue  # HTTP probes on its metrics port, nothing to drain (test_chart_planner.py)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        port = ports["grpc"]
        if case == "security" and "router" in name:  # TLS on: the kubelet's gRPC probes speak no TLS
            health = {"path": "/health", "port": ports["http"], "scheme": "HTTPS"}
            assert container["startupProbe"]["httpGet"] == container["readinessProbe"]["httpGet"] == health, name
            assert container["livenessProbe"]["tcpSocket"] == {"port": port}, name
        elif case != "internal-tls-off" and ("prefill" in name or "decode" in name):  # mTLS-only gRPC: HTTP probes
            assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": ports["metrics"]}, name
        else:
            assert container["startupProbe"]["grpc"] == {"port": port, "service": ""}, name
            assert container["readinessProbe"]["grpc"] == {"port": port, "service": ""}, name
            assert container["livenessProbe"]["grpc"] == {"port": port, "service": "liveness"}, name
        args = container["args"] if container["command"] == ["pdserve"] else container["args"][0].split()
        drain = max(float(args[i + 1]) for i, a in enumerate(args) if a.endswith("drain-timeout-s"))
        sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert spec["terminationGracePeriodSeconds"] > sleep + drain, name


def redis_password_refs(objs: list[dict]) -> dict[str, dict]:
    """Pod/container -> the secretKeyRef of its REDIS_PASSWORD, for containers given a Redis URL."""
    refs = {}
    for name, spec in pod_specs(objs):
        for container in spec["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            if "PDSERVE_REDIS_URL" in env or "redis-server" in " ".join(container.get("args", [])):
                refs[f"{name}/{container['name']}"] = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
                assert "REDIS_PASSWORD" not in " ".join(container.get("args", [])).replace('"$REDIS_PASSWORD"', "")
    return refs


def test_redis_bundled_or_external_with_password_from_a_secret_never_on_a_command_line(rendered):
    defaults = objects(rendered["defaults"])
    [redis] = by_kind(defaults, "StatefulSet")
    assert redis["metadata"]["name"] == "pdserve-redis"
    [secret] = [s for s in by_kind(defaults, "Secret") if s["metadata"]["name"] == "pdserve-redis-auth"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # survives upgrades
    refs = redis_password_refs(defaults)
    assert len(refs) == 4  # router, prefill, decode, redis itself
    assert all(ref == {"name": "pdserve-redis-auth", "key": "redis-password"} for ref in refs.values()), refs
    # Redis gets requirepass on stdin; redis-cli (the probe) its password from REDISCLI_AUTH.
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0].startswith("exec redis-server - ") and 'requirepass "$REDIS_PASSWORD"' in \
        container["args"][0]
    assert {e["name"] for e in container["env"]} == {"REDIS_PASSWORD", "REDISCLI_AUTH"}

    external = objects(rendered["external-redis"])
    assert not by_kind(external, "StatefulSet")
    refs = redis_password_refs(external)
    assert refs and all(ref == {"name": "pdserve-redis", "key": "password"} for ref in refs.values()), refs
    for name, spec in pod_specs(external):
        env = {e["name"]: e for e in spec["containers"][0].get("env", [])}
        assert env["PDSERVE_REDIS_URL"]["value"] == "rediss://redis.infra.svc:6380/2", name
    assert "password" not in rendered["external-redis"].replace("key: password", "")
    security = redis_password_refs(objects(rendered["security"]))
    assert all(ref == {"name": "pdserve-redis-password", "key": "password"} for ref in security.values())


def test_the_generated_redis_password_and_cluster_secret_are_random_per_install():
    renders = [{s["metadata"]["name"]: s["data"] for s in by_kind(objects(template(raw=True)), "Secret")}
               for _ in range(2)]
    for name, key, size in (("pdserve-redis-auth", "redis-password", 32),
                            ("pdserve-cluster-secret", "cluster-secret", 64)):
        first, second = (r[name][key] for r in renders)
        assert first != second
        assert len(base64.b64decode(first)) == size


def cluster_secret_refs(objs: list[dict]) -> dict[str, dict]:
    """Pod/container -> the secretKeyRef of its PDSERVE_CLUSTER_SECRET, for every pdserve container."""
    refs = {}
    for name, spec in pod_specs(objs):
        for container in spec["containers"]:
            if container["name"] == "redis":
                continue
            env = {e["name"]: e for e in container.get("env", [])}
            refs[f"{name}/{container['name']}"] = env["PDSERVE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
            assert "secret" not in " ".join(container.get("args", [])).lower().replace("secretkeyref", ""), name
    return refs


def test_every_pdserve_container_gets_the_cluster_secret_from_one_secret(rendered):
    defaults = objects(rendered["defaults"])
    refs = cluster_secret_refs(defaults)
    assert sorted(refs) == ["Deployment/pdserve-decode/decode-worker", "Deployment/pdserve-prefill/prefill-worker",
                            "Deployment/pdserve-router/router"]
    assert all(ref == {"name": "pdserve-cluster-secret", "key": "cluster-secret"} for ref in refs.values())
    [generated] = [s for s in by_kind(defaults, "Secret") if s["metadata"]["name"] == "pdserve-cluster-secret"]
    assert generated["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    ray = cluster_secret_refs(objects(rendered["raycluster"]))
    assert len(ray) == 4 and all(ref["name"] == "pdserve-cluster-secret" for ref in ray.values()), ray
    own = objects(template("--set", "clusterSecret.name=mine", "--set", "clusterSecret.key=s"))
    assert "pdserve-cluster-secret" not in [s["metadata"]["name"] for s in by_kind(own, "Secret")]
    assert all(ref == {"name": "mine", "key": "s"} for ref in cluster_secret_refs(own).values())


def test_the_ray_workers_get_the_redis_password_and_the_dashboard_stays_local(rendered):
    objs = objects(rendered["raycluster"])
    refs = redis_password_refs(objs)
    assert sorted(refs) == ["Deployment/pdserve-router/router", "RayCluster/pdserve/decode/ray-worker",
                            "RayCluster/pdserve/head/ray-head", "RayCluster/pdserve/prefill/ray-worker",
                            "StatefulSet/pdserve-redis/redis"]
    [ray] = by_kind(objs, "RayCluster")
    head = ray["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    assert 8265 not in [p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]]



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
    ("model.quantization=int4", "at '/model/quantization': value must be one of"),
    ("model.kvCacheDtype=int8", "at '/model/kvCacheDtype': value must be one of 'auto', 'fp8', 'fp8_e4m3'"),
]


@pytest.mark.parametrize("setting,message", BAD_VALUES, ids=[s for s, _ in BAD_VALUES])
def test_schema_rejects_bad_values_with_a_clear_message(setting, message):
    assert_schema_refuses(setting, message)


def test_weight_quantization_reaches_every_worker_and_only_when_set():
    def engine_args(objs: list[dict]) -> list[list[str]]:
        containers = [c for o in objs if o["kind"] == "Deployment" for c in o["spec"]["template"]["spec"]["containers"]]
        return [c["args"] for c in containers if "--dtype" in c.get("args", [])]

    quantized = engine_args(objects(template("--set", "model.quantization=int8")))
    assert len(quantized) == 2, "prefill and decode workers"
    assert all(args[args.index("--quantization") + 1] == "int8" for args in quantized)
    assert all("--quantization" not in args for args in engine_args(objects(template())))


def test_kv_cache_dtype_reaches_every_engine_only_when_set(rendered):
    assert "--kv-cache-dtype" not in "".join(rendered.values())
    fp8 = template("--set", "model.kvCacheDtype=fp8")
    assert fp8.count("- --kv-cache-dtype\n") == fp8.count("- --kv-cache-memory-gib\n") > 0
    assert "- --kv-cache-dtype\n            - fp8\n" in fp8


def test_external_redis_url_with_a_password_is_refused():
    with pytest.raises(ValueError, match="at '/redis/external/url'"):
        template("--set", "redis.mode=external", "--set", "redis.external.url=redis://:hunter2@redis:6379/0")


def test_tensor_parallel_sizes_reach_each_pool_and_need_a_gpu_per_rank():
    two_gpus = ("--set", "decode.tensorParallelSize=2", "--set-string", r"decode.resources.limits.nvidia\.com/gpu=2",
                "--set-string", r"decode.resources.requests.nvidia\.com/gpu=2")
    deployments = by_kind(objects(template(*two_gpus)), "Deployment")
    sizes = {d["metadata"]["name"].rsplit("-", 1)[1]: c["args"][c["args"].index("--tensor-parallel-size") + 1]
             for d in deployments for c in d["spec"]["template"]["spec"]["containers"]
             if "--tensor-parallel-size" in c.get("args", [])}
    assert sizes == {"prefill": "1", "decode": "2"}
    ray = template("--set", "mode=raycluster", *two_gpus)
    assert "--prefill-tensor-parallel-size 1\n" in ray and "--decode-tensor-parallel-size 2\n" in ray
    with pytest.raises(ValueError, match=r"decode.tensorParallelSize=2 x pipelineParallelSize=1 needs "
                                         r"decode.resources.limits nvidia.com/gpu >= 2 \(one GPU per rank\), got 1"):
        template("--set", "decode.tensorParallelSize=2")
    assert_schema_refuses("prefill.tensorParallelSize=0", "at '/prefill/tensorParallelSize'")


def test_pipeline_stages_reach_each_pool_and_need_a_gpu_per_rank_of_every_stage():
    shape = ("--set", "prefill.pipelineParallelSize=2", "--set", "prefill.tensorParallelSize=2",
             "--set-string", r"prefill.resources.limits.nvidia\.com/gpu=4",
             "--set-string", r"prefill.resources.requests.nvidia\.com/gpu=4")
    deployments = by_kind(objects(template(*shape)), "Deployment")
    stages = {d["metadata"]["name"].rsplit("-", 1)[1]: c["args"][c["args"].index("--pipeline-parallel-size") + 1]
              for d in deployments for c in d["spec"]["template"]["spec"]["containers"]
              if "--pipeline-parallel-size" in c.get("args", [])}
    assert stages == {"prefill": "2", "decode": "1"}
    ray = template("--set", "mode=raycluster", *shape)
    assert "--prefill-pipeline-parallel-size 2\n" in ray and "--decode-pipeline-parallel-size 1\n" in ray
    with pytest.raises(ValueError, match=r"prefill.tensorParallelSize=2 x pipelineParallelSize=2 needs "
                                         r"prefill.resources.limits nvidia.com/gpu >= 4 \(one GPU per rank\), got 2"):
        template(*shape[:4], "--set-string", r"prefill.resources.limits.nvidia\.com/gpu=2")
    assert_schema_refuses("decode.pipelineParallelSize=0", "at '/decode/pipelineParallelSize'")


def test_pipeline_across_nodes_runs_a_pod_per_stage_in_the_pools_ray_group():
    stages = ("--set", "mode=raycluster", "--set", "ray.pipelineAcrossNodes=true", "--set", "prefill.replicas=2",
              "--set", "prefill.pipelineParallelSize=3")
    ray = template(*stages)
    assert "--pipeline-across-nodes" in ray and "--prefill-pipeline-parallel-size 3\n" in ray
    [cluster] = by_kind(objects(ray), "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert (groups["prefill"]["replicas"], groups["prefill"]["maxReplicas"]) == (6, 6)  # 2 workers x 3 stage pods
    assert groups["decode"]["replicas"] == 1  # one stage: one pod per worker
    # each pod holds one stage: its tensor-parallel ranks' GPUs (2 here), not the whole worker's 2 x 3
    gpu = ("--set", "model.device=cuda", "--set", "prefill.tensorParallelSize=2")
    template(*stages, *gpu, "--set-string", r"prefill.resources.limits.nvidia\.com/gpu=2")
    with pytest.raises(ValueError, match=r"prefill.tensorParallelSize=2 x pipelineParallelSize=3 needs "
                                         r"prefill.resources.limits nvidia.com/gpu >= 2"):
        template(*stages, *gpu, "--set-string", r"prefill.resources.limits.nvidia\.com/gpu=1")
    with pytest.raises(ValueError, match="decode.pipelineParallelSize must be 1"):
        template(*stages, "--set", "decode.pipelineParallelSize=2")
    with pytest.raises(ValueError, match="ray.pipelineAcrossNodes needs mode=raycluster"):
        template("--set", "ray.pipelineAcrossNodes=true")
    assert "--pipeline-across-nodes" not in template("--set", "mode=raycluster")
