"""Hostile peers, second round (issue 60), against the real replay process:
what an outside client found it could do with numbers the protocol left
unchecked, with state it could make the replay hold, and with a learner
incarnation that came back. Each test is one finding, named after the
behaviour that now holds (docs/protocol.md, docs/replay.md "Memory")."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import msgspec
import pytest
import zmq

from protocol import (
    LEARNER_ID,
    Abandon,
    Error,
    ErrorCode,
    Goodbye,
    Stamp,
    decode,
    encode,
)
from protocol.messages import MAX_ID_CHARS
from protocol.synthetic import synthetic_hello, synthetic_segment
from replay.buffer import RELEASED_ID_BYTES
from tests.processes import ReplayProcess, rss_bytes, scripted_replay
from tests.protocol_clients import ActorClient, LearnerClient, dealer

#: The replay's batch size B.
BATCH = 2
#: Actors the replay registers at once, here.
MAX_ACTORS = 3


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplayProcess]:
    with scripted_replay(tmp_path_factory.mktemp("replay"), BATCH,
                         "--replay.max_actors", str(MAX_ACTORS)) as process:
        yield process


def _reply(socket: zmq.Socket) -> object:
    assert socket.poll(10_000), "no reply from the replay"
    return decode(socket.recv())


def _learner(context: zmq.Context, replay: ReplayProcess, incarnation: int) -> LearnerClient:
    return LearnerClient(context, replay.learner_address, incarnation=incarnation)


def _pushed(actor: ActorClient, rollouts: int) -> list[str]:
    pushed = [actor.push_rollout(segments=1) for _ in range(rollouts)]
    assert actor.pump_until(lambda: not actor.unacked), actor.errors
    return pushed


@pytest.fixture
def actor(replay: ReplayProcess, context: zmq.Context, request: pytest.FixtureRequest
          ) -> Iterator[ActorClient]:
    """A registered actor, which says goodbye after the test (the replay
    registers at most ``MAX_ACTORS``)."""
    client = ActorClient(context, replay.actor_address, request.node.name[-64:], capacity=8)
    client.hello()
    assert client.pump_until(lambda: client.registered)
    yield client
    client.send(Goodbye(**client.stamp.next()))


def test_two_learner_incarnations_asking_in_turn_train_each_rollout_once(
        replay: ReplayProcess, context: zmq.Context, actor: ActorClient) -> None:
    """The older incarnation (it froze and came back) is refused
    (``stale_incarnation``) once the newer one asked, and is served
    nothing: no rollout goes new -> old -> new."""
    base = replay.metric("crl_replay_finished_rollouts_total", fate="trained", success="true")
    pushed = _pushed(actor, 4)
    older, newer = _learner(context, replay, 10), _learner(context, replay, 11)
    older.request(BATCH, version=0)
    first = older.receive(10.0)
    assert first is not None
    served: list[str] = []
    for step in range(2):
        newer.request(BATCH, version=step)
        batch = newer.receive(10.0)
        assert batch is not None
        served += [r.rollout_id for r in batch.rollouts]
        older.request(BATCH, version=step + 1)
        refusal = _reply(older.socket)
        assert isinstance(refusal, Error) and refusal.code == ErrorCode.STALE_INCARNATION
    newer.request(0, version=2)  # confirms the last batch
    # the older's batch went back to the newer first, then the rest: each once
    assert sorted(served) == sorted(pushed) and len(set(served)) == len(served)
    assert actor.pump_until(lambda: replay.metric(
        "crl_replay_finished_rollouts_total", fate="trained", success="true") - base
        == len(pushed))


def test_ten_thousand_abandons_of_unknown_maximal_ids_stay_within_the_memory_bound(
        replay: ReplayProcess, actor: ActorClient) -> None:
    """Each is acknowledged and its id remembered as dropped; the replay's
    resident memory grows by at most docs/replay.md's bound per remembered
    id (``RELEASED_ID_BYTES``)."""
    count = 10_000
    before_dropped = replay.metric("crl_replay_dropped_total", reason="abandoned")
    before = rss_bytes(replay.pid)
    for n in range(count):
        rollout_id = f"abandoned-{n:08d}".ljust(MAX_ID_CHARS, "x")
        actor.send(Abandon(**actor.stamp.next(), rollout_id=rollout_id))
        if n % 500 == 499:
            actor.pump(0.01)
    assert actor.pump_until(lambda: replay.metric(
        "crl_replay_dropped_total", reason="abandoned") - before_dropped == count,
        timeout_s=60)
    grown = rss_bytes(replay.pid) - before
    print(f"MEASURED resident bytes per remembered id: {grown / count:.0f}")
    assert actor.errors == []
    assert grown <= count * RELEASED_ID_BYTES, grown / count


def test_the_version_clock_moves_one_version_per_served_batch(
        replay: ReplayProcess, context: zmq.Context, actor: ActorClient) -> None:
    """A learner incarnation's first request sets the clock (a learner
    resumed from a checkpoint); later ones move it by one once a batch was
    served, and a request beyond is refused without releasing anything."""
    learner = _learner(context, replay, 20)
    start = int(replay.metric("crl_replay_learner_version"))
    learner.request(0, version=start + 5)  # first: anywhere (a resumed learner)
    replay.wait_learner_version(start + 5)
    learner.request(0, version=start + 6)  # no batch served since: refused
    refusal = _reply(learner.socket)
    assert isinstance(refusal, Error) and refusal.code == ErrorCode.INVALID
    assert "one version per batch" in refusal.text
    _pushed_at(actor, start + 5)
    learner.request(BATCH, version=start + 5)
    assert learner.receive(10.0) is not None
    learner.request(0, version=2**63 - 1)  # one bad number would end the run's learning
    assert _reply(learner.socket).code == ErrorCode.INVALID
    learner.request(0, version=start + 6)  # the batch was trained: one version on
    replay.wait_learner_version(start + 6)


def _pushed_at(actor: ActorClient, version: int) -> None:
    for _ in range(BATCH):
        actor.push_rollout(segments=1, version=version)
    assert actor.pump_until(lambda: not actor.unacked), actor.errors


def test_a_request_larger_than_the_batch_is_refused_and_releases_nothing(
        replay: ReplayProcess, context: zmq.Context, actor: ActorClient) -> None:
    learner = _learner(context, replay, 30)
    version = int(replay.metric("crl_replay_learner_version"))
    _pushed_at(actor, version)
    asked = learner.request(BATCH, version=version)
    batch = learner.receive(10.0)
    assert batch is not None
    trained = replay.metric("crl_replay_finished_rollouts_total", fate="trained",
                            success="true")
    for size in (BATCH + 1, 2**63 - 1):
        learner.request(size, version=version)
        refusal = _reply(learner.socket)
        assert isinstance(refusal, Error) and refusal.code == ErrorCode.INVALID, refusal
    # the batch before is still the one served: its request again gets it again
    learner.socket.send(asked)
    again = learner.receive(10.0)
    assert again is not None and [r.rollout_id for r in again.rollouts] == [
        r.rollout_id for r in batch.rollouts]
    assert replay.metric("crl_replay_finished_rollouts_total", fate="trained",
                         success="true") == trained


def test_an_actor_cannot_say_hello_as_the_learner(replay: ReplayProcess,
                                                  context: zmq.Context) -> None:
    socket = dealer(context, replay.actor_address)
    socket.send(encode(synthetic_hello(Stamp(LEARNER_ID, 1))))
    refusal = _reply(socket)
    assert isinstance(refusal, Error) and refusal.code == ErrorCode.IDENTITY
    socket.close(linger=0)


def test_an_array_of_four_elements_and_a_key_held_twice_are_malformed(
        replay: ReplayProcess, actor: ActorClient) -> None:
    """Where the protocol says what a frame holds, the replay holds it to
    that: a 3-element array with a fourth, or a map with one key twice
    (another MessagePack library might read the other value), is refused."""
    hello = msgspec.to_builtins(synthetic_hello(actor.stamp, token=actor.token),
                                builtin_types=(bytes,))
    body = msgpack.packb(hello, use_bin_type=True)
    assert 0x80 <= body[0] < 0x8F  # a fixmap: one more pair, whose key repeats 'capacity'
    twice = bytes([body[0] + 1]) + body[1:] + msgpack.packb("capacity") + msgpack.packb(8)
    segment = msgspec.to_builtins(synthetic_segment(actor.stamp, "four", 0, final=True),
                                  builtin_types=(memoryview,))
    segment["tokens"].append("extra")
    for frame, says in ((twice, "'capacity' twice"), (msgpack.packb(segment), "at most length 3")):
        actor.socket.send(frame)
        refusal = _reply(actor.socket)
        assert isinstance(refusal, Error) and refusal.code == ErrorCode.MALFORMED, refusal
        assert says in refusal.text


def test_a_new_actor_beyond_max_actors_is_refused_full_and_one_leaving_makes_room(
        replay: ReplayProcess, context: zmq.Context) -> None:
    clients = [ActorClient(context, replay.actor_address, f"crowd-{n}")
               for n in range(MAX_ACTORS + 1)]
    for client in clients:
        client.hello()
    for client in clients:
        assert client.pump_until(lambda c=client: c.registered or bool(c.errors))
    registered = [c for c in clients if c.registered]
    [late] = [c for c in clients if not c.registered]
    assert [e.code for e in late.errors] == [ErrorCode.FULL]
    assert "replay.max_actors" in late.errors[0].text
    registered[0].send(Goodbye(**registered[0].stamp.next()))  # one leaves: room for one
    late.errors.clear()
    late.hello()
    assert late.pump_until(lambda: late.registered), late.errors
    for client in [*registered[1:], late]:
        client.send(Goodbye(**client.stamp.next()))
