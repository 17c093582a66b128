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
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        port = ports["grpc"]
        if case == "security" and "router" in name:  # TLS on: the kubelet's gRPC probes speak no TLS
            health = {"path": "/health", "port": ports["http"], "scheme": "HTTPS"}
            assert container["startupProbe"]["httpGet"] == container["readinessProbe"]["httpGet"] == health, name
            assert container["livenessProbe"]["tcpSocket"] == {"port": port}, name
        elif case == "internal-tls" and "router" not in name:  # workers' gRPC is mTLS-only: HTTP probes
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
    with pytest.raises(ValueError) as refused:
        template("--set", setting)
    assert "values don't meet the specifications of the schema" in str(refused.value)
    assert message in str(refused.value)


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


# ---- security (issue 20) -----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_pods_run_as_non_root_read_only_with_no_capabilities_but_ipc_lock(case, rendered):
    for name, spec in pod_specs(objects(rendered[case])):
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name}/{container['name']}"
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}, where
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            assert mounts.get("/tmp") == "tmp", where  # somewhere writable
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}}, name
        if "dshm" in volumes:
            assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}, name


def test_workers_add_ipc_lock_only_when_asked(rendered):
    objs = objects(template("--set", "kvTransfer.ipcLock=false"))
    for name, spec in pod_specs(objs):
        assert "add" not in spec["containers"][0]["securityContext"]["capabilities"], name
    workers = [s for n, s in pod_specs(objects(rendered["defaults"])) if "prefill" in n or "decode" in n]
    assert [s["containers"][0]["securityContext"]["capabilities"] for s in workers] == [
        {"drop": ["ALL"], "add": ["IPC_LOCK"]}] * 2


def policies(text: str) -> dict[str, dict]:
    return {o["metadata"]["name"].removeprefix("pdserve-"): o["spec"] for o in by_kind(objects(text), "NetworkPolicy")}


def components(peer: dict) -> list[str]:
    [expression] = peer["podSelector"]["matchExpressions"]
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "pdserve",
                                                 "app.kubernetes.io/instance": "pdserve"}
    return expression["values"]


DNS = {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
MONITORING = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_network_policies_per_role_with_egress(rendered):
    p = policies(rendered["defaults"])
    assert sorted(p) == ["redis", "router", "workers"]
    assert all(spec["policyTypes"] == ["Ingress", "Egress"] for spec in p.values())
    router, workers, redis = p["router"], p["workers"], p["redis"]
    # router: clients on grpc/http, metrics from monitoring; out: workers' gRPC, Redis, DNS only.
    assert router["ingress"] == [{"ports": [{"port": "grpc"}, {"port": "http"}]},
                                 {"ports": [{"port": "metrics"}], "from": MONITORING}]
    [to_workers, to_redis, dns] = router["egress"]
    assert [components(peer) for peer in to_workers["to"]] == [["prefill", "decode"]]
    assert to_workers["ports"] == [{"port": "grpc"}]
    assert [components(peer) for peer in to_redis["to"]] == [["redis"]] and to_redis["ports"] == [{"port": 6379}]
    assert dns == DNS
    # workers: gRPC from routers, KV from workers, metrics from monitoring; out: KV to workers, Redis, DNS.
    assert workers["podSelector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]
    grpc_in, kv_in, metrics_in = workers["ingress"]
    assert grpc_in["ports"] == [{"port": "grpc"}] and [components(x) for x in grpc_in["from"]] == [["router"]]
    assert kv_in["ports"] == [{"port": "kv-transfer"}]
    assert [components(x) for x in kv_in["from"]] == [["prefill", "decode"]]
    assert metrics_in == {"ports": [{"port": "metrics"}], "from": MONITORING}
    kv_out, redis_out, dns = workers["egress"]
    assert kv_out["ports"] == [{"port": "kv-transfer"}] and [components(x) for x in kv_out["to"]] == [
        ["prefill", "decode"]]
    assert redis_out == to_redis and dns == DNS
    # Redis: the release's pods on its port; nothing out.
    assert redis["egress"] == []
    [redis_in] = redis["ingress"]
    assert redis_in["ports"] == [{"port": "redis"}]
    assert [components(x) for x in redis_in["from"]] == [["router", "ray-head", "prefill", "decode"]]


def test_network_policy_options(rendered):
    security = policies(rendered["security"])
    assert security["workers"]["ingress"][1]["ports"] == [{"port": "kv-transfer"},
                                                          {"port": 20000, "endPort": 20100, "protocol": "TCP"}]
    assert security["router"]["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]
    external = policies(rendered["external-redis"])
    assert "redis" not in external
    redis_out = external["router"]["egress"][1]
    assert redis_out == {"ports": [{"port": 6380}],
                         "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "infra"}}}]}
    assert external["workers"]["egress"][-1] == {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
                                                 "ports": [{"port": 443}]}
    ray = policies(rendered["raycluster"])
    assert [components(x) for x in ray["workers"]["ingress"][0]["from"]] == [["ray-head", "prefill", "decode",
                                                                              "router"]]
    assert "ports" not in ray["router"]["egress"][0]  # serve picks the workers' ports


def test_tls_and_api_keys_reach_the_routers(rendered):
    objs = objects(rendered["security"])
    [certificate] = by_kind(objs, "Certificate")
    assert certificate["spec"]["secretName"] == "pdserve-router-tls"
    assert certificate["spec"]["issuerRef"] == {"name": "internal-ca", "kind": "ClusterIssuer",
                                                "group": "cert-manager.io"}
    assert {"pdserve-router.llm.svc", "llm.example.com"} <= set(certificate["spec"]["dnsNames"])
    [router] = [s for n, s in pod_specs(objs) if "router" in n]
    container = router["containers"][0]
    args = container["args"]
    flags = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v.get("secret") for v in router["volumes"]}
    assert flags["--tls-cert-file"] == mounts["router-tls"] + "/tls.crt"
    assert flags["--tls-key-file"] == mounts["router-tls"] + "/tls.key"
    assert volumes["router-tls"]["secretName"] == "pdserve-router-tls"
    assert flags["--api-key-file"] == mounts["api-keys"] + "/api-keys"
    assert volumes["api-keys"]["secretName"] == "pdserve-api-keys"
    assert not [n for n, s in pod_specs(objects(rendered["defaults"])) for c in s["containers"]
                if "--tls-cert-file" in c.get("args", []) or "--api-key-file" in c.get("args", [])]


def test_tls_from_an_existing_secret_and_in_raycluster_mode():
    objs = objects(template(*values_args("raycluster"), *values_args("security"),
                            "--set", "tls.existingSecret=my-router-cert"))
    assert not by_kind(objs, "Certificate")
    [ray] = by_kind(objs, "RayCluster")
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]
    assert "--tls-cert-file /etc/pdserve/tls/tls.crt" in head["containers"][0]["args"][0]
    assert "--api-key-file /etc/pdserve/auth/api-keys" in head["containers"][0]["args"][0]
    assert {v["name"]: v.get("secret", {}).get("secretName") for v in head["volumes"]}["router-tls"] == \
        "my-router-cert"
    assert head["containers"][0]["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    for obj in objs:
        if (obj["apiVersion"], obj["kind"]) not in SCHEMAS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


SECURITY_BAD_VALUES = [
    ("tls.enabled=true", "at '/tls/certManager/issuerRef/name': minLength: got 0, want 1"),
    ("tls.certManager.issuerRef.kind=Vault", "at '/tls/certManager/issuerRef/kind': value must be one of"),
    ("shm.sizeLimit=lots", "at '/shm/sizeLimit'"),
    ("auth.secretKey=a/b", "at '/auth/secretKey'"),
    ("networkPolicy.kvExtraPorts[0].protocol=TCP", "at '/networkPolicy/kvExtraPorts/0': missing property 'port'"),
]


@pytest.mark.parametrize("setting,message", SECURITY_BAD_VALUES, ids=[s for s, _ in SECURITY_BAD_VALUES])
def test_schema_rejects_bad_security_values(setting, message):
    with pytest.raises(ValueError) as refused:
        template("--set", setting)
    assert message in str(refused.value)


def container_of(objs: list[dict], name: str) -> dict:
    [deployment] = [o for o in by_kind(objs, "Deployment") if o["metadata"]["name"] == name]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_internal_tls_one_certificate_for_routers_and_workers(rendered):
    objs = objects(rendered["internal-tls"])
    [cert] = by_kind(objs, "Certificate")
    assert cert["spec"]["dnsNames"] == ["pdserve-internal"]
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    files = ["/etc/pdserve/internal-tls/tls.crt", "/etc/pdserve/internal-tls/tls.key",
             "/etc/pdserve/internal-tls/ca.crt"]
    for role in ("prefill", "decode"):
        worker = container_of(objs, f"pdserve-{role}")
        args = worker["args"]
        assert [args[args.index(flag) + 1] for flag in ("--tls-cert", "--tls-key", "--tls-ca")] == files
        metrics = next(p["containerPort"] for p in worker["ports"] if p["name"] == "metrics")
        # the kubelet's gRPC probes speak no TLS: HTTP on the metrics port, readiness = takes work
        assert worker["readinessProbe"]["httpGet"] == {"path": "/ready", "port": metrics}
        assert worker["livenessProbe"]["httpGet"] == {"path": "/health", "port": metrics}
        assert {"name": "internal-tls", "mountPath": "/etc/pdserve/internal-tls", "readOnly": True} in \
            worker["volumeMounts"]
    router = container_of(objs, "pdserve-router")["args"]
    assert [router[router.index(flag) + 1] for flag in ("--worker-tls-cert", "--worker-tls-key", "--worker-tls-ca",
                                                        "--worker-tls-server-name")] == [*files, "pdserve-internal"]
    defaults = objects(rendered["defaults"])
    assert "--tls-cert" not in container_of(defaults, "pdserve-decode")["args"]
    assert "grpc" in container_of(defaults, "pdserve-decode")["readinessProbe"]
    own = objects(template("--set", "internalTLS.enabled=true", "--set", "internalTLS.existingSecret=mine"))
    assert not by_kind(own, "Certificate")
    volumes = by_kind(own, "Deployment")[0]["spec"]["template"]["spec"]["volumes"]
    assert any(v.get("secret", {}).get("secretName") == "mine" for v in volumes)


@pytest.mark.parametrize("args,message", [
    (["--set", "internalTLS.enabled=true"], "internalTLS.certManager.issuerRef.name"),
    (["--set", "internalTLS.enabled=true", "--set", "internalTLS.existingSecret=x", "--set", "mode=raycluster"],
     "internalTLS needs mode: deployments"),
])
def test_internal_tls_refuses_what_cannot_work(args, message):
    with pytest.raises(ValueError, match=message):
        template(*args)
