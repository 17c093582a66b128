"""The body of a `pdserve serve` worker actor: a WorkerServer on an asyncio loop of its own thread."""
from __future__ import annotations

import asyncio
import logging
import threading

from worker_runtime.config import WorkerConfig

WORKER_START_TIMEOUT_S = 900.0  # first start may convert the model and build the CPU kernel


class WorkerProcess:
    """Body of a worker actor: a WorkerServer on an asyncio loop of its own thread."""

    def __init__(self, config: WorkerConfig, log_level: str = "WARNING") -> None:
        from pdserve.worker_roles import worker_server

        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._server = worker_server(config)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, name="worker-server", daemon=True).start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._server.start())
        except BaseException as exc:  # noqa: BLE001 - reported by address()
            self._error = exc
        self._ready.set()
        self._loop.run_forever()

    def address(self) -> str:
        self._ready.wait(WORKER_START_TIMEOUT_S)
        if self._error is not None:
            raise RuntimeError(f"worker failed to start: {self._error!r}")
        return self._server.address

    def drain(self, timeout_s: float) -> None:
        """Stop taking requests, finish the ones held (at most `timeout_s`), then stop serving."""
        asyncio.run_coroutine_threadsafe(self._server.drain(timeout_s), self._loop).result(timeout_s + 30)
        asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop).result(60)
