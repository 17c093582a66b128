"""A stand-in Kubernetes API server holding Secrets, so `helm template --dry-run=server` runs the
chart's `lookup` calls against it (what `helm upgrade` does against a real cluster)."""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# Discovery of the core group only: charts rendered against it may hold nothing but v1 objects.
DISCOVERY = {
    "/version": {"major": "1", "minor": "35", "gitVersion": "v1.35.0"},
    "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
    "/api/v1": {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
        {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret", "verbs": ["get"]}]},
}
SECRET_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/secrets/([^/]+)$")


class KubeAPI:
    """Serves GET of the Secrets in `secrets` ((namespace, name) -> object) and records every path asked."""

    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], dict] = {}
        self.asked: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                api.asked.append(path)
                match = SECRET_PATH.match(path)
                body = DISCOVERY.get(path) or (match and api.secrets.get(match.groups()))
                status = 200 if body else 404
                if not body:
                    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                            "code": 404}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> KubeAPI:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def install(self, objs: list[dict], release: str, namespace: str) -> None:
        """Hold the Secrets among `objs` as `helm install` leaves them (with Helm's ownership annotations)."""
        for obj in objs:
            if obj["kind"] == "Secret":
                meta = obj["metadata"]
                meta["annotations"] = {**meta.get("annotations", {}), "meta.helm.sh/release-name": release,
                                       "meta.helm.sh/release-namespace": namespace}
                self.secrets[(namespace, meta["name"])] = obj

    def helm_args(self, workdir: Path) -> tuple[list[str], dict[str, str]]:
        """`helm template` flags and environment rendering against this server; its kubeconfig (empty) and
        discovery cache go to `workdir`."""
        (workdir / "kubeconfig").write_text("")
        host, port = self._server.server_address[:2]
        return (["--dry-run=server", "--disable-openapi-validation", "--kubeconfig", str(workdir / "kubeconfig"),
                 "--kube-apiserver", f"http://{host}:{port}"], {"KUBECACHEDIR": str(workdir / "kube-cache")})
