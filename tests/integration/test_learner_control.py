"""The learner's control socket on real ZeroMQ sockets: registration,
announcements to the live members, and hostile input rejected with an Error
and a counter while registered actors are still served."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from learner.control import ControlPlane
from learner.metrics import LearnerMetrics
from protocol import (
    NO_COMPLETE_VERSION,
    Error,
    Goodbye,
    GroupInfo,
    Heartbeat,
    Hello,
    MemberWelcome,
    WeightsAnnounce,
    WeightsLoaded,
)
from protocol.transport import TransportConfig
from tests.ports import loopback_addresses
from tests.processes import wait_until
from tests.protocol_clients import CONTROL_ENGINE, CONTROL_MANIFEST, ControlClient, control_plane


@pytest.fixture
def control() -> Iterator[tuple[ControlPlane, LearnerMetrics, str]]:
    with control_plane() as plane:
        yield plane


def _rejected(metrics: LearnerMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("crl_learner_rejected_frames_total",
                                             {"reason": reason}) or 0.0


def test_members_register_get_announcements_and_report_loads(control) -> None:
    plane, metrics, address = control
    context = zmq.Context()
    try:
        actor = ControlClient(context, address, "actor-1")
        plane.version = 5
        actor.send(Hello, engine=CONTROL_ENGINE, capacity=2, policy_version=0)
        welcome = actor.receive()
        assert isinstance(welcome, MemberWelcome) and welcome.policy_version == 5
        [member] = plane.members()
        assert plane.table.publication_wanted(5)  # 5 versions behind: it cannot contribute
        plane.announce(5, [(member, CONTROL_MANIFEST, GroupInfo(
            generation=1, master_addr="h", master_port=1, world_size=2, rank=1,
            backend="gloo"))])
        announce = actor.receive()
        assert isinstance(announce, WeightsAnnounce) and announce.group.rank == 1
        actor.send(WeightsLoaded, version=5, seconds=0.25)
        wait_until(lambda: plane.members()[0].version == 5, 5, "the member at version 5",
                   poll_s=0.05)
        assert not plane.table.publication_wanted(5)
        # silent for longer than the liveness: no longer a member
        wait_until(lambda: not plane.members(), 5, "the silent member's expiry", poll_s=0.1)
        assert metrics.registry.get_sample_value("crl_learner_weight_members") == 0
    finally:
        context.destroy(linger=0)


def test_hostile_frames_get_an_error_and_a_counter(control) -> None:
    plane, metrics, address = control
    context = zmq.Context()
    try:
        hostile = ControlClient(context, address, "hostile")
        hostile.socket.send(b"\xff\x00 not msgpack")
        assert isinstance(hostile.receive(), Error)
        assert _rejected(metrics, "malformed") == 1
        header = hostile.stamp.next()
        wrong_version = msgspec.msgpack.encode({
            "kind": "heartbeat", "protocol_version": 999, **header,
            "active_rollouts": 0, "stall_seconds": {}})
        hostile.socket.send(wrong_version)
        assert isinstance(hostile.receive(), Error)
        assert _rejected(metrics, "protocol_version") == 1
        # a valid message from an actor that never said Hello
        hostile.send(Heartbeat, active_rollouts=0, stall_seconds={}, credit_ledger=0,
                     credits_seen=0)
        reply = hostile.receive()
        assert isinstance(reply, Error) and reply.code == "unregistered"
        # a member's incarnation claimed on another connection without its token
        actor = ControlClient(context, address, "actor-1", incarnation=1)
        actor.send(Hello, engine=CONTROL_ENGINE, capacity=1)
        assert isinstance(actor.receive(), MemberWelcome)
        impostor = ControlClient(context, address, "actor-1", incarnation=1)
        impostor.send(Hello, engine=CONTROL_ENGINE, capacity=1)
        assert impostor.receive().code == "identity"
        assert _rejected(metrics, "identity") == 1
        # and the member is still served on its own connection
        [member] = plane.members()
        actor.send(Hello, engine=CONTROL_ENGINE, capacity=1)
        assert isinstance(actor.receive(), MemberWelcome)
        assert plane.members()[0].identity == member.identity
    finally:
        context.destroy(linger=0)


def test_the_newest_announced_version_outlives_the_learner(tmp_path) -> None:
    """A restarted learner reads the newest version its predecessor announced,
    and starts above it when its checkpoint is older (versions never repeat)."""
    from learner.peers import starting_version

    record = tmp_path / "checkpoints" / "announced.json"
    [address] = loopback_addresses(1)

    def plane() -> ControlPlane:
        return ControlPlane(address, TransportConfig(), run_id="r", max_staleness=2,
                            late_joiner="immediate", metrics=LearnerMetrics(),
                            announced_record=record)

    first = plane()
    try:
        assert first.announced == 0
        for version in (3, 7, 5):
            first.announce(version, [])
        assert first.announced == 7
    finally:
        first.close()
    restarted = plane()
    try:
        assert restarted.announced == 7
    finally:
        restarted.close()
    assert starting_version(restored=4, announced=7, replay_version=6) == 8
    assert starting_version(restored=4, announced=4, replay_version=5) == 6
    assert starting_version(restored=7, announced=7, replay_version=7) == 7
    assert starting_version(restored=0, announced=0, replay_version=0) == 0


def test_a_member_s_hello_again_keeps_it_and_a_broken_load_asks_for_weights(control) -> None:
    """A Hello repeated by the same incarnation (retried, or after the learner
    dropped it) is the same member: what a lane formed before learns reaches
    it, and a late report of an older version does not undo a delivery. A
    publication that failed midway, or an actor that says its load failed
    (NO_COMPLETE_VERSION), makes a publication wanted at once, and only a
    delivery satisfies it."""
    plane, _, address = control
    context = zmq.Context()
    try:
        actor = ControlClient(context, address, "actor-1")
        plane.version = 5
        actor.send(Hello, engine=CONTROL_ENGINE, capacity=1, policy_version=4)
        assert isinstance(actor.receive(), MemberWelcome)
        [in_lane] = plane.members()  # what a lane holds
        actor.send(Hello, engine=CONTROL_ENGINE, capacity=1, policy_version=3)  # a late retry
        assert isinstance(actor.receive(), MemberWelcome)
        plane.table.delivered([in_lane], 5)
        assert [m.version for m in plane.members()] == [5]

        plane.table.broken([in_lane])
        # a suspect until it speaks: a publication neither waits for it nor is wanted for it
        assert not plane.members() and not plane.table.publication_wanted(5)
        actor.send(Heartbeat, active_rollouts=0, stall_seconds={}, credit_ledger=0,
                   credits_seen=0)
        wait_until(lambda: plane.members(), 5.0, "the member heard again", poll_s=0.02)
        assert plane.members()[0].version == NO_COMPLETE_VERSION
        assert plane.table.publication_wanted(5)
        plane.table.delivered([in_lane], 5)
        assert not plane.table.publication_wanted(5)

        actor.send(Hello, engine=CONTROL_ENGINE, capacity=1, policy_version=NO_COMPLETE_VERSION)
        assert isinstance(actor.receive(), MemberWelcome)
        assert plane.table.publication_wanted(5)
        plane.table.delivered([in_lane], 5)
        assert not plane.table.publication_wanted(5)

        # dropped (silent), then back as the same incarnation: the lane's
        # Member still names it
        wait_until(lambda: not plane.members(), 5.0, "drop of the silent member", poll_s=0.05)
        actor.send(Hello, engine=CONTROL_ENGINE, capacity=1, policy_version=4)
        assert isinstance(actor.receive(), MemberWelcome)
        [member] = plane.members()
        assert member is not in_lane
        plane.table.broken([in_lane])
        actor.send(Heartbeat, active_rollouts=0, stall_seconds={}, credit_ledger=0,
                   credits_seen=0)
        wait_until(lambda: plane.table.publication_wanted(5), 5.0, "the member heard again",
                   poll_s=0.02)
        plane.table.delivered([in_lane], 5)
        assert member.version == 5 and not plane.table.publication_wanted(5)
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("late_joiner, wanted_at_once", [("immediate", True),
                                                          ("next_publication", False)])
def test_a_late_joiner_within_the_staleness_bound_waits_only_if_told_to(
        late_joiner: str, wanted_at_once: bool) -> None:
    """``learner.late_joiner``: a member that joins one version behind gets
    a publication at once (``immediate``) or at the regular one
    (``next_publication``); past the staleness bound it gets one either way."""
    [address] = loopback_addresses(1)
    plane = ControlPlane(address, TransportConfig(), run_id="r", max_staleness=2,
                         late_joiner=late_joiner, metrics=LearnerMetrics())
    context = zmq.Context()
    try:
        plane.version = 4
        actor = ControlClient(context, address, "actor-1")
        actor.send(Hello, engine=CONTROL_ENGINE, capacity=1, policy_version=3)
        assert isinstance(actor.receive(), MemberWelcome)
        [member] = plane.members()
        member.version = 3  # loaded version 3 (as its Hello said), one behind
        assert plane.table.publication_wanted(4) is wanted_at_once
        # once it has had an announcement it is no longer a late joiner
        plane.announce(4, [(member, CONTROL_MANIFEST, GroupInfo(
            generation=1, master_addr="h", master_port=1, world_size=2, rank=1,
            backend="gloo"))])
        assert not plane.table.publication_wanted(4)
        # past the staleness bound it cannot contribute: wanted, whatever the setting
        assert plane.table.publication_wanted(3 + 2 + 1)
    finally:
        context.destroy(linger=0)
        plane.close()


def test_a_member_that_reconnects_mid_publication_is_announced_to_again(control) -> None:
    """The announcement may be lost with a dropped connection: the member's
    Hello on its new connection (its token) brings the publication under way
    to it again, and once the publication ended, nothing."""
    plane, _, address = control
    context = zmq.Context()
    try:
        before = ControlClient(context, address, "actor-1")
        before.send(Hello, engine=CONTROL_ENGINE, capacity=1, policy_version=0)
        assert isinstance(before.receive(), MemberWelcome)
        [member] = plane.members()
        group = GroupInfo(generation=3, master_addr="h", master_port=1, world_size=2, rank=1,
                          backend="gloo")
        plane.announce(7, [(member, CONTROL_MANIFEST, group)])
        assert isinstance(before.receive(), WeightsAnnounce)

        def reconnected() -> ControlClient:
            """The same incarnation on a new connection, its token and seqs going on."""
            client = ControlClient(context, address, "actor-1")
            client.stamp, client.token = before.stamp, before.token
            client.send(Hello, engine=CONTROL_ENGINE, capacity=1, policy_version=0)
            assert isinstance(client.receive(), MemberWelcome)
            return client

        again = reconnected().receive()
        assert isinstance(again, WeightsAnnounce)
        assert (again.version, again.group, again.manifest) == (7, group, CONTROL_MANIFEST)
        plane.publication_ended()
        with pytest.raises(AssertionError, match="no reply"):
            reconnected().receive(timeout_ms=500)
    finally:
        context.destroy(linger=0)


def test_a_member_that_says_goodbye_leaves_before_the_next_publication(
        control, caplog: pytest.LogCaptureFixture) -> None:
    """Goodbye drops the member at once, for that reason (not its silence
    later), so a generation still forming gives up on it and the next
    publication is formed without it."""
    caplog.set_level(logging.INFO, logger="compactionrl.learner.control")
    plane, _, address = control
    context = zmq.Context()
    try:
        staying, leaving = (ControlClient(context, address, name) for name in ("a", "b"))
        for actor in (staying, leaving):
            actor.send(Hello, engine=CONTROL_ENGINE, capacity=1, policy_version=0)
            assert isinstance(actor.receive(), MemberWelcome)
        assert [m.actor_id for m in plane.members()] == ["a", "b"]
        leaving.send(Goodbye)
        wait_until(lambda: "b" not in [m.actor_id for m in plane.members()], 5.0,
                   "the goodbye's drop", poll_s=0.01)
        # a member that falls silent leaves as "missed its heartbeats"
        assert "actor 'b' left: said goodbye" in caplog.text
    finally:
        context.destroy(linger=0)


def test_closing_returns_at_once_whenever_the_control_thread_stopped(control) -> None:
    """``close`` wakes the control thread with a message; a thread that saw
    the stop first has closed its end, and a blocking send would wait for it
    for ever (a teardown hung 600 s on this, and the context's collection
    later hung another test as long). Closing then returns at once."""
    plane, _, _ = control
    plane._stop.set()
    plane._thread.join(timeout=10)
    assert not plane._thread.is_alive()
    closing = threading.Thread(target=plane.close, daemon=True)
    closing.start()
    closing.join(timeout=10)
    assert not closing.is_alive(), "close() waits on a thread that has stopped"
