"""A worker's two kv_transfer sides: a sender (the blocks it leases to others) and a receiver (the blocks it pulls).

Both roles open both: a prefill worker leases prompts to decode workers and pulls cached prefixes from
peers; a decode worker pulls prompts from prefill workers and leases its cached context to prefill workers
(router/README.md, "Peer prefix pulls"). The runtime sees one object (`backend_name`, `backend_info`,
`close`), as it did when a role had one side.
"""
from __future__ import annotations

from typing import Any

from kv_transfer import KVReceiver, KVSender, make_receiver, make_sender


class TransferSides:
    def __init__(self, sender: KVSender, receiver: KVReceiver) -> None:
        self.sender = sender
        self.receiver = receiver

    @property
    def backend_name(self) -> str:
        return self.sender.backend_name

    def backend_info(self) -> dict[str, str]:
        return self.sender.backend_info()

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()


def open_sides(kv_cache: Any, layout: Any, kv_config: Any) -> TransferSides:
    """Both sides over one KV pool (the sender closed again if the receiver fails)."""
    sender = make_sender(kv_cache, layout, kv_config)
    try:
        return TransferSides(sender, make_receiver(kv_cache, layout, kv_config))
    except BaseException:
        sender.close()
        raise
