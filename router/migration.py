"""Request migration bookkeeping: what a sample has streamed, and whether its broken stream moves on.

Pure Python (no network): the pipeline feeds each sample's streamed chunks into a
`SampleProgress`, and when the decode stream breaks asks `migration_reason` whether
the break is one a migration can cure and `SampleProgress.may_migrate` whether the
sample still may. A resumed sample is re-admitted with the original prompt and
`resume_token_ids` = every token the client already has (router/README.md,
"Request migration").
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import grpc


class MigrationReason(str, enum.Enum):
    WORKER_LOST = "worker_lost"
    """The stream ended UNAVAILABLE: the process died or the connection was cut."""
    STREAM_TIMEOUT = "stream_timeout"
    """Nothing arrived for the stream timeout (a hung or stopped worker)."""
    DRAINED = "drained"
    """The worker shut down (drain timeout passed) or refused the sample because it is draining."""


DRAINING_MARK = "draining"
"""Workers put this word in the status details of streams they end because they drain."""


def migration_reason(code: grpc.StatusCode, details: str) -> MigrationReason | None:
    """Why a decode stream that ended with this status should move, or None when it must fail
    (bad input, deadline, a worker-side error the next worker would hit as well)."""
    if code != grpc.StatusCode.UNAVAILABLE:
        return None
    return MigrationReason.DRAINED if DRAINING_MARK in (details or "").lower() else MigrationReason.WORKER_LOST


@dataclass
class SampleProgress:
    """One sample's state as the router streams it."""

    sample_id: str
    max_migrations: int
    generated: list[int] = field(default_factory=list)
    """Tokens the client has received, in order."""
    migrations: list[MigrationReason] = field(default_factory=list)
    finished: bool = False

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")

    def observe(self, token_ids) -> None:
        """Tokens just relayed to the client."""
        if self.finished:
            raise RuntimeError(f"{self.sample_id}: tokens after the sample finished")
        self.generated.extend(token_ids)

    def finish(self) -> None:
        self.finished = True

    def may_migrate(self) -> bool:
        return not self.finished and len(self.migrations) < self.max_migrations

    def migrate(self, reason: MigrationReason) -> str:
        """Count a migration; returns the request id of the next attempt (a fresh one per worker
        visit, so a late abort on the old worker never hits the new attempt)."""
        if not self.may_migrate():
            raise RuntimeError(f"{self.sample_id}: no migration left")
        self.migrations.append(reason)
        return self.attempt_id

    @property
    def attempt_id(self) -> str:
        return self.sample_id if not self.migrations else f"{self.sample_id}~m{len(self.migrations)}"

    @property
    def resume_token_ids(self) -> list[int]:
        return list(self.generated)

    def context(self, prompt: list[int]) -> list[int]:
        """What the next worker computes: the prompt and the tokens already streamed."""
        return [*prompt, *self.generated]
