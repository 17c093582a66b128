"""KubernetesScaler against a fake API server: the requests the real client sends, and their effect."""
from __future__ import annotations

import pytest
from kubernetes import client

from planner.k8s_targets import host_of, idlest_pods
from planner.kubernetes_scaler import KubernetesScaler, KubernetesTargetConfig, ScaleError
from planner.scaler import PoolReplicas
from tests.planner.k8s_fake import NS, FakeKube, deployment, pod, raycluster, write_kubeconfig

PREFILL = {"app.kubernetes.io/instance": "pdserve", "app.kubernetes.io/component": "prefill"}
DECODE = {"app.kubernetes.io/instance": "pdserve", "app.kubernetes.io/component": "decode"}
DEPLOYMENTS = KubernetesTargetConfig(namespace=NS, prefill_deployment="pdserve-prefill",
                                     decode_deployment="pdserve-decode")
RAY = KubernetesTargetConfig(namespace=NS, raycluster="pdserve")
SCALE = "/apis/apps/v1/namespaces/llm/deployments/pdserve-decode/scale"
RAY_PATH = "/apis/ray.io/v1/namespaces/llm/rayclusters/pdserve"


@pytest.fixture
def kube():
    fake = FakeKube().start()
    yield fake
    fake.stop()


def chart_deployments(kube: FakeKube) -> None:
    kube.deployments["pdserve-prefill"] = deployment("pdserve-prefill", 1, None, PREFILL)  # no readyReplicas yet
    kube.deployments["pdserve-decode"] = deployment("pdserve-decode", 3, 2, DECODE)
    for i, ip in enumerate(["10.0.0.11", "10.0.0.12", "10.0.0.13"]):
        kube.pods[f"pdserve-decode-abc-{i}"] = pod(f"pdserve-decode-abc-{i}", ip, DECODE)
    kube.pods["pdserve-prefill-abc-0"] = pod("pdserve-prefill-abc-0", "10.0.0.21", PREFILL)


def ray_cluster(kube: FakeKube) -> None:
    groups = [{"groupName": "prefill", "replicas": 1, "minReplicas": 1, "maxReplicas": 4},
              {"groupName": "decode", "replicas": 3, "minReplicas": 1, "maxReplicas": 6}]
    kube.rayclusters["pdserve"] = raycluster("pdserve", groups)
    for group, ips in (("prefill", ["10.1.0.1"]), ("decode", ["10.1.0.2", "10.1.0.3", "10.1.0.4"])):
        for i, ip in enumerate(ips):
            name = f"pdserve-{group}-worker-{i}"
            labels = {"ray.io/cluster": "pdserve", "ray.io/group": group}
            kube.pods[name] = pod(name, ip, labels, ready=ip != "10.1.0.4")


def patches(kube: FakeKube) -> list[tuple[str, str | None, object]]:
    return [(r.path, r.headers.get("Content-Type"), r.body) for r in kube.sent("PATCH")]


def test_deployments_replicas_read_the_scale_and_the_status(kube):
    chart_deployments(kube)
    scaler = KubernetesScaler(kube.api_client(), DEPLOYMENTS)
    assert scaler.replicas() == {"prefill": PoolReplicas(wanted=1, ready=0), "decode": PoolReplicas(wanted=3, ready=2)}
    assert [(r.method, r.path) for r in kube.requests] == [
        ("GET", "/apis/apps/v1/namespaces/llm/deployments/pdserve-prefill/scale"),
        ("GET", "/apis/apps/v1/namespaces/llm/deployments/pdserve-prefill"),
        ("GET", SCALE),
        ("GET", "/apis/apps/v1/namespaces/llm/deployments/pdserve-decode"),
    ]


def test_deployment_scale_up_patches_the_scale_subresource(kube):
    chart_deployments(kube)
    scaler = KubernetesScaler(kube.api_client(), DEPLOYMENTS)
    scaler.scale("decode", 5)
    assert patches(kube) == [(SCALE, "application/merge-patch+json", {"spec": {"replicas": 5}})]
    assert scaler.replicas()["decode"].wanted == 5
    assert not any("annotations" in p["metadata"] for p in kube.pods.values())


def test_deployment_scale_down_marks_the_idlest_pods_first(kube):
    chart_deployments(kube)
    scaler = KubernetesScaler(kube.api_client(), DEPLOYMENTS)
    # 10.0.0.99 has no pod (gone already), the router knows workers by host:port
    scaler.scale("decode", 1, idle_first=["10.0.0.99:7002", "10.0.0.13:7002", "10.0.0.11:7002", "10.0.0.12:7002"])
    cost = "controller.kubernetes.io/pod-deletion-cost"
    assert patches(kube) == [
        ("/api/v1/namespaces/llm/pods/pdserve-decode-abc-2", "application/merge-patch+json",
         {"metadata": {"annotations": {cost: "-1000"}}}),
        ("/api/v1/namespaces/llm/pods/pdserve-decode-abc-0", "application/merge-patch+json",
         {"metadata": {"annotations": {cost: "-999"}}}),
        (SCALE, "application/merge-patch+json", {"spec": {"replicas": 1}}),
    ]
    [listed] = [r for r in kube.sent("GET") if r.path == "/api/v1/namespaces/llm/pods"]
    assert listed.query == {"labelSelector": "app.kubernetes.io/component=decode,app.kubernetes.io/instance=pdserve"}
    assert "annotations" not in kube.pods["pdserve-decode-abc-1"]["metadata"]  # the busiest stays unmarked
    assert kube.deployments["pdserve-decode"]["spec"]["replicas"] == 1


def test_a_pod_gone_while_marking_is_skipped(kube):
    chart_deployments(kube)
    kube.fail[("PATCH", "/api/v1/namespaces/llm/pods/pdserve-decode-abc-2")] = (404, "NotFound")
    KubernetesScaler(kube.api_client(), DEPLOYMENTS).scale("decode", 2, idle_first=["10.0.0.13:7002"])
    assert [p[0] for p in patches(kube)] == ["/api/v1/namespaces/llm/pods/pdserve-decode-abc-2", SCALE]
    assert kube.deployments["pdserve-decode"]["spec"]["replicas"] == 2


def test_a_403_surfaces_as_a_scale_error_naming_the_call(kube):
    chart_deployments(kube)
    kube.fail[("PATCH", SCALE)] = (403, "Forbidden")
    with pytest.raises(ScaleError) as err:
        KubernetesScaler(kube.api_client(), DEPLOYMENTS).scale("decode", 4)
    assert str(err.value) == (f"PATCH deployments/pdserve-decode/scale in llm: 403 Forbidden: {SCALE} is forbidden "
                              "(fake)")
    assert kube.deployments["pdserve-decode"]["spec"]["replicas"] == 3


def test_a_missing_deployment_or_no_server_is_a_scale_error(kube):
    with pytest.raises(ScaleError, match=r"GET deployments/pdserve-prefill/scale in llm: 404 Not Found: "):
        KubernetesScaler(kube.api_client(), DEPLOYMENTS).replicas()
    url = kube.url
    kube.stop()
    configuration = client.Configuration(host=url)
    configuration.retries = 0
    with pytest.raises(ScaleError, match="no answer from the API server"):
        KubernetesScaler(client.ApiClient(configuration), DEPLOYMENTS).scale("decode", 1)


def test_raycluster_replicas_count_ready_pods_of_each_group(kube):
    ray_cluster(kube)
    scaler = KubernetesScaler(kube.api_client(), RAY)
    assert scaler.replicas() == {"prefill": PoolReplicas(wanted=1, ready=1), "decode": PoolReplicas(wanted=3, ready=2)}
    selectors = [r.query.get("labelSelector") for r in kube.sent("GET") if r.path == "/api/v1/namespaces/llm/pods"]
    assert selectors == ["ray.io/cluster=pdserve,ray.io/group=prefill", "ray.io/cluster=pdserve,ray.io/group=decode"]


def test_raycluster_scale_is_a_json_patch_testing_the_group_name(kube):
    ray_cluster(kube)
    scaler = KubernetesScaler(kube.api_client(), RAY)
    scaler.scale("prefill", 3)
    assert patches(kube) == [(RAY_PATH, "application/json-patch+json", [
        {"op": "test", "path": "/spec/workerGroupSpecs/0/groupName", "value": "prefill"},
        {"op": "replace", "path": "/spec/workerGroupSpecs/0/replicas", "value": 3},
    ])]
    groups = kube.rayclusters["pdserve"]["spec"]["workerGroupSpecs"]
    assert [(g["groupName"], g["replicas"], g["minReplicas"]) for g in groups] == [("prefill", 3, 1), ("decode", 3, 1)]


def test_raycluster_scale_down_names_the_idlest_workers_to_delete(kube):
    ray_cluster(kube)
    scaler = KubernetesScaler(kube.api_client(), RAY)
    scaler.scale("decode", 2, idle_first=["10.1.0.3:40001", "10.1.0.2:40002", "10.1.0.4:40003"])
    assert patches(kube) == [(RAY_PATH, "application/json-patch+json", [
        {"op": "test", "path": "/spec/workerGroupSpecs/1/groupName", "value": "decode"},
        {"op": "replace", "path": "/spec/workerGroupSpecs/1/replicas", "value": 2},
        {"op": "add", "path": "/spec/workerGroupSpecs/1/scaleStrategy",
         "value": {"workersToDelete": ["pdserve-decode-worker-1"]}},
    ])]
    decode = kube.rayclusters["pdserve"]["spec"]["workerGroupSpecs"][1]
    assert decode["scaleStrategy"] == {"workersToDelete": ["pdserve-decode-worker-1"]}
    # a second scale-down with a scaleStrategy present sets only its list
    scaler.scale("decode", 1, idle_first=["10.1.0.2:40002"])
    assert patches(kube)[-1][2][-1] == {"op": "add", "path": "/spec/workerGroupSpecs/1/scaleStrategy/workersToDelete",
                                        "value": ["pdserve-decode-worker-0"]}
    assert kube.rayclusters["pdserve"]["spec"]["workerGroupSpecs"][1]["replicas"] == 1


def test_raycluster_refuses_counts_outside_min_max_and_a_reordered_list(kube):
    ray_cluster(kube)
    scaler = KubernetesScaler(kube.api_client(), RAY)
    with pytest.raises(ValueError, match=r"7 replicas is outside minReplicas=1..maxReplicas=6"):
        scaler.scale("decode", 7)
    with pytest.raises(ValueError, match=r"0 replicas is outside minReplicas=1..maxReplicas=4"):
        scaler.scale("prefill", 0)
    assert kube.sent("PATCH") == []
    # the list changes between our read and our patch: the test op fails, nothing is scaled
    original = kube.rayclusters["pdserve"]
    groups = original["spec"]["workerGroupSpecs"]
    real_get = scaler._get_raycluster

    def stale_read():
        seen = real_get()
        groups.reverse()
        return seen

    scaler._get_raycluster = stale_read
    with pytest.raises(ScaleError, match=r"PATCH rayclusters/pdserve in llm: 422 .*test /spec/workerGroupSpecs/0"):
        scaler.scale("prefill", 2)
    assert [(g["groupName"], g["replicas"]) for g in kube.rayclusters["pdserve"]["spec"]["workerGroupSpecs"]] == [
        ("decode", 3), ("prefill", 1)]


def test_kubeconfig_file_is_honoured(kube, tmp_path):
    chart_deployments(kube)
    kube.token = "s3cr3t-token"
    path = write_kubeconfig(tmp_path / "kubeconfig", kube.url, "s3cr3t-token")
    scaler = KubernetesScaler.from_config(DEPLOYMENTS, str(path))
    scaler.scale("decode", 2)
    assert {r.headers.get("Authorization") for r in kube.requests} == {"Bearer s3cr3t-token"}
    assert kube.deployments["pdserve-decode"]["spec"]["replicas"] == 2


def test_in_cluster_config_without_a_service_account_fails_clearly(monkeypatch):
    from kubernetes.config.config_exception import ConfigException
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigException):
        KubernetesScaler.from_config(DEPLOYMENTS)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "nothing to scale"),
    ({"prefill_deployment": "a"}, "needs both --prefill-deployment and --decode-deployment"),
    ({"prefill_deployment": "a", "decode_deployment": "b", "raycluster": "r"}, "not both"),
    ({"prefill_deployment": "a", "decode_deployment": "a"}, "cannot be the same Deployment"),
    ({"raycluster": "r", "decode_group": "prefill"}, "two different worker group names"),
    ({"raycluster": "Not_A_Name"}, "raycluster must be a Kubernetes object name"),
])
def test_target_config_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KubernetesTargetConfig(namespace=NS, **kwargs)
    with pytest.raises(ValueError, match="namespace must be"):
        KubernetesTargetConfig(namespace="", raycluster="r")


def test_scale_refuses_a_bad_role_or_count(kube):
    scaler = KubernetesScaler(kube.api_client(), DEPLOYMENTS)
    with pytest.raises(ValueError, match="unknown role"):
        scaler.scale("router", 1)
    with pytest.raises(ValueError, match="integer >= 0"):
        scaler.scale("decode", -1)
    assert kube.requests == []


def test_idle_matching_by_host():
    assert [host_of(a) for a in ("10.0.0.1:7002", "[fd00::1]:7002", "10.0.0.1")] == ["10.0.0.1", "fd00::1", "10.0.0.1"]
    pods = [pod("a", "10.0.0.1", {}), pod("b", "fd00::1", {}), pod("c", None, {})]
    pods.append({**pod("d", "10.0.0.4", {}), "metadata": {"name": "d", "deletionTimestamp": "2026-01-01T00:00:00Z"}})
    assert idlest_pods(pods, ["10.0.0.4:1", "[fd00::1]:2", "10.0.0.1:3", "10.0.0.1:4"], 5) == ["b", "a"]
    assert idlest_pods(pods, ["10.0.0.1:3", "[fd00::1]:2"], 1) == ["a"]
