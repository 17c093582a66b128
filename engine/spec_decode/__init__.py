"""Speculative decoding: proposers guess a sequence's next tokens; the target verifies them in one forward.

Proposers (`ngram.py`, `draft.py`) are deterministic, so the draft distribution of every proposed token is
a point mass and `rejection.py` accepts a proposed token x with probability p_target(x) (always, for greedy
rows, when x is the argmax). The engine (llm_engine.py) asks the proposer before scheduling, the scheduler
gives a decoding sequence 1 + K tokens and their blocks, and after verification the sequence keeps the KV of
its accepted tokens only: blocks holding nothing but rejected KV are freed, and blocks are hashed into the
prefix cache only once every token in them is accepted and computed.
"""
from __future__ import annotations

from typing import Protocol

from engine.request import Request


class Proposer(Protocol):
    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        """Proposed next tokens for each decoding request (at most max_tokens[i]; [] for none)."""
        ...

    def free(self, request_id: str) -> None:
        """Forget a request's state (it finished, was aborted or preempted)."""
        ...
