"""Exceptions raised or recorded by kv_transfer."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """Base class of every kv_transfer error."""


class IncompatiblePeerError(KVTransferError):
    """The handshake found a different protocol version or KV layout."""


class HandshakeCutError(KVTransferError):
    """The sender cut the handshake short or answered ``busy`` (its port crowded): worth another try."""


class TransferRefusedError(KVTransferError):
    """The sender refused a read (unknown transfer, block not exposed, ...)."""


class BackendUnavailableError(KVTransferError):
    """A backend was requested explicitly but cannot run here."""
