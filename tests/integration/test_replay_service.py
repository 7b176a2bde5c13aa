"""The replay service on real sockets: ingest, dedup, staleness, expiry,
credits and backpressure, and a flood of malformed input."""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from learner.replay_client import ReplayClient
from protocol import (
    PROTOCOL_VERSION,
    Abandon,
    Batch,
    ErrorCode,
    Goodbye,
    Stamp,
    decode,
    encode,
)
from protocol.synthetic import synthetic_segment
from protocol.transport import TransportConfig
from replay.buffer import SEGMENT_OVERHEAD_BYTES
from replay.config import ReplayConfig
from replay.ingest import VERSION_AHEAD
from replay.service import ReplayService
from tests.fault_proxy import FaultProxy
from tests.ports import free_ports, loopback_addresses
from tests.processes import wait_until
from tests.protocol_clients import ActorClient, LearnerClient, dealer, replay_client
from tests.replay_thread import ReplayThread


@pytest.fixture
def replay(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ReplayThread]:
    actor_address, learner_address = loopback_addresses(2)
    options = dict(actor_address=actor_address, learner_address=learner_address,
                   rollouts_per_batch=2, max_staleness=1, log_path=str(tmp_path / "log"),
                   metrics_port=0, rollout_timeout_s=600.0)
    options.update(getattr(request, "param", {}))
    # scripted actors send no heartbeats: only the liveness tests get a short one
    # (a replay declares a silent actor dead and refuses it from then on)
    liveness = options.pop("heartbeat_liveness", 100)
    transport = TransportConfig(heartbeat_interval_s=0.2, heartbeat_liveness=liveness)
    running = ReplayThread(ReplayService(ReplayConfig(**options), transport, vocab_size=100))
    yield running
    running.close()


def test_metrics_are_served_with_the_design_names(replay: ReplayThread) -> None:
    import urllib.request

    from ops.metrics import MetricsServer

    server = MetricsServer(replay.service.metrics.registry, free_ports(1)[0])
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics",
                                      timeout=10).read().decode()
    finally:
        server.close()
    for name in ('crl_replay_segments_total{result="accepted"}',
                 'crl_replay_rollouts{state="pending"}', 'crl_replay_rollouts{state="ready"}',
                 'crl_replay_dropped_total{reason="stale"}',
                 'crl_replay_dropped_total{reason="expired"}',
                 'crl_replay_dropped_total{reason="full"}', "crl_replay_staleness_bucket",
                 "crl_replay_credits_outstanding"):
        assert name in text, name


def test_hello_gets_credits_and_segments_are_acknowledged(replay: ReplayThread) -> None:
    # a metrics address with no discovery file to list it in (the replay's alone)
    actor = replay.actor(capacity=3, metrics_address="127.0.0.1:9110")
    actor.hello()
    assert actor.pump_until(lambda: actor.credits == 3)
    actor.push_rollout(segments=3)
    assert actor.pump_until(lambda: not actor.unacked)
    assert len(actor.acked) == 3
    assert replay.metric("crl_replay_segments_total", result="accepted") == 3


def test_credits_in_a_lost_reply_are_repeated_after_a_heartbeat(replay: ReplayThread) -> None:
    actor = replay.actor(capacity=3)
    actor.hello()
    assert actor.socket.poll(5000)
    actor.socket.recv()  # the Welcome, lost on the way
    actor.heartbeat()
    assert actor.pump_until(lambda: actor.credits == 3)
    actor.heartbeat()  # up to date: nothing to repeat
    assert not actor.socket.poll(500)


def test_resent_segments_are_acknowledged_once_stored_once(replay: ReplayThread) -> None:
    actor = replay.actor()
    actor.hello()
    actor.push_rollout(segments=2)
    assert actor.pump_until(lambda: not actor.unacked)
    for frame in [encode(s) for s in actor.acked.values()]:
        actor.socket.send(frame)  # as if the acks were lost
    assert actor.pump_until(
        lambda: replay.metric("crl_replay_segments_total", result="duplicate") == 2)
    learner = replay.learner()
    learner.request(1, version=0)
    batch = learner.receive(2.0)
    assert batch is not None and [len(r.segments) for r in batch.rollouts] == [2]


def test_another_message_under_a_stored_seq_is_taken_for_a_resend(replay: ReplayThread) -> None:
    """docs/protocol.md, Peer rules: a seq names a message; a second one under
    it is acknowledged as a duplicate and not stored, whatever it holds."""
    actor = replay.actor()
    actor.hello()
    actor.push_rollout(segments=2)
    assert actor.pump_until(lambda: not actor.unacked)
    [first, second] = sorted(actor.acked.values(), key=lambda s: s.index)
    other = msgspec.structs.replace(second, reward=-5.0, seq=first.seq)  # first's seq, reused
    actor.socket.send(encode(other))
    assert actor.pump_until(
        lambda: replay.metric("crl_replay_segments_total", result="duplicate") == 1)
    learner = replay.learner()
    learner.request(1, version=0)
    batch = learner.receive(2.0)
    assert batch is not None and [s.reward for s in batch.rollouts[0].segments] == [None, 1.0]


def test_tokens_one_version_ahead_of_the_learner_s_request_are_taken_as_fresh(
        replay: ReplayThread) -> None:
    """The learner's request for version v can reach a restarted replay
    after the actors' first tokens of v (replay/ingest.py: VERSION_AHEAD):
    they are stored and served at staleness 0, not refused."""
    learner = replay.learner()
    learner.request(1, version=3)
    wait_until(lambda: replay.metric("crl_replay_learner_version") == 3, 15, "version 3")
    actor = replay.actor()
    actor.hello()
    actor.push_rollout(segments=2, version=3 + VERSION_AHEAD)
    assert actor.pump_until(lambda: not actor.unacked) and not actor.errors
    batch = learner.receive(10.0)
    assert batch is not None and [r.staleness for r in batch.rollouts] == [0]


def test_batches_wait_for_enough_ready_rollouts_and_carry_staleness(replay: ReplayThread) -> None:
    actor = replay.actor()
    actor.hello()
    learner = replay.learner()
    learner.request(2, version=1)
    actor.push_rollout(version=0)
    assert actor.pump_until(lambda: not actor.unacked)
    assert learner.receive(0.5) is None  # one ready, two asked
    actor.push_rollout(version=1)
    assert actor.pump_until(lambda: not actor.unacked)
    batch = learner.receive(10.0)
    assert batch is not None and len(batch.rollouts) == 2
    assert sorted(r.staleness for r in batch.rollouts) == [0, 1]
    assert (batch.staleness.min, batch.staleness.max) == (0, 1)


def test_a_batch_serves_each_segment_as_the_bytes_its_actor_sent(replay: ReplayThread) -> None:
    """The replay writes the stored frames into the batch: nothing is
    decoded and encoded again between the actor and the learner."""
    actor = replay.actor()
    actor.hello()
    sent = []
    for n in range(2):
        segment = synthetic_segment(actor.stamp, f"verbatim-{n}", 0, final=True)
        raw = msgspec.msgpack.decode(encode(segment))
        raw["a_key_of_tomorrow"], raw["reward"] = [1, 2], 1  # unknown; an int
        sent.append(msgspec.msgpack.encode(raw))
        actor.unacked[segment.seq], actor.sent[segment.seq] = sent[-1], segment
        actor.socket.send(sent[-1])
    assert actor.pump_until(lambda: not actor.unacked), actor.errors
    learner = replay.learner()
    learner.request(2, version=0)
    assert learner.socket.poll(10_000)
    frame = learner.socket.recv()
    assert all(one in frame for one in sent)
    batch = decode(frame)
    assert [r.segments[0].reward for r in batch.rollouts] == [1.0, 1.0]


def test_stale_rollouts_are_dropped_and_counted(replay: ReplayThread) -> None:
    actor = replay.actor()
    actor.hello()
    learner = replay.learner()
    actor.push_rollout(version=0)
    assert actor.pump_until(lambda: not actor.unacked)
    # a learner incarnation's first request sets the version clock anywhere:
    # max_staleness 1, so the version-0 rollout is stale
    learner.request(2, version=2)
    assert learner.receive(1.0) is None
    assert replay.metric("crl_replay_dropped_total", reason="stale") == 1
    actor.push_rollout(version=2)
    actor.push_rollout(version=2)
    assert actor.pump_until(lambda: not actor.unacked)
    assert not actor.errors
    batch = learner.receive(10.0)
    assert batch is not None and all(r.staleness == 0 for r in batch.rollouts)
    learner.request(2, version=2)  # the batch arrived: its rollouts count as trained
    assert actor.pump_until(lambda: replay.metric("crl_replay_finished_rollouts_total",
                                                  fate="trained", success="true") == 2)
    assert replay.metric("crl_replay_finished_rollouts_total", fate="stale",
                         success="true") == 1
    assert replay.metric("crl_replay_finished_rollout_tokens_total", fate="stale") > 0


@pytest.mark.parametrize("replay", [{"stale_grace": 1}], indirect=True)
def test_a_grace_serves_rollouts_one_version_past_the_bound(replay: ReplayThread) -> None:
    actor = replay.actor()
    actor.hello()
    learner = replay.learner()
    actor.push_rollout(version=0)
    actor.push_rollout(version=0)
    assert actor.pump_until(lambda: not actor.unacked)
    learner.request(2, version=2)  # max_staleness 1 plus a grace of 1: served at 2
    batch = learner.receive(10.0)
    assert batch is not None and [r.staleness for r in batch.rollouts] == [2, 2]
    assert replay.metric("crl_replay_dropped_total", reason="stale") == 0


def test_tokens_newer_than_the_learner_s_version_are_refused_from_the_first_segment(
        replay: ReplayThread) -> None:
    """Before any learner has spoken the window is [0, 0 + VERSION_AHEAD]: a
    rollout of a version further ahead is never stored. The learner asks with a
    version before it publishes it, so no real actor's tokens are newer than
    one ahead (its request may still be on the way). A refused rollout
    can never complete: it is dropped at once and its credit returned (held,
    it would starve an actor whose capacity it fills), and its later
    segments are late, not dropped again."""
    actor = replay.actor(capacity=1)
    actor.hello()
    assert actor.pump_until(lambda: actor.credits == 1)
    actor.credits -= 1
    rollout = actor.push_rollout(segments=2, version=7)
    assert actor.pump_until(lambda: not actor.unacked and actor.credits == 1)
    [error, _] = actor.errors
    assert (error.code, error.ref_seq) == (ErrorCode.INVALID, min(actor.sent))
    assert f"outside the window [0, {VERSION_AHEAD}]" in error.text
    assert replay.metric("crl_replay_dropped_total", reason="invalid") == 1
    assert actor.pump_until(lambda: replay.metric("crl_replay_credits_outstanding") == 1)
    assert rollout not in replay.service.book.buffer.pending
    actor.errors.clear()
    learner = replay.learner()
    learner.request(1, version=7)
    assert learner.receive(1.0) is None
    actor.push_rollout(segments=1, version=7)
    batch = learner.receive(10.0)
    assert batch is not None and [r.staleness for r in batch.rollouts] == [0]
    assert replay.metric("crl_replay_staleness_sum") == 0
    assert replay.metric("crl_replay_segments_total", result="rejected") == 2


def test_a_restarted_replay_holds_the_learner_s_version_window_before_it_speaks(
        tmp_path: Path) -> None:
    """The newest version the learner asked with is in the durable log
    (compaction keeps it: tests/unit/test_replay_log.py): actors that go on
    generating with it while the replay restarts are not refused, and newer
    tokens still are."""
    actor_address, learner_address = loopback_addresses(2)
    config = ReplayConfig(actor_address=actor_address, learner_address=learner_address,
                          rollouts_per_batch=1, max_staleness=1, metrics_port=0,
                          log_path=str(tmp_path / "log"))
    transport = TransportConfig(heartbeat_liveness=100)
    replay = ReplayThread(ReplayService(config, transport, vocab_size=100))
    try:
        learner = replay.learner()
        learner.request(1, version=3)
        deadline = time.monotonic() + 15.0
        while replay.metric("crl_replay_learner_version") != 3:
            assert time.monotonic() < deadline, "the replay never heard version 3"
            time.sleep(0.05)
    finally:
        replay.close()
    replay = ReplayThread(ReplayService(config, transport, vocab_size=100))
    try:
        assert replay.metric("crl_replay_learner_version") == 3
        actor = replay.actor()
        actor.hello()
        actor.push_rollout(segments=1, version=3)
        actor.push_rollout(segments=1, version=4 + VERSION_AHEAD)
        assert actor.pump_until(lambda: not actor.unacked)
        assert [e.code for e in actor.errors] == [ErrorCode.INVALID]
        assert replay.metric("crl_replay_segments_total", result="accepted") == 1
    finally:
        replay.close()


@pytest.mark.parametrize("replay", [{"max_buffer_bytes": 2**20}], indirect=True)
def test_a_rollout_dropped_at_the_memory_bound_leaves_no_ghost_and_returns_its_credit(
        replay: ReplayThread) -> None:
    """Its first segment does not fit: the rollout is dropped once. Its later
    segments, fitting or not, are late: not a rollout that could never
    complete, holding the actor's credit until it expired, nor a second drop."""
    actor = replay.actor(capacity=2)
    actor.hello()
    assert actor.pump_until(lambda: actor.credits == 2)
    actor.push_rollout(tokens=[60_000])  # ~780 KB of the 1 MiB
    assert actor.pump_until(lambda: not actor.unacked)
    actor.push_rollout(tokens=[30_000, 25_000, 1_000])  # the first two do not fit
    assert actor.pump_until(lambda: not actor.unacked)
    assert [e.code for e in actor.errors] == ["full"]
    assert replay.metric("crl_replay_dropped_total", reason="full") == 1
    # the gauges follow within a tick
    assert actor.pump_until(lambda: replay.metric("crl_replay_rollouts", state="ready") == 1)
    assert replay.metric("crl_replay_rollouts", state="pending") == 0
    # its credit is back: with fewer ready rollouts than a batch and none
    # running, the replay grants one (a ghost would keep it running)
    assert actor.pump_until(lambda: actor.credits >= 1)


def test_an_abandoned_rollout_is_dropped_once_and_its_credit_returned(replay: ReplayThread) -> None:
    """A living actor gives up two rollouts (a harness session at the
    recording endpoint): one with a segment stored, one it sent nothing of.
    Both credits come back; the resent Abandon is acknowledged, not counted
    again; a later segment of the abandoned rollout is late."""
    actor = replay.actor(capacity=2)
    actor.hello()
    assert actor.pump_until(lambda: actor.credits == 2)
    started = synthetic_segment(actor.stamp, "started", 0, final=False)
    actor.send(started)
    abandons = [Abandon(**actor.stamp.next(), rollout_id=rollout)
                for rollout in ("started", "never-sent")]
    for message in abandons + abandons[:1]:
        actor.send(message)
    assert actor.pump_until(lambda: actor.credits == 4)
    assert replay.metric("crl_replay_dropped_total", reason="abandoned") == 2
    late = synthetic_segment(actor.stamp, "started", 1, final=True)
    actor.send(late)
    assert actor.pump_until(
        lambda: replay.metric("crl_replay_segments_total", result="duplicate") == 1)
    assert actor.errors == []
    assert actor.pump_until(lambda: replay.metric("crl_replay_rollouts", state="pending") == 0)


def test_an_actor_that_says_goodbye_leaves_its_credits_to_the_others_at_once(
        replay: ReplayThread) -> None:
    """Goodbye ends the incarnation now, not after its heartbeats stop: the
    rollout it left unfinished is dropped (abandoned), the credits it held
    go to the actor that stays, and it is refused from then on."""
    leaving, staying = (replay.actor(actor_id=name, capacity=4) for name in ("leaving", "staying"))
    leaving.hello()
    assert leaving.pump_until(lambda: leaving.credits == 4)  # the whole window: (S + 1) * B
    staying.hello()
    assert staying.pump_until(lambda: staying.registered)
    assert staying.credits == 0
    leaving.send_kept(synthetic_segment(leaving.stamp, "unfinished", 0, final=False))
    assert leaving.pump_until(lambda: not leaving.unacked and leaving.acked)
    leaving.send(Goodbye(**leaving.stamp.next()))
    staying.heartbeat()  # its next message is answered with the freed credits
    assert staying.pump_until(lambda: staying.credits == 4)
    assert replay.metric("crl_replay_dropped_total", reason="abandoned") == 1
    assert staying.pump_until(lambda: replay.metric("crl_replay_rollouts", state="pending") == 0)
    leaving.heartbeat()
    assert leaving.pump_until(lambda: leaving.errors)
    assert leaving.errors[0].code == ErrorCode.DEAD_INCARNATION


@pytest.mark.parametrize("rollout_id", ["", "r" * 257], ids=["empty", "257-characters"])
def test_an_abandon_of_an_id_no_rollout_can_have_is_refused(replay: ReplayThread,
                                                            rollout_id: str) -> None:
    """Abandon's id is a rollout's (1 to 256 characters): another is refused,
    and neither remembered nor paid back with a credit."""
    actor = replay.actor(capacity=2)
    actor.hello()
    assert actor.pump_until(lambda: actor.credits == 2)
    actor.send(Abandon(**actor.stamp.next(), rollout_id=rollout_id))
    assert actor.pump_until(lambda: actor.errors)
    assert actor.errors[0].code == ErrorCode.INVALID and actor.credits == 2
    assert replay.metric("crl_replay_rejected_messages_total", reason="invalid") == 1


@pytest.mark.parametrize("replay", [{"heartbeat_liveness": 3}], indirect=True)
def test_rollouts_of_a_silent_actor_expire_and_are_never_served(replay: ReplayThread) -> None:
    actor = replay.actor()
    actor.hello()
    actor.push_rollout(segments=1)  # complete
    stamp_rollout = synthetic_segment(actor.stamp, "unfinished", 0, final=False)
    actor.send(stamp_rollout)
    # no heartbeats: declared dead after 3 x 0.2 s, its unfinished rollout expires
    assert actor.pump_until(
        lambda: replay.metric("crl_replay_dropped_total", reason="expired") == 1)
    learner = replay.learner()
    learner.request(2, version=0)
    assert learner.receive(1.0) is None  # the complete one is ready, the other never comes


def test_a_new_incarnation_rejects_the_old_ones_late_segments(replay: ReplayThread) -> None:
    old = replay.actor(actor_id="actor-r", incarnation=1)
    old.hello()
    assert old.pump_until(lambda: old.credits > 0)
    old.close()
    new = replay.actor(actor_id="actor-r", incarnation=2)
    new.hello()
    assert new.pump_until(lambda: new.credits > 0)
    new.close()
    late = replay.actor(actor_id="actor-r", incarnation=1)
    late.push_rollout(segments=1)
    assert late.pump_until(lambda: late.errors)
    assert [e.code for e in late.errors] == ["stale_incarnation"]
    assert replay.metric("crl_replay_segments_total", result="accepted") == 0


@pytest.mark.parametrize("replay", [{"heartbeat_liveness": 3}], indirect=True)
def test_a_frozen_incarnation_declared_dead_is_refused_until_it_comes_back_new(
        replay: ReplayThread) -> None:
    frozen = replay.actor(actor_id="actor-f", incarnation=1)
    frozen.hello()
    assert frozen.pump_until(lambda: frozen.credits > 0)
    first = synthetic_segment(frozen.stamp, "in-flight", 0, final=False)
    frozen.unacked[first.seq] = encode(first)
    frozen.sent[first.seq] = first
    frozen.send(first)
    assert frozen.pump_until(lambda: not frozen.unacked)
    # silent past the liveness (3 x 0.2 s): declared dead, its rollout expires
    assert frozen.pump_until(
        lambda: replay.metric("crl_replay_dropped_total", reason="expired") == 1)
    # resumed (SIGCONT): its heartbeat and its rollout's last segment are refused
    frozen.heartbeat()
    frozen.send(synthetic_segment(frozen.stamp, "in-flight", 1, final=True))
    assert frozen.pump_until(lambda: len(frozen.errors) == 2)
    assert {e.code for e in frozen.errors} == {ErrorCode.DEAD_INCARNATION}
    assert replay.metric("crl_replay_segments_total", result="rejected") == 1
    assert replay.metric("crl_replay_rejected_messages_total",
                         reason=ErrorCode.DEAD_INCARNATION) == 2
    # the same process as a new incarnation is welcome, and its rollouts count
    reborn = replay.actor(actor_id="actor-f", incarnation=2)
    reborn.hello()
    assert reborn.pump_until(lambda: reborn.credits > 0)
    reborn.push_rollout(segments=2)
    assert reborn.pump_until(lambda: not reborn.unacked)
    learner = replay.learner()
    learner.request(1, version=0)
    batch = learner.receive(5.0)
    assert batch is not None
    assert [r.segments[0].incarnation for r in batch.rollouts] == [2]
    assert replay.metric("crl_replay_dropped_total", reason="expired") == 1  # not twice


def test_a_restarted_actor_s_lost_rollouts_are_counted_once(replay: ReplayThread) -> None:
    """Restarted before its old incarnation fell silent: the old one's rollouts
    in flight expire at the new one's first message, the pending one and the
    ones it had sent nothing of alike, each exactly once."""
    old = replay.actor(actor_id="actor-k", incarnation=1, capacity=4)
    old.hello()
    assert old.pump_until(lambda: old.credits == 4)
    old.push_rollout(segments=1)  # finished: not lost
    old.send(synthetic_segment(old.stamp, "actor-k-1-pending", 0, final=False))
    old.heartbeat(active_rollouts=3)  # the pending one and two that sent nothing yet
    assert old.pump_until(lambda: not old.unacked and replay.metric(
        "crl_replay_segments_total", result="accepted") == 2)
    old.close()  # SIGKILLed
    new = replay.actor(actor_id="actor-k", incarnation=2, capacity=4)
    new.hello()
    assert new.pump_until(lambda: new.credits > 0)
    new.heartbeat()
    new.pump(0.5)
    assert replay.metric("crl_replay_dropped_total", reason="expired") == 3


@pytest.mark.parametrize("replay", [{"heartbeat_liveness": 3}], indirect=True)
def test_a_dead_actor_s_lost_rollouts_are_counted_once_when_it_comes_back(
        replay: ReplayThread) -> None:
    """Declared dead by the liveness first, then restarted: counted at the
    death, not again when the new incarnation registers."""
    old = replay.actor(actor_id="actor-d", incarnation=1, capacity=4)
    old.hello()
    assert old.pump_until(lambda: old.credits == 4)
    old.heartbeat(active_rollouts=2)  # two episodes, nothing sent yet
    assert old.pump_until(
        lambda: replay.metric("crl_replay_dropped_total", reason="expired") == 2)
    old.close()
    new = replay.actor(actor_id="actor-d", incarnation=2, capacity=4)
    new.hello()
    assert new.pump_until(lambda: new.credits > 0)
    new.pump(1.0)  # it falls silent too, with nothing in flight
    assert replay.metric("crl_replay_dropped_total", reason="expired") == 2


def test_a_batch_lost_with_the_learner_s_connection_is_served_again(replay: ReplayThread) -> None:
    """The connection drops with a Batch on its way: the learner asks again
    with the same request and gets the same batch; asking twice never gets a
    second batch (at most the same one again); its next request acknowledges
    the first."""
    proxy = FaultProxy(int(replay.service.config.learner_address.rsplit(":", 1)[1]))
    try:
        actor = replay.actor()
        actor.hello()
        learner = LearnerClient(replay.context, proxy.address)
        first = actor.push_rollout(segments=1)
        request = learner.request(2, version=0)  # parked: one rollout is ready
        assert actor.pump_until(lambda: not actor.unacked)
        with proxy.partition():  # the batch is held, then lost with the connection
            second = actor.push_rollout(segments=1)
            assert actor.pump_until(lambda: replay.metric("crl_replay_batches_total") == 1)
        learner.socket.send(request)  # reconnected: asks again
        batch = learner.receive(15.0)
        assert batch is not None
        assert sorted(r.rollout_id for r in batch.rollouts) == sorted([first, second])
        assert replay.metric("crl_replay_batches_resent_total") == 1
        assert learner.receive(0.5) is None
        # the next request, sent twice (as after a reconnect), gets one batch
        request = learner.request(2, version=1)
        learner.socket.send(request)
        third, fourth = actor.push_rollout(segments=1), actor.push_rollout(segments=1)
        assert actor.pump_until(lambda: not actor.unacked)
        batch = learner.receive(15.0)
        assert batch is not None
        assert sorted(r.rollout_id for r in batch.rollouts) == sorted([third, fourth])
        # The copy of the request may arrive after the batch was served (the
        # replay reads its two sockets in turns): then it is answered with the
        # same frame, as a reconnect's is (docs/protocol.md), never another
        # batch. When is unbounded on a loaded machine, so the test asks for
        # the next batch (at version 1 still: the rollouts are at 0, and
        # max_staleness is 1): the replay reads the learner's frames in order
        # and answers them in order, so every copy comes before that batch.
        learner.request(2, version=1)
        fifth, sixth = actor.push_rollout(segments=1), actor.push_rollout(segments=1)
        assert actor.pump_until(lambda: not actor.unacked)
        copies = 0
        while (frame := learner.receive(15.0)) is not None and frame.seq == batch.seq:
            assert [r.rollout_id for r in frame.rollouts] == [r.rollout_id for r in batch.rollouts]
            copies += 1
        assert frame is not None
        assert sorted(r.rollout_id for r in frame.rollouts) == sorted([fifth, sixth])
        assert copies <= 1
        assert replay.metric("crl_replay_batches_total") == 3
        assert replay.metric("crl_replay_batches_resent_total") == 1 + copies
    finally:
        proxy.close()



def taken_rollouts(link: ReplayClient, version: int) -> list[str]:
    """The rollout ids of the next batch the learner's link takes (within
    60 s), the same in the frame the other ranks are broadcast as in the
    batch rank 0 trains."""
    deadline = time.monotonic() + 60.0
    batch = link.next_batch(2, version, lambda: time.monotonic() > deadline)
    assert batch is not None, f"no batch for version {version} within 60 s"
    broadcast = decode(batch.frame)
    assert isinstance(broadcast, Batch)
    rollouts = sorted(r.rollout_id for r in batch.batch.rollouts)
    assert sorted(r.rollout_id for r in broadcast.rollouts) == rollouts
    return rollouts

def test_the_learner_s_link_takes_each_batch_once_across_connection_drops(
        replay: ReplayThread, tmp_path: Path) -> None:
    """Rank 0's link to the replay, through a proxy that cuts it: a batch lost
    on the way arrives when the link asks again on reconnecting; a batch that
    did arrive before the drop is taken once, its resend dropped and counted."""
    proxy = FaultProxy(int(replay.service.config.learner_address.rsplit(":", 1)[1]))
    link, metrics = replay_client(proxy.address)
    actor = replay.actor(capacity=8)
    taken: list[list[str]] = []

    def take(version: int) -> None:
        taken.append(taken_rollouts(link, version))

    try:
        assert link.hello().rollouts_per_batch == 2
        actor.hello()
        pushed = [actor.push_rollout(segments=1)]
        link.request(2, 0)
        assert actor.pump_until(lambda: len(replay.service.serving.batches.parked) == 1)
        with proxy.partition():  # the batch is held, then lost with the connection
            pushed.append(actor.push_rollout(segments=1))
            assert actor.pump_until(lambda: replay.metric("crl_replay_batches_total") == 1)
        take(0)  # asks again once reconnected
        assert replay.metric("crl_replay_batches_resent_total") == 1
        # the next batch arrives, then the connection drops before it is read
        pushed += [actor.push_rollout(segments=1), actor.push_rollout(segments=1)]
        link.request(2, 1)
        assert actor.pump_until(lambda: replay.metric("crl_replay_batches_total") == 2)
        assert link.socket.poll(10_000, zmq.POLLIN)
        proxy.drop()
        actor.pump(1.0)  # reconnected meanwhile
        take(1)  # asks again: the replay resends the batch it has just read
        # generated with version 1 (the replay hears of version 2 only in the
        # next request, and refuses tokens newer than the learner it knows)
        pushed += [actor.push_rollout(segments=1, version=1),
                   actor.push_rollout(segments=1, version=1)]
        take(2)  # drops the resend, takes the new batch
        assert actor.pump_until(lambda: not actor.unacked)
        assert taken == [sorted(pushed[0:2]), sorted(pushed[2:4]), sorted(pushed[4:6])]
        assert replay.metric("crl_replay_batches_resent_total") == 2
        assert metrics.registry.get_sample_value("crl_learner_duplicate_batches_total") == 1
    finally:
        link.close()
        proxy.close()


def test_the_log_is_compacted_once_served_rollouts_dominate(replay: ReplayThread) -> None:
    replay.service.book.compact_min_bytes = 0
    actor = replay.actor()
    actor.hello()
    for _ in range(6):
        actor.push_rollout(tokens=2048)
    assert actor.pump_until(lambda: not actor.unacked)
    log_path = Path(replay.service.config.log_path)
    before = log_path.stat().st_size
    learner = replay.learner()
    for _ in range(3):  # a batch is released once the next request shows it arrived
        learner.request(2, version=0)
        assert learner.receive(2.0) is not None
    actor.push_rollout(tokens=64)
    actor.push_rollout(tokens=64)
    # the log keeps the third batch (not confirmed yet) and the new rollouts
    assert actor.pump_until(lambda: log_path.stat().st_size < before / 2)
    learner.request(2, version=0)
    batch = learner.receive(2.0)
    assert batch is not None and len(batch.rollouts) == 2


@pytest.mark.parametrize("replay", [{"max_buffer_bytes": 2 * 1024 * 1024}], indirect=True)
def test_backpressure_when_the_learner_stops(replay: ReplayThread) -> None:
    actor = replay.actor(capacity=64)
    actor.hello()
    started = 0

    def start_what_credits_allow() -> int:
        nonlocal started
        while actor.credits > 0:  # the actor starts rollouts only with credits
            actor.credits -= 1
            actor.push_rollout(segments=2, tokens=4096)
            started += 1
        actor.heartbeat()
        return started

    # (S + 1) * B = 4 rollouts may be accepted without a learner step ...
    assert actor.pump_until(lambda: start_what_credits_allow() >= 4 and not actor.unacked)
    for _ in range(10):  # ... and no more, however long the actor asks
        start_what_credits_allow()
        actor.pump(0.1)
    assert started == 4
    assert replay.service.book.buffer.nbytes <= 2 * 1024 * 1024
    learner = replay.learner()
    learner.request(2, version=0)
    assert learner.receive(10.0) is not None
    actor.heartbeat()
    actor.pump(0.3)
    assert actor.credits == 0  # the learner trains on the batch: no place is free yet
    learner.request(2, version=1)  # that step is done
    # the replay sends the two freed places at once, without waiting for a heartbeat
    assert actor.pump_until(lambda: actor.credits == 2)


def _learner_step(replay: ReplayThread, learner: LearnerClient, step: int,
                  actors: list[ActorClient]) -> Batch:
    """One learner step of a learner-bound run: ask for a batch of version
    ``step``; meanwhile every actor starts a rollout (one segment) the moment
    it holds a credit."""
    learner.request(replay.config.rollouts_per_batch, version=step)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        for actor in actors:
            actor.pump(0.02)
            while actor.credits > 0:
                actor.credits -= 1
                actor.push_rollout(segments=1, version=actor.policy_version)
        if (batch := learner.receive(0.02)) is not None:
            return batch
    raise AssertionError(f"step {step}: no batch within 10 s")


@pytest.mark.parametrize("first", ["early", "late"])
def test_an_actor_that_joins_a_learner_bound_run_gets_its_share_of_the_work(
        replay: ReplayThread, first: str) -> None:
    """The learner is the bottleneck: both actors start a rollout the moment
    a credit arrives, so every credit a learner step frees is contended. The
    actor that registered second still gets half of them (equal capacities),
    whichever of the two it is."""
    actors = {name: replay.actor(actor_id=name, capacity=4) for name in ("early", "late")}
    order = [first, "late" if first == "early" else "early"]
    actors[order[0]].hello()
    learner = replay.learner()
    trained = {"early": 0, "late": 0}
    for step in range(12):
        if step == 2:  # the second actor joins a run already going
            actors[order[1]].hello()
        batch = _learner_step(replay, learner, step,
                              [actors[name] for name in order[:1 if step < 2 else 2]])
        if step >= 4:  # from two steps after the join
            for rollout in batch.rollouts:
                trained[rollout.segments[0].sender_id] += 1
    assert trained[order[1]] >= 0.3 * sum(trained.values()), trained
    for actor in actors.values():
        actor.close()
    learner.close()


def test_the_replay_counts_every_actor_and_lists_it_for_prometheus(tmp_path: Path) -> None:
    """Whoever started them, every registered actor has its series (its
    trained rollouts summing to the run's, stall from its heartbeats after
    the first) and its metrics address in Prometheus's discovery file until
    it leaves."""
    targets = tmp_path / "prometheus" / "actor-targets.json"
    with contextlib.closing(ReplayThread.on_loopback(
            rollouts_per_batch=2, max_staleness=1, durable_log=False,
            actor_targets_path=str(targets))) as replay:
        actors = [replay.actor(actor_id=f"actor-{i}", capacity=2,
                               metrics_address=f"127.0.0.1:{9301 + i}") for i in range(2)]
        for actor in actors:
            actor.hello()
        assert actors[0].pump_until(lambda: len(json.loads(targets.read_text())) == 2)
        learner = replay.learner()
        served = [_learner_step(replay, learner, step, actors) for step in range(6)]
        learner.request(0, version=6)  # confirms the last batch: it was trained
        # the first heartbeat is where its counts start: what it waited
        # before is no slot time of this replay's
        actors[0].heartbeat(stall_seconds={"credits": 1.0})
        actors[0].heartbeat(stall_seconds={"credits": 3.5, "made-up": 1e9})
        actors[0].heartbeat(stall_seconds={"credits": 2.0})  # lower: no increase
        by_actor = "crl_replay_actor_rollouts_total"
        assert actors[0].pump_until(lambda: sum(
            replay.metric(by_actor, actor=a.stamp.sender_id, fate="trained")
            for a in actors) == 12)
        trained = sum(len(batch.rollouts) for batch in served)
        assert trained == 12 == sum(replay.metric("crl_replay_finished_rollouts_total",
                                                  fate="trained", success=success)
                                    for success in ("true", "false"))
        # The heartbeats may still be on their way when the count is reached.
        assert actors[0].pump_until(lambda: replay.metric(
            "crl_replay_actor_stall_seconds_total", actor="actor-0", reason="credits") == 2.5)
        assert replay.metric("crl_replay_actor_stall_seconds_total", actor="actor-0",
                             reason="made-up") == 0
        actors[1].send(Goodbye(**actors[1].stamp.next()))
        assert actors[0].pump_until(
            lambda: [entry["labels"]["actor"] for entry in json.loads(targets.read_text())]
            == ["actor-0"])
        assert replay.metric("crl_replay_actor_registered", actor="actor-1") == 0
        assert replay.metric("crl_replay_actor_registered", actor="actor-0") == 1
        for client in (*actors, learner):
            client.close()


def test_malformed_flood_is_rejected_and_counted_while_others_are_served(replay: ReplayThread
                                                                        ) -> None:
    rng = random.Random(7)
    hostile = dealer(replay.context, replay.service.config.actor_address)
    valid = encode(synthetic_segment(ActorClient(replay.context, "inproc://unused").stamp, "r", 0,
                                True))
    plain = msgspec.msgpack.decode(valid)
    frames = [rng.randbytes(rng.randint(0, 300)) for _ in range(300)]
    frames += [valid[: rng.randint(1, len(valid) - 1)] for _ in range(100)]
    frames += [msgspec.msgpack.encode({**plain, "protocol_version": PROTOCOL_VERSION + 9})] * 50
    frames += [msgspec.msgpack.encode({**plain, "logprobs": ["float32", [3], b"\0" * 12]})] * 50
    frames += [b"\xc6\x40\x00\x00\x00" + b"\0" * 16] * 50  # bin claiming 1 GiB
    frames += [msgspec.msgpack.encode({**plain, "sender_id": "hostile",
                                       "tokens": ["int32", [64], b"\xff" * 256]})] * 50
    for frame in frames:
        hostile.send(frame)
    actor = replay.actor()
    actor.hello()
    actor.push_rollout()
    assert actor.pump_until(lambda: not actor.unacked)
    assert not actor.errors
    replies = 0
    deadline = time.monotonic() + 15
    while replies < len(frames) and time.monotonic() < deadline:
        if hostile.poll(100, zmq.POLLIN):
            hostile.recv()
            replies += 1
    rejected = sum(replay.metric("crl_replay_rejected_messages_total", reason=r) for r in (
        "malformed", "protocol_version", "array", "length_mismatch", "invalid", "unregistered",
        "unknown_kind", "oversized"))
    assert rejected == len(frames) == replies
    assert replay.metric("crl_replay_segments_total", result="accepted") == 3
    # nothing of the flood is held: the buffer holds the good rollout only
    good = sum(len(encode(s)) + SEGMENT_OVERHEAD_BYTES for s in actor.acked.values())
    assert replay.service.book.buffer.nbytes == good
    hostile.close(linger=0)


def test_segments_the_log_cannot_recover_are_skipped_and_counted(tmp_path: Path) -> None:
    """A log written by another protocol version, or holding token ids beyond
    this model's vocabulary, does not stop the replay: it recovers the rest."""
    from replay.log import DurableLog

    path = tmp_path / "log"
    written = DurableLog(path)
    stamp = Stamp("actor-old", 1)
    written.append_segment(encode(synthetic_segment(stamp, "r-0", 0, final=True, tokens=64)))
    older = msgspec.msgpack.decode(encode(synthetic_segment(stamp, "r-1", 0, final=True)))
    written.append_segment(msgspec.msgpack.encode({**older, "protocol_version":
                                                   PROTOCOL_VERSION - 1}))
    written.append_segment(encode(synthetic_segment(stamp, "r-2", 0, final=True, tokens=100)))
    written.sync(force=True)
    written.close()
    actor_address, learner_address = loopback_addresses(2)
    service = ReplayService(ReplayConfig(actor_address=actor_address,
                                         learner_address=learner_address,
                                         log_path=str(path), metrics_port=0),
                            TransportConfig(), vocab_size=64)  # r-2 has ids up to 99
    try:
        registry = service.metrics.registry
        assert registry.get_sample_value("crl_replay_recovered_segments_total") == 1
        assert registry.get_sample_value("crl_replay_unrecoverable_segments_total") == 2
        assert list(service.book.buffer.ready) == ["r-0"]
    finally:
        service.close()


def _served_again_setup(tmp_path: Path) -> tuple[ReplayConfig, TransportConfig]:
    actor_address, learner_address = loopback_addresses(2)
    return (ReplayConfig(actor_address=actor_address, learner_address=learner_address,
                         rollouts_per_batch=2, max_staleness=4, log_path=str(tmp_path / "log"),
                         metrics_port=0),
            TransportConfig(heartbeat_interval_s=0.2, heartbeat_liveness=100))


def test_a_batch_taken_before_the_replay_died_is_trained_once(tmp_path: Path) -> None:
    """The replay releases a batch in its log only when the learner's next
    request shows it arrived; killed before, it serves those rollouts again,
    and the learner's link drops them: nothing lost, nothing trained twice."""
    config, transport = _served_again_setup(tmp_path)
    link, metrics = replay_client(config.learner_address)
    replay = ReplayThread(ReplayService(config, transport, vocab_size=100))
    taken: list[list[str]] = []

    def take(version: int) -> None:
        taken.append(taken_rollouts(link, version))

    try:
        link.hello()
        actor = replay.actor(capacity=8)
        actor.hello()
        pushed = [actor.push_rollout(segments=1) for _ in range(4)]
        assert actor.pump_until(lambda: not actor.unacked)
        take(0)  # the learner trains on it: the replay is killed before it asks again
        replay.close()
        replay = ReplayThread(ReplayService(config, transport, vocab_size=100))
        assert replay.metric("crl_replay_recovered_segments_total") == 4
        take(1)  # served the first two again, dropped; then the next two
        assert taken == [sorted(pushed[:2]), sorted(pushed[2:])]
        assert metrics.registry.get_sample_value("crl_learner_duplicate_rollouts_total") == 2
    finally:
        link.close()
        replay.close()


def test_a_new_learner_incarnation_gets_the_batch_its_predecessor_died_with(
        tmp_path: Path) -> None:
    """A learner killed with a batch (trained after its last checkpoint, or
    not received) is resumed as a new incarnation: its first request gets
    those rollouts again, not the next ones."""
    config, transport = _served_again_setup(tmp_path)
    replay = ReplayThread(ReplayService(config, transport, vocab_size=100))
    try:
        actor = replay.actor(capacity=8)
        actor.hello()
        pushed = [actor.push_rollout(segments=1) for _ in range(4)]
        assert actor.pump_until(lambda: not actor.unacked)
        first = replay.learner()
        first.request(2, version=0)
        batch = first.receive(5.0)
        assert batch is not None
        died_with = sorted(r.rollout_id for r in batch.rollouts)
        resumed = replay.learner(incarnation=2)
        resumed.request(2, version=0)
        batch = resumed.receive(5.0)
        assert batch is not None and sorted(r.rollout_id for r in batch.rollouts) == died_with
        assert died_with == sorted(pushed[:2])
        assert replay.metric("crl_replay_batches_returned_total") == 1
        resumed.request(2, version=0)  # the same incarnation: that batch arrived
        batch = resumed.receive(5.0)
        assert batch is not None
        assert sorted(r.rollout_id for r in batch.rollouts) == sorted(pushed[2:])
    finally:
        replay.close()
