"""A NIXL sender exposes only the blocks of a granted lease, for the lease's lifetime (real NIXL/UCX).

With ``nixl_expose="lease"`` (the default) an authenticated receiver holds no key to the pool
after the handshake: its own NIXL agent refuses to prepare any of the sender's blocks. After a
grant it can prepare those blocks and no other; when the transfer ends the sender has nothing
registered. ``"pool"`` is the control: there every block can be prepared right after the handshake.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from kv_transfer import KVLayout, TransferState, make_receiver, make_sender
from kv_transfer.nixl_agent import block_descs
from tests.kv_transfer.helpers import HAVE_NIXL
from tests.kv_transfer.peers import SMOLLM2, block_digest, config_for, make_pool

pytestmark = pytest.mark.skipif(not HAVE_NIXL, reason="nixl not installed")

KEY = b"k" * 32
LAYOUT = KVLayout(**{**SMOLLM2, "dtype": "float32"})
NUM_BLOCKS = 16


@pytest.fixture
def pair(request):
    made = []

    def make(expose: str):
        sender = make_sender(make_pool(LAYOUT, NUM_BLOCKS, 1), LAYOUT,
                             config_for("nixl", auth_key=KEY, nixl_expose=expose))
        pool = make_pool(LAYOUT, NUM_BLOCKS, 2)
        receiver = make_receiver(pool, LAYOUT, config_for("nixl", auth_key=KEY))
        receiver.pool = pool
        made.extend([receiver, sender])
        return sender, receiver

    yield make
    for side in made:
        side.close()


def _can_prepare(receiver, sender, block_ids: list[int]) -> bool:
    """Can the receiver's NIXL agent build READ descriptors of these sender blocks?"""
    (link,) = receiver._links.values()
    name, _ = link.path_state
    nixl = receiver.path_named("nixl").nixl
    info = link.hello
    descs = block_descs(int(info["base_addr"]), LAYOUT.block_nbytes, NUM_BLOCKS, 0)
    try:
        prep = nixl.prep(name, descs[np.asarray(block_ids)], "DRAM")
    except Exception:
        return False
    nixl.release_prep(prep)
    return True


def _pull(sender, receiver, tid: str, remote: list[int], local: list[int]) -> None:
    t = sender.expect(tid, remote)
    r = receiver.read(sender.peer_info(), tid, remote, local, timeout_s=30, capability=t.capability)
    assert r.wait(30) == TransferState.DONE, r.error
    assert t.wait(10) == TransferState.DONE


def test_lease_exposes_only_the_granted_blocks_while_granted(pair):
    sender, receiver = pair("lease")
    assert sender.stats()["registered_regions"] == 0  # nothing registered before a grant
    _pull(sender, receiver, "a", [3, 4, 9], [0, 1, 2])  # connects (handshake) and pulls
    src = make_pool(LAYOUT, NUM_BLOCKS, 1)
    assert block_digest(receiver.pool, LAYOUT.block_nbytes, [0, 1, 2]) == \
        block_digest(src, LAYOUT.block_nbytes, [3, 4, 9])
    assert sender.stats()["registered_regions"] == 0  # the lease's registration ended with it
    # the receiver holds keys to the blocks it was granted, never to any other
    assert _can_prepare(receiver, sender, [3, 4, 9])
    for other in ([0], [5], [10, 11], list(range(NUM_BLOCKS))):
        assert not _can_prepare(receiver, sender, other), other
    _pull(sender, receiver, "b", [10, 11], [5, 6])  # a second lease on the same connection
    assert _can_prepare(receiver, sender, [10, 11]) and not _can_prepare(receiver, sender, [12])
    assert sender.stats()["registered_regions"] == 0


def test_a_lease_that_fails_after_its_grant_deregisters(pair):
    sender, receiver = pair("lease")
    _pull(sender, receiver, "warm", [1], [1])

    def cut(*_args, **_kwargs):  # the READ fails after the grant: the receiver drops the link
        raise ConnectionError("cut")
    receiver.path_named("nixl")._read = cut
    t = sender.expect("cut", [2, 3])
    r = receiver.read(sender.peer_info(), "cut", [2, 3], [2, 3], timeout_s=10, capability=t.capability)
    assert r.wait(10) == TransferState.FAILED
    assert t.wait(10) == TransferState.FAILED  # the sender saw its connection go
    deadline = time.monotonic() + 5
    while sender.stats()["registered_regions"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.stats()["registered_regions"] == 0


def test_pool_exposure_is_the_whole_pool(pair):
    sender, receiver = pair("pool")
    _pull(sender, receiver, "a", [3], [0])
    assert sender.stats()["registered_regions"] == 1
    assert _can_prepare(receiver, sender, list(range(NUM_BLOCKS)))


def test_reused_blocks_are_read_with_fresh_keys(pair):
    sender, receiver = pair("lease")
    src = make_pool(LAYOUT, NUM_BLOCKS, 1)
    first = sender.expect("first", [3, 4])
    second = sender.expect("second", [4, 5])
    assert sender.stats()["registered_regions"] == 0  # nothing until a grant
    r = receiver.read(sender.peer_info(), "first", [3, 4], [0, 1], timeout_s=30, capability=first.capability)
    assert r.wait(30) == TransferState.DONE, r.error
    # block 4 was deregistered with "first" and registered again for "second": new keys
    r = receiver.read(sender.peer_info(), "second", [4, 5], [2, 3], timeout_s=30, capability=second.capability)
    assert r.wait(30) == TransferState.DONE, r.error
    assert receiver.stats()["nixl_lease_resets"] == 1  # block 4's keys were reloaded, not reused
    for i in range(6):  # blocks registered, deregistered and registered again: always the right bytes
        ids = [(i + k) % NUM_BLOCKS for k in range(4)]
        _pull(sender, receiver, f"again-{i}", ids, [8, 9, 10, 11])
        assert block_digest(receiver.pool, LAYOUT.block_nbytes, [8, 9, 10, 11]) == \
            block_digest(src, LAYOUT.block_nbytes, ids)
    assert sender.stats()["registered_regions"] == 0


def test_a_block_shared_by_two_live_leases_stays_registered_until_both_end():
    from kv_transfer.config import KVTransferConfig
    from kv_transfer.memory import KVRegion
    from kv_transfer.nixl_agent import NixlAgent
    from kv_transfer.nixl_lease import LeaseRegistry
    pool = make_pool(LAYOUT, NUM_BLOCKS, 1)
    agent = NixlAgent("send", KVTransferConfig(backend="nixl"))
    try:
        leases = LeaseRegistry(agent, KVRegion.from_buffer(pool, LAYOUT), "DRAM")
        first, second = leases.acquire([3, 4]), leases.acquire([4, 5])
        assert first and second and leases.num_registered == 3
        leases.release([3, 4])
        assert leases.num_registered == 2  # block 4 still serves the second lease
        assert leases.acquire([5]) and leases.num_registered == 2
        leases.release([4, 5])
        leases.release([5])
        assert leases.num_registered == 0
        leases.acquire([1, 2])
        leases.clear()
        assert leases.num_registered == 0
    finally:
        agent.close()
