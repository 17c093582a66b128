"""`Scaler` over the Kubernetes API: the chart's prefill/decode Deployments (their `scale` subresource)
or a KubeRay RayCluster's worker groups (`spec.workerGroupSpecs[i].replicas`, by JSON Patch).

Scaling down, the pods to remove are chosen from `idle_first` (matched by pod IP): Deployments get the
ReplicaSet hint `controller.kubernetes.io/pod-deletion-cost` on those pods (their SIGTERM drains the
worker), a RayCluster names them in the group's `scaleStrategy.workersToDelete` (the head's
`serve --follow-ray-nodes` drops the pod's worker from the pool; its streams migrate).

RBAC it needs (namespaced): deployments mode: apps deployments get, deployments/scale get+patch, pods
list+patch; raycluster mode: ray.io rayclusters get+patch, pods list.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from kubernetes import client, config

from planner.k8s_targets import KubernetesTargetConfig, ScaleError, api_call, idlest_pods, pod_is_ready
from planner.scaler import ROLES, PoolReplicas

__all__ = ["DELETION_COST", "KubernetesScaler", "KubernetesTargetConfig", "ScaleError"]

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
FIRST_COST = -1000
"""The idlest pod's deletion cost; the next ones get -999, -998, ... (lowest goes first)."""
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayclusters"


class KubernetesScaler:
    """Scales `target` through `api_client` (blocking calls)."""

    def __init__(self, api_client: client.ApiClient, target: KubernetesTargetConfig) -> None:
        self.api_client = api_client
        self.target = target
        self.ns = target.namespace
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    @classmethod
    def from_config(cls, target: KubernetesTargetConfig, kubeconfig: str | None = None) -> KubernetesScaler:
        """The in-cluster service account when `kubeconfig` is None, else that kubeconfig file."""
        configuration = client.Configuration()
        if kubeconfig is None:
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration,
                                    persist_config=False)
        return cls(client.ApiClient(configuration), target)

    def replicas(self) -> dict[str, PoolReplicas]:
        """role -> (wanted, ready) of its Deployment or worker group."""
        if self.target.kind == "raycluster":
            return self._ray_replicas()
        return {role: self._deployment_replicas(self.target.name_of(role)) for role in ROLES}

    def scale(self, role: str, replicas: int, idle_first: Sequence[str] = ()) -> None:
        """Ask for `replicas` workers of `role`; scaling down, the first matched pods of `idle_first` go first."""
        name = self.target.name_of(role)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"{role}: replicas must be an integer >= 0, got {replicas!r}")
        if self.target.kind == "raycluster":
            self._scale_ray_group(name, replicas, idle_first)
        else:
            self._scale_deployment(name, replicas, idle_first)

    def _call(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`method` without the client's typed models (the API's JSON as dicts: no model validation to trip
        over); API and connection errors become ScaleError naming `what`."""
        with api_call(what, self.ns):
            response = method(*args, _preload_content=False, **kwargs)
        try:
            return json.loads(response.data or b"null")
        except ValueError as exc:
            raise ScaleError(f"{what} in {self.ns}: the API server's answer is not JSON: {exc}") from exc

    # -- Deployments --------------------------------------------------------------------------------

    def _deployment(self, name: str) -> dict[str, Any]:
        return self._call(f"GET deployments/{name}", self.apps.read_namespaced_deployment, name, self.ns) or {}

    def _scale_replicas(self, name: str) -> int:
        scale = self._call(f"GET deployments/{name}/scale", self.apps.read_namespaced_deployment_scale, name, self.ns)
        return int(((scale or {}).get("spec") or {}).get("replicas") or 0)

    def _deployment_replicas(self, name: str) -> PoolReplicas:
        wanted = self._scale_replicas(name)
        ready = (self._deployment(name).get("status") or {}).get("readyReplicas") or 0
        return PoolReplicas(wanted=wanted, ready=int(ready))

    def _scale_deployment(self, name: str, replicas: int, idle_first: Sequence[str]) -> None:
        if idle_first:
            current = self._scale_replicas(name)
            if replicas < current:
                self._mark_idlest(name, idle_first, current - replicas)
        self._call(f"PATCH deployments/{name}/scale", self.apps.patch_namespaced_deployment_scale, name, self.ns,
                   {"spec": {"replicas": replicas}}, _content_type=MERGE_PATCH)

    def _mark_idlest(self, name: str, idle_first: Sequence[str], count: int) -> None:
        """Give the `count` idlest pods of Deployment `name` a negative deletion cost, idlest lowest."""
        selector = ((self._deployment(name).get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        if not selector:
            return  # no equality selector to list the pods by: Kubernetes picks
        pods = self._list_pods(",".join(f"{k}={v}" for k, v in sorted(selector.items())))
        for i, pod in enumerate(idlest_pods(pods, idle_first, count)):
            body = {"metadata": {"annotations": {DELETION_COST: str(FIRST_COST + i)}}}
            try:
                self._call(f"PATCH pods/{pod}", self.core.patch_namespaced_pod, pod, self.ns, body,
                           _content_type=MERGE_PATCH)
            except ScaleError as exc:
                if getattr(exc.__cause__, "status", None) != 404:  # gone already: nothing to mark
                    raise

    def _list_pods(self, selector: str) -> list[dict[str, Any]]:
        pods = self._call(f"GET pods?labelSelector={selector}", self.core.list_namespaced_pod, self.ns,
                          label_selector=selector)
        return (pods or {}).get("items") or []

    # -- RayCluster ---------------------------------------------------------------------------------

    def _get_raycluster(self) -> dict[str, Any]:
        name = self.target.raycluster
        return self._call(f"GET {RAY_PLURAL}/{name}", self.custom.get_namespaced_custom_object, RAY_GROUP,
                          RAY_VERSION, self.ns, RAY_PLURAL, name) or {}

    def _ray_group(self, cluster: dict[str, Any], group: str) -> tuple[int, dict[str, Any]]:
        groups = (cluster.get("spec") or {}).get("workerGroupSpecs") or []
        for i, spec in enumerate(groups):
            if spec.get("groupName") == group:
                return i, spec
        names = ", ".join(repr(g.get("groupName")) for g in groups) or "none"
        raise ScaleError(f"RayCluster {self.ns}/{self.target.raycluster} has no worker group {group!r} "
                         f"(groups: {names})")

    def _ray_pods(self, group: str) -> list[dict[str, Any]]:
        return self._list_pods(f"ray.io/cluster={self.target.raycluster},ray.io/group={group}")

    def _ray_replicas(self) -> dict[str, PoolReplicas]:
        cluster = self._get_raycluster()
        out = {}
        for role in ROLES:
            group = self.target.name_of(role)
            _, spec = self._ray_group(cluster, group)
            ready = sum(pod_is_ready(p) for p in self._ray_pods(group))
            out[role] = PoolReplicas(wanted=_group_replicas(spec), ready=ready)
        return out

    def _scale_ray_group(self, group: str, replicas: int, idle_first: Sequence[str]) -> None:
        cluster = self._get_raycluster()
        i, spec = self._ray_group(cluster, group)
        low, high = spec.get("minReplicas", 0), spec.get("maxReplicas")
        if replicas < (low or 0) or (high is not None and replicas > high):
            raise ValueError(f"worker group {group!r} of RayCluster {self.ns}/{self.target.raycluster}: "
                             f"{replicas} replicas is outside minReplicas={low}..maxReplicas={high}")
        path = f"/spec/workerGroupSpecs/{i}"
        ops: list[dict[str, Any]] = [
            {"op": "test", "path": f"{path}/groupName", "value": group},
            {"op": "replace" if "replicas" in spec else "add", "path": f"{path}/replicas", "value": replicas},
        ]
        current = _group_replicas(spec)
        if replicas < current and idle_first:
            names = idlest_pods(self._ray_pods(group), idle_first, current - replicas)
            if names:
                if isinstance(spec.get("scaleStrategy"), dict):
                    ops.append({"op": "add", "path": f"{path}/scaleStrategy/workersToDelete", "value": names})
                else:
                    ops.append({"op": "add", "path": f"{path}/scaleStrategy", "value": {"workersToDelete": names}})
        name = self.target.raycluster
        # kubernetes' client sends a custom object patch as a merge patch, list body or not (which would
        # replace the whole workerGroupSpecs list): name the JSON Patch type.
        self._call(f"PATCH {RAY_PLURAL}/{name}", self.custom.patch_namespaced_custom_object, RAY_GROUP, RAY_VERSION,
                   self.ns, RAY_PLURAL, name, ops, _content_type=JSON_PATCH)


def _group_replicas(spec: dict[str, Any]) -> int:
    """A worker group's replicas (KubeRay's default when unset: minReplicas)."""
    value = spec.get("replicas")
    return int(value if value is not None else spec.get("minReplicas") or 0)
