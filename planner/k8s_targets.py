"""What `KubernetesScaler` scales (the chart's two Deployments or a RayCluster's worker groups), its
errors, and the choice of the pods to remove first."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Iterator, Sequence

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from planner.scaler import ROLES

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class ScaleError(RuntimeError):
    """A Kubernetes API call failed: says which call, where, and what the server answered."""


@dataclasses.dataclass(frozen=True)
class KubernetesTargetConfig:
    """Either both Deployments (`prefill_deployment`, `decode_deployment`) or one `raycluster` with the
    worker groups `prefill_group` and `decode_group`, in `namespace`."""

    namespace: str
    prefill_deployment: str | None = None
    decode_deployment: str | None = None
    raycluster: str | None = None
    prefill_group: str = "prefill"
    decode_group: str = "decode"

    def __post_init__(self) -> None:
        _check_name("namespace", self.namespace)
        deployments = (self.prefill_deployment, self.decode_deployment)
        if self.raycluster is not None:
            if any(d is not None for d in deployments):
                raise ValueError("give either --prefill-deployment/--decode-deployment or --raycluster, not both")
            _check_name("raycluster", self.raycluster)
            if not self.prefill_group or not self.decode_group or self.prefill_group == self.decode_group:
                raise ValueError(f"prefill_group ({self.prefill_group!r}) and decode_group ({self.decode_group!r}) "
                                 "must be two different worker group names")
        elif all(d is None for d in deployments):
            raise ValueError("nothing to scale: give --prefill-deployment and --decode-deployment, or --raycluster")
        elif any(d is None for d in deployments):
            raise ValueError("deployments mode needs both --prefill-deployment and --decode-deployment")
        else:
            _check_name("prefill_deployment", self.prefill_deployment)
            _check_name("decode_deployment", self.decode_deployment)
            if self.prefill_deployment == self.decode_deployment:
                raise ValueError(f"prefill and decode cannot be the same Deployment ({self.prefill_deployment!r})")

    @property
    def kind(self) -> str:
        """"deployments" or "raycluster"."""
        return "raycluster" if self.raycluster is not None else "deployments"

    def name_of(self, role: str) -> str:
        """The Deployment, or the worker group's name, of `role`."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
        if self.kind == "raycluster":
            return self.prefill_group if role == "prefill" else self.decode_group
        return self.prefill_deployment if role == "prefill" else self.decode_deployment  # type: ignore[return-value]


def _check_name(field: str, value: str | None) -> None:
    if not value or len(value) > 253 or not _NAME.match(value):
        raise ValueError(f"{field} must be a Kubernetes object name (lowercase letters, digits, '-', '.'), "
                         f"got {value!r}")


@contextlib.contextmanager
def api_call(what: str, namespace: str) -> Iterator[None]:
    """Turn an API or connection error into a ScaleError naming `what` (e.g. "PATCH deployments/x/scale")."""
    try:
        yield
    except ApiException as exc:
        raise ScaleError(f"{what} in {namespace}: {exc.status} {exc.reason}: {_server_message(exc)}") from exc
    except HTTPError as exc:
        raise ScaleError(f"{what} in {namespace}: no answer from the API server: {exc}") from exc


def _server_message(exc: ApiException) -> str:
    """The `message` of the Status object the server sent, else its body."""
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body or ""
    try:
        message = json.loads(body).get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or body.strip() or "(no message)")


def host_of(address: str) -> str:
    """The host part of host:port ("[::1]:7002" -> "::1")."""
    host = address.rpartition(":")[0] if address.count(":") == 1 or address.startswith("[") else address
    return host.strip("[]")


def idlest_pods(pods: Sequence[dict], idle_first: Sequence[str], count: int) -> list[str]:
    """Names of up to `count` pods, in the order their IPs (status.podIP / podIPs) come in `idle_first`.
    `pods` are API dicts; pods being deleted and pods matching no address are never chosen."""
    by_ip: dict[str, str] = {}
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        status = pod.get("status") or {}
        ips = [status.get("podIP")] + [p.get("ip") for p in status.get("podIPs") or []]
        for ip in ips:
            if ip:
                by_ip.setdefault(ip, pod["metadata"]["name"])
    chosen: list[str] = []
    for address in idle_first:
        name = by_ip.get(host_of(address))
        if name is not None and name not in chosen and len(chosen) < count:
            chosen.append(name)
    return chosen


def pod_is_ready(pod: dict) -> bool:
    """Running, Ready, and not being deleted."""
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
