"""The learner's control socket against peers that bend its membership rules,
on real ZeroMQ sockets: identifiers that would forge log lines, incarnations
that are older or over, engines no weights can reach, load reports no
announcement asked for, and one connection or many ids registering without
end. The rules are the replay's (protocol/registry.py), so each is refused
with the code the replay's actor socket gives."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from learner.control import ControlPlane
from learner.metrics import LearnerMetrics
from protocol import (
    Error,
    Goodbye,
    GroupInfo,
    Heartbeat,
    Hello,
    MemberWelcome,
    Message,
    WeightsAnnounce,
    WeightsLoaded,
    encode,
)
from tests.processes import wait_until
from tests.protocol_clients import CONTROL_ENGINE, CONTROL_MANIFEST, ControlClient, control_plane

MAX_MEMBERS = 3


@pytest.fixture
def control() -> Iterator[tuple[ControlPlane, LearnerMetrics, str, zmq.Context]]:
    context = zmq.Context()
    with control_plane(max_members=MAX_MEMBERS) as (plane, metrics, address):
        yield plane, metrics, address, context
    context.destroy(linger=0)


def _joined(context: zmq.Context, address: str, actor_id: str,
            incarnation: int = 1) -> ControlClient:
    actor = ControlClient(context, address, actor_id, incarnation=incarnation)
    actor.send(Hello, engine=CONTROL_ENGINE, capacity=1)
    assert isinstance(reply := actor.receive(), MemberWelcome), reply
    return actor


def _refused(client: ControlClient) -> str:
    reply = client.receive()
    assert isinstance(reply, Error), reply
    return reply.code


def _heartbeat(client: ControlClient) -> None:
    client.send(Heartbeat, active_rollouts=0, stall_seconds={}, credit_ledger=0, credits_seen=0)


def _announce(plane: ControlPlane, version: int, actor_id: str) -> None:
    [member] = [m for m in plane.members() if m.actor_id == actor_id]
    plane.announce(version, [(member, CONTROL_MANIFEST, GroupInfo(
        generation=1, master_addr="h", master_port=1, world_size=2, rank=1, backend="gloo"))])


def _loads_counted(metrics: LearnerMetrics) -> float:
    return metrics.registry.get_sample_value("crl_learner_weight_sync_seconds_count",
                                             {"phase": "load"}) or 0.0


def test_an_actor_id_that_would_forge_a_log_line_is_refused_and_never_logged(
        control, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="compactionrl.learner.control")
    plane, _, address, context = control
    forger = ControlClient(context, address, "x")
    header = forger.stamp.next()
    hello = msgspec.to_builtins(Hello(**header, engine=CONTROL_ENGINE, capacity=1,
                                      token=forger.token),
                               builtin_types=(bytes,))
    forged_id = "a\nINFO compactionrl.learner.control actor admin joined"
    forger.socket.send(msgspec.msgpack.encode({**hello, "sender_id": forged_id}))
    assert _refused(forger) == "invalid"
    assert not plane.members()
    assert "admin joined" not in caplog.text
    # a printable id is welcomed, and the log quotes what the peer sent
    _joined(context, address, "actor 'quoted'")
    assert """actor "actor 'quoted'" joined""" in caplog.text


def test_an_older_incarnation_is_stale_on_a_new_connection_and_after_its_replacement(
        control) -> None:
    plane, _, address, context = control
    old = _joined(context, address, "actor-1", incarnation=5)
    older = ControlClient(context, address, "actor-1", incarnation=4)
    older.send(Hello, engine=CONTROL_ENGINE, capacity=1)
    assert _refused(older) == "stale_incarnation"
    _joined(context, address, "actor-1", incarnation=6)
    _heartbeat(old)  # the replaced incarnation, on its own connection
    assert _refused(old) == "stale_incarnation"
    assert [m.incarnation for m in plane.members()] == [6]


def test_an_incarnation_that_said_goodbye_cannot_come_back(control) -> None:
    plane, _, address, context = control
    leaving = _joined(context, address, "actor-1", incarnation=3)
    leaving.send(Goodbye)
    wait_until(lambda: not plane.members(), 5, "the goodbye's drop", poll_s=0.02)
    leaving.send(Hello, engine=CONTROL_ENGINE, capacity=1)
    assert _refused(leaving) == "dead_incarnation"
    _joined(context, address, "actor-1", incarnation=4)  # a new incarnation is welcome


def test_one_connection_speaks_for_one_member(control) -> None:
    plane, _, address, context = control
    actor = _joined(context, address, "actor-1")
    second = Hello(sender_id="actor-2", incarnation=1, seq=0, sent_at=0.0, engine=CONTROL_ENGINE,
                   capacity=1, token=actor.token)
    actor.socket.send(encode(second))
    assert _refused(actor) == "identity"
    assert [m.actor_id for m in plane.members()] == ["actor-1"]


def test_new_members_beyond_the_bound_are_refused_full_until_one_leaves(control) -> None:
    plane, _, address, context = control
    actors = [_joined(context, address, f"actor-{n}") for n in range(MAX_MEMBERS)]
    late = ControlClient(context, address, "late", incarnation=1)
    late.send(Hello, engine=CONTROL_ENGINE, capacity=1)
    assert _refused(late) == "full"
    assert len(plane.members()) == MAX_MEMBERS
    actors[0].send(Goodbye)
    wait_until(lambda: len(plane.members()) < MAX_MEMBERS, 5, "the goodbye's drop", poll_s=0.02)
    late.send(Hello, engine=CONTROL_ENGINE, capacity=1)
    assert isinstance(late.receive(), MemberWelcome)


@pytest.mark.parametrize("dtype", ["garbage-dtype", "int8"])
def test_an_engine_no_weights_can_travel_to_is_refused(control, dtype: str) -> None:
    plane, _, address, context = control
    actor = ControlClient(context, address, "actor-1")
    hello = msgspec.to_builtins(Hello(**actor.stamp.next(), engine=CONTROL_ENGINE, capacity=1,
                                      token=actor.token), builtin_types=(bytes,))
    actor.socket.send(msgspec.msgpack.encode(
        {**hello, "engine": {**hello["engine"], "dtype": dtype}}))
    assert _refused(actor) == "invalid"
    assert not plane.members()


def test_only_the_announced_member_s_first_report_of_its_announcement_counts(
        control) -> None:
    plane, metrics, address, context = control
    announced, other = _joined(context, address, "announced"), _joined(context, address, "other")
    _announce(plane, 3, "announced")
    assert isinstance(announced.receive(), WeightsAnnounce)
    reports: list[tuple[ControlClient, str]] = [
        (other, "invalid"),  # announced only to another member
        (ControlClient(context, address, "stranger"), "unregistered"),  # never joined
    ]
    for client, code in reports:
        client.send(WeightsLoaded, version=3, seconds=0.5)
        assert _refused(client) == code
    announced.send(WeightsLoaded, version=2, seconds=0.5)  # not the version announced
    assert _refused(announced) == "invalid"
    announced.send(WeightsLoaded, version=3, seconds=0.5)
    announced.send(WeightsLoaded, version=3, seconds=0.5)  # the same report again
    assert _refused(announced) == "invalid"
    assert _loads_counted(metrics) == 1
    versions = {m.actor_id: m.version for m in plane.members()}
    assert versions == {"announced": 3, "other": 0}


def test_a_member_s_report_counts_after_its_reconnect(control) -> None:
    """The announcement sent again on a member's new connection is the same
    one: its report there counts, once."""
    plane, metrics, address, context = control
    before = _joined(context, address, "actor-1")
    _announce(plane, 2, "actor-1")
    assert isinstance(before.receive(), WeightsAnnounce)
    moved = ControlClient(context, address, "actor-1")
    moved.stamp, moved.token = before.stamp, before.token
    moved.send(Hello, engine=CONTROL_ENGINE, capacity=1)
    replies: list[Message] = [moved.receive(), moved.receive()]
    assert [type(r) for r in replies] == [MemberWelcome, WeightsAnnounce]
    moved.send(WeightsLoaded, version=2, seconds=0.1)
    wait_until(lambda: _loads_counted(metrics) == 1, 5, "the load counted", poll_s=0.02)
    assert plane.members()[0].version == 2
