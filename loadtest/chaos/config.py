"""What a chaos run does: the cluster it starts, the load it offers and the faults it injects."""
from __future__ import annotations

from dataclasses import dataclass, field

from loadtest.config import LoadTestConfig

FAULTS = ("kill", "stop", "drain")
"""kill: SIGKILL, restarted after `restart_delay_s` (an OOM kill, a lost pod). stop: SIGSTOP past the
router's stream timeout, then SIGCONT (a hung process, a network partition that heals). drain: SIGTERM
with a short drain timeout, restarted once it exited (a rolling update)."""
ROLES = ("prefill", "decode")
STOPPABLE_ROLES = ("decode",)
"""A stopped decode worker's streams go silent, which the router's stream timeout detects; a stopped
prefill worker is only noticed through its health check, so `stop` targets decode workers."""


@dataclass
class ChaosConfig:
    load: LoadTestConfig
    """The load offered during the run (its url is filled in once the router is up)."""
    num_prefill: int = 2
    num_decode: int = 2
    duration_s: float = 300.0
    """Load and faults stop after this long; requests in flight then finish."""
    fault_every_s: float = 30.0
    """Time between the starts of two faults (a fault starts only once the previous victim is back)."""
    first_fault_s: float = 10.0
    faults: tuple[str, ...] = FAULTS
    roles: tuple[str, ...] = ROLES
    """Pools faults may hit; each needs two workers or more, so one is left serving."""
    restart_delay_s: float = 2.0
    stream_timeout_s: float = 8.0
    """The router's --stream-timeout-s: a decode stream silent this long migrates."""
    stop_s: float | None = None
    """How long a stopped worker stays stopped (default: stream timeout + 4 s)."""
    drain_timeout_s: float = 2.0
    """The workers' --drain-timeout-s: what still runs at it migrates."""
    max_migrations: int = 3
    leak_timeout_s: float = 30.0
    seed: int = 0
    worker_args: list[str] = field(default_factory=list)
    """Extra flags for every worker (model, dtype, cache size, ...)."""
    router_args: list[str] = field(default_factory=list)
    output: str | None = None
    """JSON report file."""
    log_dir: str | None = None
    """Write every process's output here (router.log, prefill-0.log, ...)."""

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("chaos needs --decode >= 1 and --prefill >= 0")
        for name in ("duration_s", "fault_every_s", "stream_timeout_s", "drain_timeout_s", "leak_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.first_fault_s < 0 or self.restart_delay_s < 0:
            raise ValueError("--first-fault-s and --restart-delay-s must be >= 0")
        if self.stop_s is None:
            self.stop_s = self.stream_timeout_s + 4.0
        elif not self.stop_s > 0:
            raise ValueError("--stop-s must be > 0")
        if self.max_migrations < 0:
            raise ValueError("--max-migrations must be >= 0")
        unknown = set(self.faults) - set(FAULTS)
        if not self.faults or unknown:
            raise ValueError(f"--faults: choose from {', '.join(FAULTS)} (got {', '.join(self.faults) or 'none'})")
        bad_roles = set(self.roles) - set(ROLES)
        if not self.roles or bad_roles:
            raise ValueError(f"--roles: choose from {', '.join(ROLES)}")
        for role in self.roles:
            if self.pool_size(role) < 2:
                raise ValueError(f"faults on {role} workers need at least 2 of them (one keeps serving)")
        if self.faults == ("stop",) and not set(self.roles) & set(STOPPABLE_ROLES):
            raise ValueError("--faults stop hits decode workers only: add decode to --roles")

    def pool_size(self, role: str) -> int:
        return self.num_prefill if role == "prefill" else self.num_decode
