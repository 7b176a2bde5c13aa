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
    code, text = actors.refusal(b"conn", "actor-1", 1)
    assert code is ErrorCode.STALE_INCARNATION and "replaced by 2" in text
    assert actors.refusal(b"conn", "actor-1", 2) is None
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
    code, _ = actors.refusal(b"conn", "actor-1", 1)
    assert code is ErrorCode.DEAD_INCARNATION
    assert actors.refusal(b"conn", "actor-1", 2) is None
    assert actors.admit(b"conn", "actor-1", 2) is None  # dead before: not gone twice
    assert actors.peers[b"conn"].capacity == DEFAULT_CAPACITY


def test_an_unknown_actor_is_let_through() -> None:
    assert registry().refusal(b"conn", "actor-9", 0) is None


def test_a_restart_on_a_new_connection_replaces_the_old_incarnation_at_once() -> None:
    actors = registry()
    actors.admit(b"actor-1/aaaa", "actor-1", 1)
    actors.peers[b"actor-1/aaaa"].capacity = 4
    replaced = actors.admit(b"actor-1/bbbb", "actor-1", 2)
    assert replaced is not None and replaced.incarnation == 1
    assert list(actors.peers) == [b"actor-1/bbbb"] and actors.peers[b"actor-1/bbbb"].capacity == 4
    assert actors.alive() == 1  # the old connection is not declared dead later
    code, _ = actors.refusal(b"actor-1/aaaa", "actor-1", 1)
    assert code is ErrorCode.STALE_INCARNATION


def test_a_second_connection_for_the_current_incarnation_is_refused_while_the_first_lives(
) -> None:
    actors = registry()
    actors.admit(b"actor-1/aaaa", "actor-1", 1)
    code, text = actors.refusal(b"actor-1", "actor-1", 1)  # an impostor, or another process
    assert code is ErrorCode.IDENTITY and "another connection" in text
    assert actors.refusal(b"actor-1/aaaa", "actor-1", 1) is None
    # once the first connection's incarnation is declared dead, it is over for good
    [_] = actors.expire(now=10.0 ** 9)
    assert actors.refusal(b"actor-1", "actor-1", 1)[0] is ErrorCode.DEAD_INCARNATION
