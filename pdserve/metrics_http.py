"""The /metrics HTTP endpoint of every pdserve process, always in the Prometheus text format.

Workers also answer probes here (``/health``: the process serves HTTP; ``/ready``: it takes work),
for Kubernetes when their gRPC port speaks mutual TLS, which the kubelet's gRPC probes cannot.

prometheus_client's own server answers Prometheus (which asks for OpenMetrics
first) with OpenMetrics, and its OpenMetrics writer (0.26) turns the ':' of our
`pdserve:` names into '_' in sample lines. The text format keeps names as they
are, and Prometheus reads it just as well.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 ready: Callable[[], bool] | None = None) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?")[0]
                if ready is not None and path in ("/health", "/ready"):
                    ok = path == "/health" or ready()
                    self._reply(200 if ok else 503, b"ok\n" if ok else b"not ready\n", "text/plain")
                    return
                if path not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                self._reply(200, generate_latest(registry), CONTENT_TYPE)

            def _reply(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
