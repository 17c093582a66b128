"""The planner's interval: read the routers, decide, scale (blocking; run it in its own thread)."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from planner.config import PlannerConfig
from planner.observation import observe
from planner.planner_metrics import PlannerMetrics
from planner.policy import Decision, Planner
from planner.router_metrics import RouterSnapshot, parse_router_metrics
from planner.scaler import ROLES, Scaler

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DecisionRecord:
    time: float
    decision: Decision


class PlannerLoop:
    def __init__(self, config: PlannerConfig, read_metrics: Callable[[], list[str]], scaler: Scaler,
                 metrics: PlannerMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 on_decision: Callable[[Decision], None] | None = None) -> None:
        self.config = config
        self.read_metrics = read_metrics
        """The /metrics text of every router (raises when none can be read)."""
        self.scaler = scaler
        self.metrics = metrics
        self.clock = clock
        self.on_decision = on_decision
        self.planner = Planner(config)
        self.history: deque[RouterSnapshot] = deque()
        self.decisions: list[DecisionRecord] = []
        self._last_tick: float | None = None

    def tick(self) -> list[Decision]:
        """One interval; never raises (a failed read or scale is logged and counted)."""
        now = self.clock()
        elapsed = 0.0 if self._last_tick is None else now - self._last_tick
        self._last_tick = now
        try:
            snapshot = parse_router_metrics(self.read_metrics(), now)
        except Exception as exc:  # noqa: BLE001 - routers restarting, a network blip: try next interval
            logger.warning("planner: cannot read the routers' metrics: %s", exc)
            self._count_error("metrics")
            return []
        self._remember(snapshot)
        try:
            replicas = self.scaler.replicas()
        except Exception as exc:  # noqa: BLE001
            logger.warning("planner: cannot read the pools' sizes: %s", exc)
            self._count_error("scale")
            return []
        wanted = {role: replicas[role].wanted for role in ROLES}
        obs = observe(self.history)
        decisions = self.planner.decide(obs, replicas) if obs is not None else []
        done = []
        for decision in decisions:
            try:
                self.scaler.scale(decision.role, decision.desired, obs.pools[decision.role].idle_first)
            except Exception as exc:  # noqa: BLE001 - e.g. the API server refused: the next interval retries
                logger.warning("planner: scaling %s to %d failed: %s", decision.role, decision.desired, exc)
                self._count_error("scale")
                continue
            self.planner.applied(decision, obs.time)
            wanted[decision.role] = decision.desired
            done.append(decision)
            self.decisions.append(DecisionRecord(now, decision))
            logger.info("planner: %s %d -> %d (%s: %s)", decision.role, decision.current, decision.desired,
                        decision.reason, decision.detail)
            if self.on_decision is not None:
                self.on_decision(decision)
        if self.metrics is not None:
            self.metrics.record(self.planner, replicas, wanted, done, elapsed)
        return done

    def run(self, stop: threading.Event) -> None:
        """Tick every interval until `stop` is set."""
        while not stop.wait(self.config.interval_s):
            self.tick()

    def _remember(self, snapshot: RouterSnapshot) -> None:
        """Keep the snapshots of the last window (and the one just before it, where the window starts)."""
        self.history.append(snapshot)
        start = snapshot.time - self.config.window_s
        while len(self.history) > 2 and self.history[1].time <= start:
            self.history.popleft()

    def _count_error(self, stage: str) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(stage).inc()
