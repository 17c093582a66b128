"""The router's signature over a KV handle and the prompt it belongs to (pure functions).

HMAC-SHA256 with the cluster's handle key over every field of the handle (peer info, transfer id,
capability, block ids, token count, worker address) and a hash of the prompt's token ids. A decode
worker given a handle that a router did not sign for this very prompt refuses it before dialing
anything: no KV pulled for one prompt is cached under another's hashes, and no handle points it
at an address of the caller's choosing.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from array import array
from collections.abc import Sequence


def prompt_digest(prompt_token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(array("q", prompt_token_ids).tobytes()).digest()


def _message(handle, prompt_token_ids: Sequence[int]) -> bytes:
    peer = handle.peer.SerializeToString(deterministic=True).hex()  # the typed KVPeer, canonically encoded
    fields = [peer, handle.transfer_id, handle.capability, list(handle.block_ids), handle.num_tokens,
              handle.worker_address, prompt_digest(prompt_token_ids).hex()]
    return json.dumps(fields, separators=(",", ":")).encode()


def sign(key: bytes, handle, prompt_token_ids: Sequence[int]) -> None:
    """Set `handle.signature` (a worker_pb2.KVHandle) for `prompt_token_ids`."""
    handle.signature = hmac.new(key, _message(handle, prompt_token_ids), hashlib.sha256).digest()


def verify(key: bytes, handle, prompt_token_ids: Sequence[int]) -> bool:
    """Did a router holding `key` sign exactly this handle for exactly this prompt?"""
    expected = hmac.new(key, _message(handle, prompt_token_ids), hashlib.sha256).digest()
    return hmac.compare_digest(expected, bytes(handle.signature))
