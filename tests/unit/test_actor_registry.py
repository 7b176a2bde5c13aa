"""The replay's actor bookkeeping without sockets (replay/registry.py):
which incarnation a connection speaks for, who is refused for good, and
who is declared dead."""

from __future__ import annotations

from protocol import ErrorCode
from protocol.transport import Liveness
from replay.registry import DEFAULT_CAPACITY, ActorRegistry

#: Silent for 3 x 1 s: dead.
INTERVAL_S, LIVENESS = 1.0, 3


def registry() -> ActorRegistry:
    return ActorRegistry(Liveness(INTERVAL_S, LIVENESS))


def test_a_new_incarnation_replaces_the_old_one_on_its_connection_and_keeps_its_capacity(
) -> None:
    actors = registry()
    assert actors.admit(b"conn", "actor-1", 1) is None
    actors.peers[b"conn"].capacity = 4
    replaced = actors.admit(b"conn", "actor-1", 2)
    assert replaced is not None and (replaced.actor_id, replaced.incarnation) == ("actor-1", 1)
    assert (actors.peers[b"conn"].incarnation, actors.peers[b"conn"].capacity) == (2, 4)
    code, text = actors.refusal("actor-1", 1)
    assert code is ErrorCode.STALE_INCARNATION and "replaced by 2" in text
    assert actors.refusal("actor-1", 2) is None
    assert actors.admit(b"conn", "actor-1", 2) is None  # the same one again: nothing gone


def test_a_silent_incarnation_is_declared_dead_and_refused_until_a_newer_one_speaks() -> None:
    actors = registry()
    actors.admit(b"conn", "actor-1", 1)
    actors.admit(b"other", "actor-2", 1)
    # the clock Liveness reads is time.monotonic(): expire at a time far ahead
    actors.liveness.seen(b"other", now=10.0 ** 9)
    [(identity, peer)] = actors.expire(now=10.0 ** 9)
    assert identity == b"conn" and (peer.actor_id, peer.incarnation) == ("actor-1", 1)
    assert b"conn" not in actors.peers and actors.alive() == 1
    code, _ = actors.refusal("actor-1", 1)
    assert code is ErrorCode.DEAD_INCARNATION
    assert actors.refusal("actor-1", 2) is None
    assert actors.admit(b"conn", "actor-1", 2) is None  # dead before: not gone twice
    assert actors.peers[b"conn"].capacity == DEFAULT_CAPACITY


def test_an_unknown_actor_is_let_through() -> None:
    assert registry().refusal("actor-9", 0) is None
