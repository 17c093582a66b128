"""The fault schedule: which fault hits which worker when. Pure and seeded, so a run can be replayed."""
from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.chaos.config import STOPPABLE_ROLES, ChaosConfig


@dataclass(frozen=True)
class Fault:
    at_s: float
    """Earliest start, seconds after the load began (the previous victim must be back first)."""
    kind: str
    role: str
    index: int
    """Which worker of the pool."""

    def describe(self) -> str:
        return f"{self.kind} {self.role}[{self.index}]"


def fault_plan(config: ChaosConfig) -> list[Fault]:
    """Faults every `fault_every_s` from `first_fault_s` while the load runs, kinds and victims drawn
    with `seed`; `stop` only where it applies (decode workers)."""
    rng = random.Random(config.seed)
    plan, at = [], config.first_fault_s
    while at < config.duration_s:
        kind = rng.choice(config.faults)
        roles = [r for r in config.roles if kind != "stop" or r in STOPPABLE_ROLES]
        if not roles:  # e.g. stop drawn with only prefill targeted: another kind
            kind = rng.choice([k for k in config.faults if k != "stop"])
            roles = list(config.roles)
        role = rng.choice(roles)
        plan.append(Fault(round(at, 3), kind, role, rng.randrange(config.pool_size(role))))
        at += config.fault_every_s
    return plan
