"""Learner rank 0's client of the replay (learner/replay_client.py): it gives
up within its deadline when the replay is silent or gone, and stops on a
refusal instead of waiting for a batch that will never come."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from learner.replay_client import LearnerReplaced, ReplayRefused, ReplayUnreachable
from protocol import (
    BatchRequest,
    Error,
    ErrorCode,
    LearnerHello,
    LearnerWelcome,
    Stamp,
    decode,
    encode,
)
from protocol.synthetic import synthetic_batch
from protocol.transport import TransportConfig
from tests.ports import loopback_addresses
from tests.processes import ReplayProcess
from tests.protocol_clients import replay_client

#: The client's deadline here: short, the tests wait for it.
TIMEOUT_S = 1.0
#: A frozen peer's connection drops after 0.2 s x 3 without an answer to ZMTP pings.
TRANSPORT = TransportConfig(heartbeat_interval_s=0.2, heartbeat_liveness=3)
#: How long the learner waits for a batch that never comes.
IDLE_WAIT_S = 0.5


class FakeReplay:
    """A ROUTER on the replay's learner address that answers as the test says."""

    def __init__(self, context: zmq.Context) -> None:
        [self.address] = loopback_addresses(1)
        self.socket = context.socket(zmq.ROUTER)
        self.socket.bind(self.address)
        self.stamp = Stamp("replay", 1)

    def answer(self, reply: object) -> object:
        """Read the next message and answer it with ``reply(message)``."""
        assert self.socket.poll(10_000), "the client sent nothing"
        identity, frame = self.socket.recv_multipart()
        message = decode(frame)
        self.socket.send_multipart([identity, encode(reply(message))])
        return message

    def welcome(self, message: object) -> LearnerWelcome:
        assert isinstance(message, LearnerHello)
        return LearnerWelcome(**self.stamp.next(), run_id="run", policy_version=0,
                              rollouts_per_batch=2, max_staleness=1)

    def close(self) -> None:
        self.socket.close(linger=0)


@pytest.fixture
def fake(context: zmq.Context) -> Iterator[FakeReplay]:
    replay = FakeReplay(context)
    yield replay
    replay.close()


def test_the_client_gives_up_when_the_replay_never_answers_hello(fake: FakeReplay) -> None:
    client, _ = replay_client(fake.address, TIMEOUT_S, TRANSPORT)
    began = time.monotonic()
    try:
        with pytest.raises(ReplayUnreachable, match="did not answer hello"):
            client.hello()
    finally:
        client.close()
    assert time.monotonic() - began >= TIMEOUT_S


def test_the_client_gives_up_when_the_replay_stays_gone(fake: FakeReplay) -> None:
    client, _ = replay_client(fake.address, TIMEOUT_S, TRANSPORT)
    try:
        # the fake answers from a thread while hello() waits (its socket is
        # that thread's alone until it is joined)
        answering = threading.Thread(target=fake.answer, args=(fake.welcome,))
        answering.start()
        welcome = client.hello()
        answering.join()
        assert welcome.rollouts_per_batch == 2
        fake.close()  # the replay is gone, and no other comes up
        with pytest.raises(ReplayUnreachable, match="no connection to the replay"):
            client.next_batch(2, 0, lambda: False)
    finally:
        client.close()



def test_the_client_returns_the_batch_it_takes_with_the_frame_it_came_in(
        fake: FakeReplay) -> None:
    client, _ = replay_client(fake.address, TIMEOUT_S, TRANSPORT)
    served = synthetic_batch(rollouts=2)
    try:
        client.request(2, 0)
        assert isinstance(fake.answer(lambda _: served), BatchRequest)
        taken = client.next_batch(2, 0, lambda: False)
        assert taken is not None and taken.frame == encode(served)
        assert [r.rollout_id for r in taken.batch.rollouts] == ["r0", "r1"]
        # interrupted before a batch came: none, and the request it sent stays outstanding
        assert client.next_batch(2, 0, lambda: True) is None
        assert client.request_frame is not None
    finally:
        client.close()

def test_the_learner_s_idle_time_counts_a_wait_while_it_lasts(fake: FakeReplay) -> None:
    """The live view read 'the learner waits for rollouts 120 % of the time':
    the client counted a wait for a batch when it ended, so the window of
    the view it ended in got all of it, begun before the window or not.
    Counted as it goes, the idle time between two reads is at most the time
    between them, and a read in the middle of a wait sees what it waited."""
    client, metrics = replay_client(fake.address, TIMEOUT_S, TRANSPORT)
    reads: list[tuple[float, float, float]] = []  # monotonic before, idle, monotonic after
    began = time.monotonic()

    def read() -> None:
        before = time.monotonic()
        idle = metrics.registry.get_sample_value("crl_learner_idle_seconds_total")
        reads.append((before, idle, time.monotonic()))

    def waited_enough() -> bool:
        read()
        return time.monotonic() - began >= IDLE_WAIT_S

    try:
        client.request(2, 0)  # the fake never answers it: the client waits
        assert client.next_batch(2, 0, waited_enough) is None
    finally:
        client.close()
    read()
    assert reads[len(reads) // 2][1] > 0, "a wait under way was not counted"
    for (before, earlier, _), (_, later, after) in zip(reads, reads[1:], strict=False):
        assert later - earlier <= after - before
    assert reads[-1][1] >= reads[-2][0] - reads[0][2]  # all of the wait, read inside it


@pytest.mark.parametrize(("code", "raised"), [(ErrorCode.INVALID, ReplayRefused),
                                              (ErrorCode.STALE_INCARNATION, LearnerReplaced)])
def test_a_refusal_of_the_learner_s_request_stops_it_with_the_replay_s_words(
        fake: FakeReplay, code: ErrorCode, raised: type) -> None:
    client, _ = replay_client(fake.address, TIMEOUT_S, TRANSPORT)
    try:
        client.request(2, 5)
        request = fake.answer(lambda m: Error(**fake.stamp.next(), code=code,
                                              text="policy_version 5 > 1", ref_seq=m.seq))
        assert isinstance(request, BatchRequest)
        with pytest.raises(raised, match="policy_version 5 > 1"):
            client.next_batch(2, 5, lambda: False)
    finally:
        client.close()


def test_a_frozen_replay_is_noticed_by_zmtp_pings_and_the_client_gives_up(
        tmp_path: Path) -> None:
    """The real replay process, stopped (SIGSTOP) while the learner waits
    for a batch: its connection drops after the transport's liveness, and
    the client gives up ``TIMEOUT_S`` later instead of waiting for ever."""
    replay = ReplayProcess(tmp_path)
    client, _ = replay_client(replay.learner_address, TIMEOUT_S, TRANSPORT)
    try:
        client.hello()
        os.kill(replay.pid, signal.SIGSTOP)
        with pytest.raises(ReplayUnreachable):
            client.next_batch(2, 0, lambda: False)
    finally:
        os.kill(replay.pid, signal.SIGCONT)
        client.close()
        replay.stop()
