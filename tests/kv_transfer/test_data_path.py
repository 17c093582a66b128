"""The data paths as objects (kv_transfer/data_path.py): negotiation, and what each side builds.

- ``choose``: the receiver's first path the sender offers and that can reach it, in the receiver's
  order; refused paths skipped; an old sender's single ``backend`` understood; none in common refused.
- A side's paths: CUDA IPC only where the pool can use it, TCP always last, the wire names as before.
- The TCP path's shared-buffer negotiation: the sender offers its staging buffers (``shm_pid``) only to
  a receiver of its own host that shares staged buffers too.
"""

from __future__ import annotations

import os

import pytest

from kv_transfer import KVLayout, KVTransferConfig, make_receiver, make_sender
from kv_transfer.data_path import ReceiverPath, choose
from kv_transfer.sharded import region_of
from kv_transfer.tcp_path import TcpPullPath, TcpSendPath

from .peers import SMOLLM2, make_pool

LAYOUT = KVLayout(dtype="float32", **SMOLLM2)


class FakePath(ReceiverPath):
    """A receiver path called ``name`` that reaches a sender only when ``reach`` says so."""

    def __init__(self, name: str, reach=lambda info: True) -> None:
        self.name = name
        self.reach = reach

    def can_reach(self, peer_info: dict) -> bool:
        return self.reach(peer_info)

    def pull(self, link, t, grant, payload) -> int:
        raise AssertionError("not pulled in these tests")


def test_choose_takes_the_receivers_first_path_the_sender_offers():
    ipc = FakePath("cuda_ipc", reach=lambda info: info.get("ipc_host") == "here")
    nixl, tcp = FakePath("nixl"), FakePath("tcp")
    paths = [ipc, nixl, tcp]
    # the receiver's order decides, not the sender's
    assert choose(paths, {"modes": ["tcp", "nixl", "cuda_ipc"], "ipc_host": "here"}) is ipc
    assert choose(paths, {"modes": ["tcp", "nixl"]}) is nixl
    # offered but unreachable (another host): the next one
    assert choose(paths, {"modes": ["cuda_ipc", "nixl", "tcp"], "ipc_host": "elsewhere"}) is nixl
    # refused for this sender (failed with it before): the next one, down to TCP
    assert choose(paths, {"modes": ["cuda_ipc", "nixl", "tcp"], "ipc_host": "here"}, refused=["cuda_ipc"]) is nixl
    assert choose(paths, {"modes": ["cuda_ipc", "nixl", "tcp"], "ipc_host": "here"},
                  refused=["cuda_ipc", "nixl"]) is tcp
    # a sender that names only its backend (no "modes")
    assert choose(paths, {"backend": "tcp"}) is tcp
    assert choose([tcp], {"modes": ["nixl", "tcp"]}) is tcp


def test_choose_refuses_when_nothing_is_in_common():
    with pytest.raises(ValueError, match=r"no common data path: peer serves \['nixl'\], this receiver \['tcp'\]"):
        choose([FakePath("tcp")], {"modes": ["nixl"]})
    with pytest.raises(ValueError, match="no common data path"):
        choose([FakePath("tcp")], {"modes": ["tcp"]}, refused=["tcp"])


def test_sides_hold_their_paths_preferred_first_tcp_last(thread_guard):
    pool = make_pool(LAYOUT, 4, 1)
    with make_sender(pool, LAYOUT, KVTransferConfig(backend="tcp")) as s, \
            make_receiver(make_pool(LAYOUT, 4, 2), LAYOUT, KVTransferConfig(backend="tcp")) as r:
        # a host pool exports nothing: the sender serves TCP alone, the receiver keeps CUDA IPC unusable
        assert s.modes == ("tcp",) and s.peer_info()["modes"] == ["tcp"] and "ipc_host" not in s.peer_info()
        assert r.modes == ("cuda_ipc", "tcp") and r.path_named("cuda_ipc").puller is None
        assert isinstance(s.paths[-1], TcpSendPath) and isinstance(r.paths[-1], TcpPullPath)
        assert s.path_named("nixl") is None and r.choose_path(s.peer_info()) is r.paths[-1]
        assert s.backend_name == r.backend_name == "tcp"


@pytest.mark.parametrize("staging,shm", [("always", True), ("always", False), ("auto", True)])
def test_tcp_offers_shared_buffers_only_to_a_same_host_staged_receiver(staging, shm, thread_guard):
    config = KVTransferConfig(backend="tcp", staging=staging, staging_shm=shm)
    pool = make_pool(LAYOUT, 4, 1)
    region = region_of(pool, LAYOUT)
    send, pull = TcpSendPath(region, config), TcpPullPath(region, config)
    try:
        shared = staging == "always" and shm  # a host pool is staged only with staging="always"
        assert send.label == pull.label == ("tcp-staged" if staging == "always" else "tcp")
        hello = pull.hello()
        assert ("shm_host" in hello) == shared
        assert send.hello_ok(hello) == (({"shm_pid": os.getpid()} if shared else {}), b"")
        assert send.hello_ok({"shm_host": "another-host"}) == ({}, b"")
        assert not send.acks_done and not pull.acks_done  # streamed: ``done`` needs no ``ack``
    finally:
        send.close()
        pull.close()

