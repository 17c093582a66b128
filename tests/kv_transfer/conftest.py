"""Fixtures for the kv_transfer tests."""

from __future__ import annotations

import threading

import pytest

from .helpers import Peer, socket_fds


@pytest.fixture
def peers():
    """Factory of child peers; kills leftovers at teardown."""
    made: list[Peer] = []

    def make(*args, **kwargs) -> Peer:
        p = Peer(*args, **kwargs)
        made.append(p)
        return p
    yield make
    for p in made:
        p.kill()


@pytest.fixture
def thread_guard():
    """Assert the test left no kv_transfer thread and no socket behind in this process."""
    before = {t.ident for t in threading.enumerate()}
    sockets_before = socket_fds()
    yield
    left = [t.name for t in threading.enumerate()
            if t.ident not in before and t.name.startswith("kv-") and t.is_alive()]
    assert not left, f"threads left behind: {left}"
    assert socket_fds() <= sockets_before, "sockets left open"
