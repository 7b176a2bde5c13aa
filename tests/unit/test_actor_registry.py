"""The replay's actor bookkeeping without sockets (protocol/registry.py):
which incarnation a connection speaks for, who is refused for good, who is
declared dead, and how a reconnect moves an incarnation; and what the views
read of each actor's time (replay/fleet.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from protocol import STALL_REASONS, ErrorCode
from protocol import registry as registry_module
from protocol.registry import ActorRegistry
from protocol.transport import Liveness
from replay.fleet import Fleet
from replay.metrics import ActorSeries

#: Silent for 3 x 1 s: dead.
INTERVAL_S, LIVENESS = 1.0, 3
TOKEN, OTHER_TOKEN = b"t" * 16, b"o" * 16


def registry() -> ActorRegistry:
    return ActorRegistry(Liveness(INTERVAL_S, LIVENESS), max_actors=4)


def hello(actors: ActorRegistry, connection: bytes, actor_id: str, incarnation: int,
          token: bytes = TOKEN, capacity: int = 4):
    """A Hello the rules let through, registered."""
    assert actors.refusal(connection, actor_id, incarnation, token) is None
    return actors.register(connection, actor_id, incarnation, token, capacity)


def test_a_connection_speaks_only_after_its_incarnation_s_hello() -> None:
    actors = registry()
    code, text = actors.refusal(b"conn", "actor-9", 0, None)  # a segment, a heartbeat
    assert code is ErrorCode.UNREGISTERED and "say hello" in text
    assert hello(actors, b"conn", "actor-9", 0) == (None, None)
    assert actors.refusal(b"conn", "actor-9", 0, None) is None
    code, _ = actors.refusal(b"conn", "actor-9", 1, None)  # a newer incarnation: its hello first
    assert code is ErrorCode.UNREGISTERED


def test_a_connection_speaks_for_one_actor() -> None:
    actors = registry()
    hello(actors, b"conn", "actor-1", 1)
    for token in (None, TOKEN):
        code, text = actors.refusal(b"conn", "actor-2", 1, token)
        assert code is ErrorCode.IDENTITY and "speaks for actor-1" in text


def test_a_new_incarnation_replaces_the_old_one_on_its_connection() -> None:
    actors = registry()
    hello(actors, b"conn", "actor-1", 1)
    replaced, displaced = hello(actors, b"conn", "actor-1", 2, token=OTHER_TOKEN, capacity=2)
    assert (replaced.actor_id, replaced.incarnation, displaced) == ("actor-1", 1, None)
    assert (actors.peers[b"conn"].incarnation, actors.peers[b"conn"].capacity) == (2, 2)
    code, text = actors.refusal(b"conn", "actor-1", 1, None)
    assert code is ErrorCode.STALE_INCARNATION and "replaced by 2" in text
    assert hello(actors, b"conn", "actor-1", 2, token=OTHER_TOKEN) == (None, None)  # retried


def test_a_silent_incarnation_is_declared_dead_and_refused_until_a_newer_one_speaks() -> None:
    actors = registry()
    hello(actors, b"conn", "actor-1", 1)
    hello(actors, b"other", "actor-2", 1)
    # the clock Liveness reads is time.monotonic(): expire at a time far ahead
    actors.liveness.seen(b"other", now=10.0 ** 9)
    [(identity, peer)] = actors.expire(now=10.0 ** 9)
    assert identity == b"conn" and (peer.actor_id, peer.incarnation) == ("actor-1", 1)
    assert b"conn" not in actors.peers and actors.alive() == 1
    for token in (None, TOKEN):  # its hello with the token included: over for good
        code, _ = actors.refusal(b"conn", "actor-1", 1, token)
        assert code is ErrorCode.DEAD_INCARNATION
    assert hello(actors, b"conn", "actor-1", 2) == (None, None)  # dead before: not gone twice


def test_a_restart_on_a_new_connection_replaces_the_old_incarnation_at_once() -> None:
    actors = registry()
    hello(actors, b"first", "actor-1", 1)
    replaced, displaced = hello(actors, b"second", "actor-1", 2, token=OTHER_TOKEN)
    assert replaced is not None and replaced.incarnation == 1 and displaced is None
    assert list(actors.peers) == [b"second"]
    assert actors.alive() == 1  # the old connection is not declared dead later
    code, _ = actors.refusal(b"first", "actor-1", 1, None)
    assert code is ErrorCode.STALE_INCARNATION


def test_a_reconnect_moves_the_incarnation_only_with_its_token() -> None:
    actors = registry()
    hello(actors, b"first", "actor-1", 1, capacity=3)
    actors.peers[b"first"].active_rollouts = 2
    # a second live connection: without the token it is an impostor, with or
    # without a hello; the first connection goes on
    code, text = actors.refusal(b"second", "actor-1", 1, OTHER_TOKEN)
    assert code is ErrorCode.IDENTITY and "lacks its token" in text
    code, _ = actors.refusal(b"second", "actor-1", 1, None)
    assert code is ErrorCode.UNREGISTERED
    assert actors.refusal(b"first", "actor-1", 1, None) is None
    # the incarnation's own hello on its new connection: moved, state and all
    assert hello(actors, b"second", "actor-1", 1, capacity=3) == (None, b"first")
    assert list(actors.peers) == [b"second"] and actors.alive() == 1
    assert (actors.peers[b"second"].active_rollouts, actors.peers[b"second"].token) == (2, TOKEN)
    code, _ = actors.refusal(b"first", "actor-1", 1, None)
    assert code is ErrorCode.UNREGISTERED  # the old connection is heard no more


def test_a_new_actor_beyond_max_actors_is_refused_full_but_a_registered_one_speaks() -> None:
    actors = registry()
    for n in range(actors.max_actors):
        hello(actors, f"conn-{n}".encode(), f"actor-{n}", 1)
    code, text = actors.refusal(b"conn-new", "actor-new", 1, TOKEN)
    assert code is ErrorCode.FULL and "replay.max_actors" in text
    assert actors.refusal(b"conn-0", "actor-0", 2, TOKEN) is None  # a restart replaces
    actors.leave(b"conn-1")
    assert hello(actors, b"conn-new", "actor-new", 1) == (None, None)


def test_the_ids_of_gone_actors_are_remembered_within_a_bound(monkeypatch) -> None:
    """Beyond ``REMEMBERED_ACTORS`` ids no longer registered, those
    registered longest ago are forgotten: their old incarnations would be
    unregistered, not dead, if they spoke again."""
    monkeypatch.setattr(registry_module, "REMEMBERED_ACTORS", 32)
    actors = registry()
    for n in range(100):
        hello(actors, f"conn-{n}".encode(), f"actor-{n}", 1)
        actors.leave(f"conn-{n}".encode())
    assert len(actors.current) <= 32 and len(actors.dead) <= 32
    code, _ = actors.refusal(b"conn-99", "actor-99", 1, None)
    assert code is ErrorCode.DEAD_INCARNATION  # the newest gone are remembered
    code, _ = actors.refusal(b"conn-0", "actor-0", 1, None)
    assert code is ErrorCode.UNREGISTERED


def test_a_share_of_time_never_exceeds_one() -> None:
    """The run report's stall, a share of episode-slot time, peaked at 1.25:
    the replay counted slot time at its ticks and stall at heartbeats, so two
    scrapes 2 s apart could hold three heartbeats' stall and 1.5 s of slot
    time; and the first heartbeat of an incarnation brought what its process
    had waited before it registered here (here: 100 s, counted by a replay
    since restarted). Counted together from the first heartbeat, an actor
    whose every slot waits all the time shows a stall of its slot time
    exactly, between any two scrapes."""
    actors, series = registry(), CollectorRegistry()
    hello(actors, b"conn", "actor-1", 1, capacity=4)
    fleet, peer = Fleet(ActorSeries(series)), actors.peers[b"conn"]

    def read(name: str, **labels: str) -> float:
        return series.get_sample_value(name, {"actor": "actor-1", **labels}) or 0.0

    scrapes = []
    for quarter in range(80):  # 20 s: a heartbeat each 1 s, a tick each 0.5 s, a scrape each 1.75 s
        now = quarter / 4
        if quarter % 4 == 1:
            fleet.heartbeat(peer, {"credits": 100.0 + 4 * now, "weights": 0.0, "summary": 0.0},
                            now)
        if quarter % 2 == 0:
            fleet.tick(actors.peers.values(), {})
        if quarter % 7 == 3:
            scrapes.append((sum(read("crl_replay_actor_stall_seconds_total", reason=reason)
                                for reason in STALL_REASONS),
                            read("crl_replay_actor_slot_seconds_total")))
    for (stall_before, slot_before), (stall_now, slot_now) in zip(scrapes, scrapes[1:],
                                                                  strict=False):
        assert stall_now - stall_before <= slot_now - slot_before + 1e-9  # sums of floats
    assert scrapes[-1] == pytest.approx((4 * 18.0, 4 * 18.0))  # from 0.25 s to the last, 18.25 s
