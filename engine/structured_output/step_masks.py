"""One step's grammar bitmask, filled on a helper thread while the model computes the step.

Each constrained sample is a job with its draft tokens ([] without speculation) and K + 1 bitmask rows,
one per row of logits it has: the matcher walks the drafts, fills the row of each position up to (and
including) the first draft its grammar forbids, and is rolled back (tokens are accepted after sampling).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.sampler import SpecRow
from engine.structured_output.backend import GrammarBackend, SampleGrammar


class PendingMasks:
    """The bitmask being filled: where each job's rows start, and the spec rows waiting for theirs."""

    def __init__(self, future: Future, starts: list[int]) -> None:
        self._future = future
        self._starts = starts
        self._spec_rows: list[tuple[int, SpecRow]] = []

    def first_row(self, job: int) -> int:
        return self._starts[job]

    def attach(self, job: int, spec_row: SpecRow) -> None:
        """`spec_row` verifies job `job`'s drafts: `wait` sets its bitmask rows."""
        self._spec_rows.append((job, spec_row))

    def wait(self) -> torch.Tensor:
        bitmask, num_valid = self._future.result()
        for job, spec_row in self._spec_rows:
            start, valid = self._starts[job], num_valid[job]
            spec_row.bitmask_rows = [start + i if i <= valid else None
                                     for i in range(len(spec_row.draft_token_ids) + 1)]
        return bitmask


class StepMasks:
    def __init__(self, backend: GrammarBackend) -> None:
        self.backend = backend
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")

    def start(self, jobs: list[tuple[SampleGrammar, list[int]]]) -> PendingMasks | None:
        """Start filling the rows of each (grammar, draft tokens) job (None: no job)."""
        if not jobs:
            return None
        starts, num_rows = [], 0
        for _, drafts in jobs:
            starts.append(num_rows)
            num_rows += len(drafts) + 1
        return PendingMasks(self._pool.submit(self._fill, list(jobs), starts, num_rows), starts)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    def _fill(self, jobs, starts: list[int], num_rows: int) -> tuple[torch.Tensor, list[int]]:
        bitmask = self.backend.allocate_bitmask(num_rows)
        num_valid = []
        for (grammar, drafts), start in zip(jobs, starts, strict=True):
            valid = grammar.num_valid(drafts) if drafts else 0
            for i in range(valid + 1):
                grammar.fill(bitmask, start + i)
                if i < valid:
                    grammar.accept(drafts[i])
            if valid:
                grammar.rollback(valid)
            num_valid.append(valid)
        return bitmask, num_valid
