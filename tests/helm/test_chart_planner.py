"""The chart's SLO planner (planner.enabled): its Deployment and flags, the headless Services reaching every
router, its NetworkPolicy, and a Role allowing exactly the API calls planner/kubernetes_scaler.py makes."""
from __future__ import annotations

import kubernetes_validate
import pytest

from planner.kubernetes_scaler import KubernetesScaler, KubernetesTargetConfig
from tests.helm.chart import KUBE_VERSION, assert_schema_refuses, by_kind, objects, pod_specs, template, values_args
from tests.planner.k8s_fake import NS, FakeKube, pod, rbac_rule

FLAGS_WITH_VALUES = {"--slo-ttft-ms": "1500", "--slo-itl-ms": "80", "--interval-s": "10", "--min-prefill": "1",
                     "--max-prefill": "3", "--min-decode": "1", "--max-decode": "6", "--scale-up-cooldown-s": "30",
                     "--scale-down-cooldown-s": "120", "--metrics-port": "9095"}


def named(objs: list[dict], kind: str, name: str) -> dict:
    [obj] = [o for o in by_kind(objs, kind) if o["metadata"]["name"] == name]
    return obj


def planner_container(objs: list[dict]) -> tuple[dict, dict]:
    spec = named(objs, "Deployment", "pdserve-planner")["spec"]["template"]["spec"]
    [container] = spec["containers"]
    return spec, container


def flags(args: list[str]) -> dict[str, str]:
    assert args[0] == "planner"
    pairs = args[1:]
    assert len(pairs) % 2 == 0 and all(a.startswith("--") for a in pairs[::2]), args
    return dict(zip(pairs[::2], pairs[1::2], strict=True))


def target_of(args: dict[str, str]) -> KubernetesTargetConfig:
    """What `pdserve planner` builds from these flags (planner/cli.py)."""
    return KubernetesTargetConfig(namespace=args["--namespace"], prefill_deployment=args.get("--prefill-deployment"),
                                  decode_deployment=args.get("--decode-deployment"),
                                  raycluster=args.get("--raycluster"),
                                  prefill_group=args.get("--prefill-group", "prefill"),
                                  decode_group=args.get("--decode-group", "decode"))


def test_the_planner_is_off_by_default(rendered):
    objs = objects(rendered["defaults"])
    assert not by_kind(objs, "Role") and not by_kind(objs, "RoleBinding")
    assert "pdserve-planner" not in [o["metadata"]["name"] for o in objs]


def test_planner_deployment_runs_pdserve_planner_on_the_chart_deployments(rendered):
    objs = objects(rendered["planner"])
    deployment = named(objs, "Deployment", "pdserve-planner")
    assert deployment["spec"]["replicas"] == 1
    spec, container = planner_container(objs)
    assert spec["serviceAccountName"] == "pdserve-planner" and spec["automountServiceAccountToken"] is True
    assert named(objs, "ServiceAccount", "pdserve-planner")["automountServiceAccountToken"] is False
    assert container["command"] == ["pdserve"] and container["image"] == "ghcr.io/pdserve/pdserve:0.1.0"
    assert flags(container["args"]) == {
        "--backend": "kubernetes", "--namespace": "llm",
        "--router-metrics": "http://pdserve-router-metrics.llm.svc:9400/metrics",
        "--prefill-deployment": "pdserve-prefill", "--decode-deployment": "pdserve-decode", **FLAGS_WITH_VALUES}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, probe
    assert container["ports"] == [{"name": "metrics", "containerPort": 9095}]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True
    # the Deployments it names exist, and its target config accepts the flags
    names = {o["metadata"]["name"] for o in by_kind(objs, "Deployment")}
    assert {"pdserve-prefill", "pdserve-decode"} <= names
    assert target_of(flags(container["args"])).kind == "deployments"
    for obj in objs:
        if obj["metadata"]["name"].startswith("pdserve-planner") or obj["kind"] in ("Role", "RoleBinding"):
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_router_metrics_reach_every_router_through_headless_services(rendered):
    for case, targets in (("planner", {"pdserve-router-metrics": "router"}),
                          ("raycluster-planner", {"pdserve-router-metrics": "router",
                                                  "pdserve-head-metrics": "ray-head"})):
        objs = objects(rendered[case])
        _, container = planner_container(objs)
        urls = flags(container["args"])["--router-metrics"].split(",")
        assert urls == [f"http://{name}.llm.svc:9400/metrics" for name in targets], case
        pods = dict(pod_specs(objs))
        for name, component in targets.items():
            service = named(objs, "Service", name)
            assert service["spec"]["clusterIP"] == "None", name  # DNS gives every pod's IP
            assert service["spec"]["selector"]["app.kubernetes.io/component"] == component
            assert service["spec"]["ports"] == [{"name": "metrics", "port": 9400, "targetPort": "metrics"}]
            # the selected pods carry those labels and serve their metrics on that port
            owner = "Deployment/pdserve-router" if component == "router" else "RayCluster/pdserve/head"
            template_labels = (named(objs, "Deployment", "pdserve-router")["spec"]["template"]["metadata"]["labels"]
                               if component == "router" else
                               named(objs, "RayCluster", "pdserve")["spec"]["headGroupSpec"]["template"]["metadata"][
                                   "labels"])
            assert service["spec"]["selector"].items() <= template_labels.items(), name
            ports = {p["name"]: p["containerPort"] for p in pods[owner]["containers"][0]["ports"]}
            assert ports["metrics"] == 9400, name


def test_raycluster_mode_scales_the_worker_groups_within_the_planner_bounds(rendered):
    objs = objects(rendered["raycluster-planner"])
    _, container = planner_container(objs)
    args = flags(container["args"])
    assert (args["--raycluster"], args["--prefill-group"], args["--decode-group"]) == ("pdserve", "prefill", "decode")
    assert "--prefill-deployment" not in args
    [ray] = by_kind(objs, "RayCluster")
    groups = {g["groupName"]: g for g in ray["spec"]["workerGroupSpecs"]}
    assert (groups["prefill"]["minReplicas"], groups["prefill"]["maxReplicas"], groups["prefill"]["replicas"]) == (
        1, 4, 1)
    assert (groups["decode"]["minReplicas"], groups["decode"]["maxReplicas"], groups["decode"]["replicas"]) == (2, 8, 2)
    # without the planner the groups stay fixed at their replicas
    fixed = {g["groupName"]: g for g in by_kind(objects(rendered["raycluster"]), "RayCluster")[0]["spec"][
        "workerGroupSpecs"]}
    assert (fixed["decode"]["minReplicas"], fixed["decode"]["maxReplicas"]) == (4, 4)


def test_workers_keep_their_values_replicas_and_outlive_their_drain(rendered):
    objs = objects(rendered["planner"])
    for role, replicas in (("prefill", 1), ("decode", 2)):
        deployment = named(objs, "Deployment", f"pdserve-{role}")
        assert deployment["spec"]["replicas"] == replicas
        spec = deployment["spec"]["template"]["spec"]
        args = spec["containers"][0]["args"]
        drain = float(args[args.index("--drain-timeout-s") + 1])
        sleep = spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert spec["terminationGracePeriodSeconds"] >= sleep + drain + 15, role


@pytest.mark.parametrize("case", ["planner", "raycluster-planner"])
def test_network_policies_let_the_planner_read_the_routers_metrics(case, rendered):
    objs = objects(rendered[case])
    planner_peer = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pdserve",
                                                    "app.kubernetes.io/instance": "pdserve"},
                                    "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                                          "values": ["planner"]}]}}
    policies = ["pdserve-router"] + (["pdserve-workers"] if case == "raycluster-planner" else [])
    for name in policies:  # the head runs a router in raycluster mode
        [metrics] = [r for r in named(objs, "NetworkPolicy", name)["spec"]["ingress"]
                     if r.get("ports") == [{"port": "metrics"}]]
        assert planner_peer in metrics["from"], name
    own = named(objs, "NetworkPolicy", "pdserve-planner")["spec"]
    assert own["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "planner"
    [to_routers] = [r for r in own["egress"] if r.get("to") and r["ports"] == [{"port": 9400}]]
    components = to_routers["to"][0]["podSelector"]["matchExpressions"][0]["values"]
    assert components == (["router", "ray-head"] if case == "raycluster-planner" else ["router"])
    assert {"ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]} in own["egress"]
    for policy in by_kind(objs, "NetworkPolicy"):
        kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In) matches these labels."""
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and all(
        e["operator"] == "In" and labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


@pytest.mark.parametrize("case", ["planner", "raycluster-planner"])
def test_the_pod_monitor_scrapes_the_planner_metrics_port(case):
    objs = objects(template(*values_args(case), "--set", "monitoring.enabled=true"))
    [monitor] = by_kind(objs, "PodMonitor")
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    planner_pod = named(objs, "Deployment", "pdserve-planner")["spec"]["template"]
    assert selects(monitor["spec"]["selector"], planner_pod["metadata"]["labels"])
    [container] = planner_pod["spec"]["containers"]
    [port] = [p for p in container["ports"] if p["name"] == endpoint["port"]]
    assert port["containerPort"] == int(flags(container["args"])["--metrics-port"]) == 9095
    assert endpoint["path"] == "/metrics"
    # the scrapers' namespace may reach it
    own = named(objs, "NetworkPolicy", "pdserve-planner")["spec"]
    assert {"ports": [{"port": "metrics"}], "from": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]} in own["ingress"]


def test_without_the_planner_the_pod_monitor_selects_only_workers(rendered):
    [monitor] = by_kind(objects(rendered["monitoring"]), "PodMonitor")
    [expression] = monitor["spec"]["selector"]["matchExpressions"]
    assert expression["values"] == ["prefill", "decode", "ray-head"]


def role_grants(role: dict) -> tuple[set[tuple[str, str, str]], dict[tuple[str, str, str], set[str]]]:
    """(apiGroup, resource, verb) the Role allows, and the resourceNames each is limited to."""
    grants, names = set(), {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    grants.add((group, resource, verb))
                    if "resourceNames" in rule:
                        names[(group, resource, verb)] = set(rule["resourceNames"])
    return grants, names


POOL_INDEX = {"prefill": 0, "decode": 1}  # pod IPs 10.x.<index>.<n>


def load_chart_into(kube: FakeKube, objs: list[dict]) -> None:
    """The rendered Deployments / RayCluster as the API server holds them, with two pods per pool."""
    for dep in by_kind(objs, "Deployment"):
        i = POOL_INDEX.get(dep["metadata"]["name"].removeprefix("pdserve-"), 9)
        dep["spec"]["replicas"] = 2
        kube.deployments[dep["metadata"]["name"]] = {**dep, "status": {"replicas": 2, "readyReplicas": 2}}
        for j in range(2):
            name = f"{dep['metadata']['name']}-abc-{j}"
            kube.pods[name] = pod(name, f"10.2.{i}.{j}", dep["spec"]["template"]["metadata"]["labels"])
    for ray in by_kind(objs, "RayCluster"):
        kube.rayclusters[ray["metadata"]["name"]] = ray
        for group in ray["spec"]["workerGroupSpecs"]:
            i = POOL_INDEX[group["groupName"]]
            group["replicas"] = 2
            for j in range(2):
                name = f"pdserve-{group['groupName']}-worker-{j}"
                labels = {"ray.io/cluster": "pdserve", "ray.io/group": group["groupName"]}
                kube.pods[name] = pod(name, f"10.3.{i}.{j}", labels)


@pytest.mark.parametrize("case", ["planner", "raycluster-planner"])
def test_the_role_allows_exactly_what_the_scaler_sends(case, rendered):
    objs = objects(rendered[case])
    _, container = planner_container(objs)
    target = target_of(flags(container["args"]))
    assert target.namespace == NS
    kube = FakeKube().start()
    try:
        load_chart_into(kube, objs)
        scaler = KubernetesScaler(kube.api_client(), target)
        assert {r.wanted for r in scaler.replicas().values()} == {2}
        prefix = "10.3" if case == "raycluster-planner" else "10.2"
        for role, i in POOL_INDEX.items():
            scaler.scale(role, 3)
            scaler.scale(role, 2, idle_first=[f"{prefix}.{i}.1:7000", f"{prefix}.{i}.0:7000"])
        scaler.replicas()
    finally:
        kube.stop()
    assert kube.sent("PATCH"), "the scaler sent no patch"
    sent = {rbac_rule(r) for r in kube.requests}
    [role] = by_kind(objs, "Role")
    grants, names = role_grants(role)
    assert {(g, res, v) for g, res, v, _ in sent} == grants  # no more, no less
    for (group, resource, verb), allowed in names.items():
        assert {n for g, res, v, n in sent if (g, res, v) == (group, resource, verb)} <= allowed, (resource, verb)
    for group, resource, verb, name in sent:
        if (group, resource, verb) not in names:  # unrestricted: pods (names unknown in advance) or a list
            assert resource == "pods" or name is None, (resource, verb)
    [binding] = by_kind(objs, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pdserve-planner"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pdserve-planner", "namespace": "llm"}]


@pytest.mark.parametrize("setting, message", [
    ("planner.prefill.min=-1", "/planner/prefill/min"),
    ("planner.sloTtftMs=0", "/planner/sloTtftMs"),
    ("planner.metricsPort=70000", "/planner/metricsPort"),
    ("planner.typo=1", "typo"),
    ("networkPolicy.apiServerPorts[0]=0", "/networkPolicy/apiServerPorts/0"),
])
def test_schema_refuses_bad_planner_values(setting, message):
    assert_schema_refuses(setting, message)


def test_bounds_must_hold_the_pools_initial_size():
    with pytest.raises(ValueError, match=r"decode.replicas=9 must lie within planner.decode.min..max \(1..8\)"):
        template("--set", "planner.enabled=true", "--set", "decode.replicas=9")
    with pytest.raises(ValueError, match=r"planner.prefill.min \(3\) must not exceed planner.prefill.max \(2\)"):
        template("--set", "planner.enabled=true", "--set", "planner.prefill.min=3", "--set", "planner.prefill.max=2")
