"""A real redis-server for tests: started on a free port, stoppable and restartable on it."""
from __future__ import annotations

import shutil
import subprocess
import time

import redis


class RedisServer:
    def __init__(self, port: int, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server; .ci/run does it)")
        self.binary = binary
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.password = password
        """With it the server runs with `requirepass` (the URL stays without it)."""
        self.popen: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.popen = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no",
                                       *(["--requirepass", self.password] if self.password else [])],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return self
            except redis.ConnectionError as exc:
                if time.monotonic() > deadline or self.popen.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from exc
                time.sleep(0.02)

    def stop(self) -> None:
        """Shut down without saving: a restart comes back empty, as after a crash."""
        if self.popen is not None and self.popen.poll() is None:
            try:
                self.client().shutdown(nosave=True)
            except redis.ConnectionError:
                pass
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, password=self.password)
