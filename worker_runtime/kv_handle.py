"""A prefill worker's KV handle as the decode side receives it: parsed and checked before the engine thread.

The handle (`worker_pb2.KVHandle`) is caller input on the decode worker (a router relays it), so each
field is checked here and a bad one is refused as `InvalidParameter` naming it (INVALID_ARGUMENT):
  peer_info_json  a JSON object as `KVSender.peer_info()` writes it: host, port in [1, 65535], instance
                  id, and the data paths (`modes`, or the older single `backend`)
  transfer_id     1 to MAX_TRANSFER_ID_CHARS characters
  block_ids       non-empty, distinct, each in [0, MAX_BLOCK_ID]
  capability      at most MAX_TRANSFER_ID_CHARS characters (the sender's per-transfer secret)
Whether the handle was signed by a router of the cluster is checked before this
(`common.cluster_auth.handles.verify`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.sampling_params import InvalidParameter

MAX_PEER_INFO_CHARS = 4096
MAX_TRANSFER_ID_CHARS = 256
MAX_BLOCK_ID = 2**31 - 1


@dataclass
class KVSource:
    """Where a prompt's KV waits (from the prefill worker's KV handle)."""

    peer_info: dict
    transfer_id: str
    block_ids: list[int]
    first_token_id: int
    capability: str = ""
    """The prefill worker's secret for this transfer (its sender refuses reads without it)."""

    @classmethod
    def from_handle(cls, handle, first_token_id: int) -> KVSource:
        """Parse a KVHandle; raises InvalidParameter naming the field (the handle is caller input)."""
        _need(len(handle.capability) <= MAX_TRANSFER_ID_CHARS, "kv.capability", "too long")
        return cls(parse_peer_info(handle.peer_info_json), check_transfer_id(handle.transfer_id),
                   check_block_ids(list(handle.block_ids)), first_token_id, handle.capability)


def parse_peer_info(text: str) -> dict:
    """`kv.peer_info_json`: a JSON object as `KVSender.peer_info()` writes it (host, port, instance id,
    data paths). Anything else is refused here, before it reaches the engine thread."""
    name = "kv.peer_info_json"
    _need(len(text) <= MAX_PEER_INFO_CHARS, name, f"longer than {MAX_PEER_INFO_CHARS} characters")
    try:
        info = json.loads(text)
    except ValueError:
        raise InvalidParameter(name, "not JSON") from None
    _need(isinstance(info, dict), name, f"must be a JSON object, got {type(info).__name__}")
    _need(isinstance(info.get("host"), str) and info["host"], f"{name}.host", "must be a non-empty string")
    port = info.get("port")
    _need(type(port) is int and 0 < port <= 65535, f"{name}.port", "must be an integer in [1, 65535]")
    _need(isinstance(info.get("instance_id", ""), str), f"{name}.instance_id", "must be a string")
    modes = info.get("modes")
    if modes is not None:
        _need(isinstance(modes, list) and modes and all(isinstance(m, str) for m in modes),
              f"{name}.modes", "must be a non-empty list of strings")
    else:
        _need(isinstance(info.get("backend"), str), f"{name}.backend", "modes or backend must name a data path")
    return info


def check_transfer_id(transfer_id: str) -> str:
    _need(0 < len(transfer_id) <= MAX_TRANSFER_ID_CHARS, "kv.transfer_id",
          f"must have 1 to {MAX_TRANSFER_ID_CHARS} characters")
    return transfer_id


def check_block_ids(block_ids: list[int]) -> list[int]:
    _need(bool(block_ids), "kv.block_ids", "empty")
    _need(all(0 <= b <= MAX_BLOCK_ID for b in block_ids), "kv.block_ids", f"ids must be in [0, {MAX_BLOCK_ID}]")
    _need(len(set(block_ids)) == len(block_ids), "kv.block_ids", "ids must be distinct")
    return block_ids


def _need(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(field_name, message)
