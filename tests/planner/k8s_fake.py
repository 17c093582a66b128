"""A small Kubernetes API server for tests (aiohttp, in a thread): apps/v1 deployments (+ scale), core/v1
pods and ray.io/v1 rayclusters, with state, recording every request the client sends."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

from aiohttp import web
from kubernetes import client

NS = "llm"


@dataclasses.dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


def rbac_rule(request: Recorded) -> tuple[str, str, str, str | None]:
    """(apiGroup, resource[/subresource], verb, object name or None) an RBAC check sees for `request`."""
    parts = request.path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[parts.index("namespaces") + 2:]
    name = rest[1] if len(rest) > 1 else None
    resource = "/".join([rest[0], *rest[2:]])
    verb = {"GET": "get" if name else "list", "PATCH": "patch", "PUT": "update", "POST": "create",
            "DELETE": "delete"}[request.method]
    return group, resource, verb, name


def write_kubeconfig(path: Path, server: str, token: str = "unused") -> Path:
    """A kubeconfig pointing at `server` with a bearer `token`, namespace NS."""
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster: {{server: "{server}"}}
users:
- name: planner
  user: {{token: {token}}}
contexts:
- name: fake
  context: {{cluster: fake, user: planner, namespace: {NS}}}
current-context: fake
""")
    return path


def deployment(name: str, replicas: int, ready: int | None, labels: dict[str, str]) -> dict[str, Any]:
    status: dict[str, Any] = {"replicas": replicas, "observedGeneration": 1}
    if ready is not None:
        status["readyReplicas"] = ready
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "w", "image": "pdserve"}]}}},
            "status": status}


def pod(name: str, ip: str | None, labels: dict[str, str], ready: bool = True) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Running" if ready else "Pending",
                              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip is not None:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": dict(labels)},
            "spec": {"containers": [{"name": "w", "image": "pdserve"}]}, "status": status}


def raycluster(name: str, groups: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": name, "namespace": NS},
            "spec": {"headGroupSpec": {"rayStartParams": {}}, "workerGroupSpecs": groups}}


def merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 merge patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


def json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 test/replace/add; raises ValueError (the server's 422) when an op does not apply."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.get(part)
            if node is None:
                raise ValueError(f"{op['path']}: missing parent")
        key: Any = int(last) if isinstance(node, list) else last
        if op["op"] == "test":
            if isinstance(node, list) and key >= len(node) or isinstance(node, dict) and key not in node \
                    or node[key] != op["value"]:
                raise ValueError(f"test {op['path']} failed")
        elif op["op"] == "replace":
            if isinstance(node, dict) and key not in node:
                raise ValueError(f"replace {op['path']}: no such member")
            node[key] = copy.deepcopy(op["value"])
        elif op["op"] == "add":
            node[key] = copy.deepcopy(op["value"])
        else:
            raise ValueError(f"unsupported op {op['op']}")
    return doc


class FakeKube:
    """The server's objects (`deployments`, `pods`, `rayclusters`: name -> dict, namespace NS), what it
    was sent (`requests`), and `fail[(METHOD, path)] = (status, reason)` to answer a request with an error."""

    def __init__(self) -> None:
        self.deployments: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.rayclusters: dict[str, dict[str, Any]] = {}
        self.requests: list[Recorded] = []
        self.fail: dict[tuple[str, str], tuple[int, str]] = {}
        self.token: str | None = None
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> FakeKube:
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        assert started.wait(10), "fake API server did not start"
        return self

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        started.set()
        self._loop.run_forever()

    def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api_client(self) -> client.ApiClient:
        configuration = client.Configuration(host=self.url)
        return client.ApiClient(configuration)

    def sent(self, method: str | None = None) -> list[Recorded]:
        return [r for r in self.requests if method is None or r.method == method]

    # -- the API ------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.requests.append(Recorded(request.method, request.path, dict(request.query), dict(request.headers), body))
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return status(401, "Unauthorized", "Unauthorized")
        if (request.method, request.path) in self.fail:
            code, reason = self.fail[(request.method, request.path)]
            return status(code, reason, f"{request.path} is {reason.lower()} (fake)")
        try:
            return self._route(request.method, request.path, request.query, request.headers.get("Content-Type"), body)
        except KeyError as exc:
            return status(404, "NotFound", f"{exc.args[0]} not found")
        except ValueError as exc:
            return status(422, "Invalid", str(exc))

    def _route(self, method: str, path: str, query: Any, content_type: str | None, body: Any) -> web.Response:
        parts = path.strip("/").split("/")
        if parts[:3] == ["apis", "apps", "v1"] and parts[4] == NS and parts[5] == "deployments" and len(parts) > 6:
            dep = self.deployments[parts[6]]
            if parts[7:] == ["scale"]:
                if method == "PATCH":
                    if content_type not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                        return status(415, "UnsupportedMediaType", f"unsupported patch type {content_type}")
                    dep["spec"]["replicas"] = merge({"spec": {"replicas": dep["spec"]["replicas"]}}, body)["spec"][
                        "replicas"]
                return ok(scale_of(dep))
            if parts[7:] == [] and method == "GET":
                return ok(dep)
        if parts[:2] == ["api", "v1"] and parts[3] == NS and parts[4] == "pods":
            if len(parts) == 5 and method == "GET":
                items = [p for p in self.pods.values() if selected(p, query.get("labelSelector", ""))]
                return ok({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})
            if len(parts) == 6 and method == "PATCH":
                if content_type != "application/merge-patch+json":
                    return status(415, "UnsupportedMediaType", f"unsupported patch type {content_type}")
                return ok(merge(self.pods[parts[5]], body))
        if parts[:3] == ["apis", "ray.io", "v1"] and parts[4] == NS and parts[5] == "rayclusters" and len(parts) == 7:
            name = parts[6]
            if method == "PATCH":
                if content_type == "application/json-patch+json" and isinstance(body, list):
                    self.rayclusters[name] = json_patch(self.rayclusters[name], body)
                elif content_type == "application/merge-patch+json" and isinstance(body, dict):
                    merge(self.rayclusters[name], body)
                else:
                    return status(400, "BadRequest", f"cannot apply a {type(body).__name__} as {content_type}")
            return ok(self.rayclusters[name])
        return status(404, "NotFound", f"no route {method} {path}")


def scale_of(dep: dict[str, Any]) -> dict[str, Any]:
    labels = dep["spec"]["selector"]["matchLabels"]
    return {"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": dep["metadata"]["name"], "namespace": NS},
            "spec": {"replicas": dep["spec"]["replicas"]},
            "status": {"replicas": dep["status"].get("replicas", 0),
                       "selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items()))}}


def selected(obj: dict[str, Any], selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, _, v in (term.partition("=") for term in selector.split(",") if term))


def ok(obj: Any) -> web.Response:
    return web.json_response(obj)


def status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}, status=code)
