"""Every range edge of every field of every message kind, against the real
replay process (issue 60): a value at an edge is taken, a value beyond it
is refused ``invalid``, counted once under that reason, and the replay goes
on serving a normal round trip (an actor's rollouts in a learner's batch).

The edges come from the ranges declared on the fields' types
(tests/field_edges.py), the same declarations docs/protocol.md's field
tables are generated from, so the documented table and the replay's
answers are compared value by value. Kinds the replay does not take
(``welcome``, ``batch``, ...) are decoded all the same: in range they are
``unexpected``, out of range ``invalid``."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from itertools import groupby

import msgspec
import pytest
import zmq

from protocol import (
    MESSAGE_TYPES,
    Ack,
    Error,
    Hello,
    LearnerHello,
    LearnerWelcome,
    Stamp,
    Welcome,
    decode,
    encode,
)
from protocol.messages import new_token
from protocol.synthetic import synthetic_hello
from tests.field_edges import HEADER, Probe, edges, field_probes, probe, ranged_fields
from tests.processes import ReplayProcess, scripted_replay
from tests.protocol_clients import ActorClient, LearnerClient, dealer

#: The replay's batch size B: a request's ``size`` is at most it.
BATCH = 2
#: Kinds the replay's learner socket takes; every other kind goes to its actor socket.
LEARNER_KINDS = ("batch_request", "learner_hello")
#: Kinds the actor socket takes (the others are ``unexpected`` there).
ACTOR_KINDS = ("hello", "segment", "abandon", "heartbeat", "goodbye")
#: Seconds to wait for a reply before a test calls the replay unresponsive.
REPLY_S = 10.0


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplayProcess]:
    with scripted_replay(tmp_path_factory.mktemp("replay"), BATCH) as process:
        yield process


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def expected_code(probe: Probe) -> str | None:
    """The replay's answer to ``probe`` by the table: ``invalid`` beyond a
    range, the service's rules on a ``batch_request`` (docs/protocol.md, "The
    version clock": ``size`` at most B; this learner incarnation has set the
    clock to 0 and been served a batch, so its versions stop at 1; docs/replay.md,
    "Groups": a hello's ``group_size`` at most B, a group's ``size`` the one
    its actor's hello declared, 1 here), ``unexpected`` for a kind the socket
    does not take, else none."""
    if not probe.accepted:
        return "invalid"
    if probe.kind == "hello" and probe.path == ("group_size",) and probe.value > BATCH:
        return "invalid"
    if probe.path[-2:] == ("group", "size") and probe.value != 1:
        return "invalid"
    if probe.kind == "batch_request" and probe.value > (BATCH if probe.path == ("size",)
                                                        else 1):
        return "invalid"
    return None if probe.kind in ACTOR_KINDS + LEARNER_KINDS else "unexpected"


class Prober:
    """Sends probes on one registered connection per socket, each followed
    by a handshake whose answer marks the end of the replies to it."""

    def __init__(self, context: zmq.Context, replay: ReplayProcess) -> None:
        self.actor_stamp = Stamp("probe", 1)
        self.token = new_token()
        self.actor = dealer(context, replay.actor_address)
        # a learner incarnation newer than any before it on this replay
        self.learner = LearnerClient(context, replay.learner_address, incarnation=time.time_ns())
        assert self._answer(self.actor, self._sentinel(), Welcome, wanted=1) == []

    def _sentinel(self) -> bytes:
        return encode(synthetic_hello(self.actor_stamp, token=self.token))

    def code(self, probe: Probe) -> str | None:
        """The ``code`` of the error the probe got (None: it was taken)."""
        learner_side = probe.kind in LEARNER_KINDS
        socket = self.learner.socket if learner_side else self.actor
        socket.send(probe.frame)
        if learner_side:
            sentinel = encode(LearnerHello(**self.learner.stamp.next()))
            errors = self._answer(socket, sentinel, LearnerWelcome, wanted=1)
        else:
            taken_hello = probe.kind == "hello" and expected_code(probe) is None
            errors = self._answer(socket, self._sentinel(), Welcome, wanted=1 + taken_hello,
                                  stored=probe.seq if probe.kind in ("segment", "abandon")
                                  and expected_code(probe) is None else None)
        named = [error for error in errors if error.ref_seq in (probe.seq, None)]
        assert len(named) <= 1, named
        return named[0].code if named else None

    @staticmethod
    def _answer(socket: zmq.Socket, sentinel: bytes, answer: type, wanted: int,
                stored: int | None = None) -> list[Error]:
        """Send ``sentinel``; the errors received until ``wanted`` replies of
        type ``answer`` (and the ``ack`` storing seq ``stored``) arrived."""
        socket.send(sentinel)
        errors: list[Error] = []
        while wanted or stored is not None:
            assert socket.poll(int(REPLY_S * 1000)), "the replay stopped answering"
            message = decode(socket.recv())
            if isinstance(message, answer):
                wanted -= 1
            elif isinstance(message, Ack) and stored in message.stored_seqs:
                stored = None
            elif isinstance(message, Error):
                errors.append(message)
                stored = None
        return errors


def round_trip(replay: ReplayProcess, honest: ActorClient, learner: LearnerClient) -> None:
    """An honest actor's B rollouts reach the learner in a batch."""
    for _ in range(BATCH):
        honest.push_rollout(segments=2)
    assert honest.pump_until(lambda: not honest.unacked), honest.errors
    learner.request(BATCH, version=0)
    batch = learner.receive(REPLY_S)
    assert batch is not None and len(batch.rollouts) == BATCH


def test_every_field_is_taken_at_its_range_edges_and_refused_beyond_them(
        replay: ReplayProcess, context: zmq.Context) -> None:
    prober = Prober(context, replay)
    honest = ActorClient(context, replay.actor_address, "honest")
    honest.hello()
    assert honest.pump_until(lambda: honest.registered)
    learner = prober.learner
    learner.request(0, version=0)  # the incarnation's first request: the clock is at 0
    round_trip(replay, honest, learner)  # and a batch was served since
    checked = 0
    probes = [*field_probes(prober.actor_stamp, tuple(
        t for t in MESSAGE_TYPES if msgspec.inspect.type_info(t).tag not in LEARNER_KINDS)),
        *field_probes(learner.stamp, tuple(
            t for t in MESSAGE_TYPES if msgspec.inspect.type_info(t).tag in LEARNER_KINDS))]
    for kind, group in groupby(probes, key=lambda p: p.kind):
        before = replay.rejected()
        wanted: Counter[str] = Counter()
        for each in group:
            expected = expected_code(each)
            assert prober.code(each) == expected, (each.kind, each.path, repr(each.value)[:80])
            wanted.update([expected] if expected else [])
            checked += 1
        after = replay.wait_rejected(sum(before.values()) + wanted.total())
        assert after - before == wanted, kind
        round_trip(replay, honest, learner)
    assert checked > 300  # every kind's every ranged field, at and beyond each edge


def test_every_header_field_is_taken_at_its_edges_and_refused_beyond_them_in_every_kind(
        replay: ReplayProcess, context: zmq.Context) -> None:
    """A header edge value is taken in a ``hello`` (each on a connection of
    its own: the header says who speaks); beyond an edge, every kind is
    refused ``invalid`` before anything else is read."""
    stamp = Stamp("header-probe", 1)
    header = msgspec.inspect.type_info(Hello)
    fields = {path[0]: info for path, info in ranged_fields(header) if path[0] in HEADER}
    assert set(fields) == {"sender_id", "incarnation", "seq", "sent_at"}
    before = replay.rejected()
    refused = 0
    for name, info in fields.items():
        for value, accepted in edges(info, (name,)):
            kinds = [Hello] if accepted else list(MESSAGE_TYPES)
            for kind in kinds:
                socket = dealer(context, replay.actor_address)
                each = probe(kind, stamp, (name,), value, accepted)
                if accepted and name != "sender_id":  # a new actor: no incarnation order
                    each = probe(kind, Stamp(f"header-{name}-{value}", 1), (name,), value, True)
                socket.send(each.frame)
                assert socket.poll(int(REPLY_S * 1000)), (name, value)
                reply = decode(socket.recv())
                if accepted:
                    assert isinstance(reply, Welcome), (name, value, reply)
                else:
                    assert isinstance(reply, Error) and reply.code == "invalid", (name, value)
                    assert reply.ref_seq == (None if name == "seq" else each.seq)
                    refused += 1
                socket.close(linger=0)
    after = replay.wait_rejected(sum(before.values()) + refused)
    assert after - before == Counter({"invalid": refused})
    learner = LearnerClient(context, replay.learner_address, incarnation=time.time_ns())
    honest = ActorClient(context, replay.actor_address, "honest-after-headers")
    honest.hello()
    assert honest.pump_until(lambda: honest.registered)
    round_trip(replay, honest, learner)
