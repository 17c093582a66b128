"""The chart's security settings (issues 20, 35): TLS, API keys, network policies, pod security, internal TLS."""
from __future__ import annotations

import kubernetes_validate
import pytest

from tests.helm.chart import (
    CASES,
    KUBE_VERSION,
    assert_schema_refuses,
    by_kind,
    objects,
    pod_specs,
    template,
    values_args,
)
from tests.helm.custom_resources import SCHEMAS


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
    assert flags["--api-keys-file"] == mounts["api-keys"] + "/api-keys"
    assert volumes["api-keys"]["secretName"] == "pdserve-api-keys"
    assert not [n for n, s in pod_specs(objects(rendered["defaults"])) for c in s["containers"]
                if "--tls-cert-file" in c.get("args", []) or "--api-keys-file" in c.get("args", [])]


def test_tls_from_an_existing_secret_and_in_raycluster_mode():
    objs = objects(template(*values_args("raycluster"), *values_args("security"),
                            "--set", "tls.existingSecret=my-router-cert"))
    assert not by_kind(objs, "Certificate")
    [ray] = by_kind(objs, "RayCluster")
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]
    assert "--tls-cert-file /etc/pdserve/tls/tls.crt" in head["containers"][0]["args"][0]
    assert "--api-keys-file /etc/pdserve/auth/api-keys" in head["containers"][0]["args"][0]
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
    assert_schema_refuses(setting, message)


def container_of(objs: list[dict], name: str) -> dict:
    [deployment] = [o for o in by_kind(objs, "Deployment") if o["metadata"]["name"] == name]
    return deployment["spec"]["template"]["spec"]["containers"][0]


INTERNAL_FILES = ["/etc/pdserve/internal-tls/tls.crt", "/etc/pdserve/internal-tls/tls.key",
                  "/etc/pdserve/internal-tls/ca.crt"]
INTERNAL_MOUNT = {"name": "internal-tls", "mountPath": "/etc/pdserve/internal-tls", "readOnly": True}


def flag_values(args: list[str], flags: list[str]) -> list[str]:
    return [args[args.index(flag) + 1] for flag in flags]


def internal_tls_secrets(objs: list[dict]) -> set[str]:
    """Secrets the pods mount as volume internal-tls."""
    return {v["secret"]["secretName"] for _, spec in pod_specs(objs) for v in spec.get("volumes", [])
            if v["name"] == "internal-tls"}


@pytest.mark.parametrize("case", ["defaults", "internal-tls"])
def test_internal_tls_reaches_routers_and_workers(case, rendered):
    """On by default (generated CA) and with cert-manager: one certificate, the flags, mounts and HTTP probes."""
    objs = objects(rendered[case])
    for role in ("prefill", "decode"):
        worker = container_of(objs, f"pdserve-{role}")
        assert flag_values(worker["args"],
                           ["--internal-tls-cert", "--internal-tls-key", "--internal-tls-ca"]) == INTERNAL_FILES
        metrics = next(p["containerPort"] for p in worker["ports"] if p["name"] == "metrics")
        # the kubelet's gRPC probes speak no TLS: HTTP on the metrics port, readiness = takes work
        assert worker["readinessProbe"]["httpGet"] == {"path": "/ready", "port": metrics}
        assert worker["livenessProbe"]["httpGet"] == {"path": "/health", "port": metrics}
        assert INTERNAL_MOUNT in worker["volumeMounts"]
    router = container_of(objs, "pdserve-router")
    assert flag_values(router["args"], ["--internal-tls-cert", "--internal-tls-key", "--internal-tls-ca",
                                        "--internal-tls-server-name"]) == [*INTERNAL_FILES, "pdserve-internal"]
    assert INTERNAL_MOUNT in router["volumeMounts"]
    assert internal_tls_secrets(objs) == {"pdserve-internal-tls"}
    certificates = [c for c in by_kind(objs, "Certificate") if c["metadata"]["name"] == "pdserve-internal-tls"]
    generated = [s for s in by_kind(objs, "Secret") if s["metadata"]["name"] == "pdserve-internal-tls"]
    if case == "defaults":  # neither cert-manager nor a Secret of yours: the chart generates the CA
        [secret] = generated
        assert not certificates and secret["type"] == "kubernetes.io/tls"
        assert sorted(secret["data"]) == ["ca.crt", "tls.crt", "tls.key"]
        assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # survives upgrades
    else:
        [cert] = certificates
        assert not generated
        assert cert["spec"]["dnsNames"] == ["pdserve-internal"] and cert["spec"]["commonName"] == "pdserve-internal"
        assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
        assert cert["spec"]["issuerRef"]["name"] == "pdserve-internal-ca"


def test_internal_tls_from_an_existing_secret():
    own = objects(template("--set", "internalTLS.existingSecret=mine"))
    assert not by_kind(own, "Certificate")
    assert "pdserve-internal-tls" not in [s["metadata"]["name"] for s in by_kind(own, "Secret")]
    assert internal_tls_secrets(own) == {"mine"}


def test_internal_tls_in_raycluster_mode_reaches_serve_and_every_ray_pod(rendered):
    """`serve` on the head gives its router and the worker actors the files; the Ray worker pods, where the
    actors run, mount them at the same path."""
    objs = objects(rendered["raycluster"])
    [ray] = by_kind(objs, "RayCluster")
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    serve = head["args"][0].split()
    assert flag_values(serve, ["--internal-tls-cert", "--internal-tls-key", "--internal-tls-ca",
                               "--internal-tls-server-name"]) == [*INTERNAL_FILES, "pdserve-internal"]
    pods = {name: spec for name, spec in pod_specs(objs) if "redis" not in name}
    assert sorted(pods) == ["Deployment/pdserve-router", "RayCluster/pdserve/decode", "RayCluster/pdserve/head",
                            "RayCluster/pdserve/prefill"]
    for name, spec in pods.items():
        assert INTERNAL_MOUNT in spec["containers"][0]["volumeMounts"], name
    assert internal_tls_secrets(objs) == {"pdserve-internal-tls"}
    assert [s for s in by_kind(objs, "Secret") if s["metadata"]["name"] == "pdserve-internal-tls"]
    assert "--internal-tls-server-name" in container_of(objs, "pdserve-router")["args"]


@pytest.mark.parametrize("mode", ["deployments", "raycluster"])
def test_internal_tls_off_still_renders_plaintext_links_with_grpc_probes(mode):
    objs = objects(template(*values_args("internal-tls-off"), "--set", f"mode={mode}"))
    for obj in objs:
        if (obj["apiVersion"], obj["kind"]) not in SCHEMAS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    assert not internal_tls_secrets(objs) and not by_kind(objs, "Certificate")
    assert "pdserve-internal-tls" not in [s["metadata"]["name"] for s in by_kind(objs, "Secret")]
    for name, spec in pod_specs(objs):
        container = spec["containers"][0]
        assert not {"--internal-tls-cert"} & set(container.get("args", [])), name
        assert "--internal-tls" not in " ".join(container.get("args", [])), name
        if mode == "deployments" and ("prefill" in name or "decode" in name):
            assert "grpc" in container["readinessProbe"], name


def test_schema_bounds_the_generated_certificates_lifetime():
    assert_schema_refuses("internalTLS.generated.validityDays=0", "at '/internalTLS/generated/validityDays'")
    assert_schema_refuses("internalTLS.generated.validityDay=1", "additional properties 'validityDay' not allowed")
