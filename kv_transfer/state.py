"""Ordered transfer states.

The order matters: the state of a request whose KV moves in several pieces
(ranks, layers) is the minimum over the pieces, so ``FAILED`` is the lowest and
``DONE`` the highest value.
"""

from __future__ import annotations

import enum


class TransferState(enum.IntEnum):
    """Life cycle of one transfer, on either side.

    ``WAITING``: created, nothing has moved yet (sender: lease held, waiting for
    the receiver to ask; receiver: queued or handshaking).
    ``TRANSFERRING``: the sender granted the read; bytes are moving.
    ``DONE`` and ``FAILED`` are terminal; once reached, the backend no longer
    touches the transfer's blocks and the owner may free or reuse them.
    """

    FAILED = 0
    WAITING = 1
    TRANSFERRING = 2
    DONE = 3

    @property
    def is_terminal(self) -> bool:
        """True for DONE and FAILED."""
        return self in (TransferState.DONE, TransferState.FAILED)
