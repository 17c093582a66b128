"""`pdserve serve --planner`: the planner in serve's own process, sizing its Ray worker actors."""
from __future__ import annotations

import asyncio
import threading

from prometheus_client import generate_latest

from planner.config import PlannerConfig
from planner.loop import PlannerLoop
from planner.planner_metrics import PlannerMetrics
from planner.policy import Decision
from planner.ray_scaler import RayScaler


class ServePlanner:
    def __init__(self, config: PlannerConfig, cluster, router, drain_timeout_s: float) -> None:
        """`cluster`: serve's started RayCluster; `router`: its started RouterServer (this thread
        runs the router's event loop)."""
        registry = router.metrics.registry
        self.scaler = RayScaler(cluster, router.pool, asyncio.get_running_loop(), drain_timeout_s)
        self.loop = PlannerLoop(config, lambda: [generate_latest(registry).decode()], self.scaler,
                                PlannerMetrics(registry), on_decision=print_decision)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.loop.run, args=(self._stop,), name="planner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        """Stop deciding; wait for the starts and drains under way."""
        self._stop.set()
        await asyncio.get_running_loop().run_in_executor(None, self._join)

    def _join(self) -> None:
        self._thread.join(30)
        self.scaler.close()


def print_decision(decision: Decision) -> None:
    """The decision as a line on stdout (what an operator watching serve or the planner sees)."""
    print(f"planner: {decision.role} {decision.current} -> {decision.desired} ({decision.reason}: "
          f"{decision.detail})", flush=True)
