"""The learner side of the replay without sockets (replay/batches.py):
waiting requests, resent requests, and served batches until confirmed."""

from __future__ import annotations

import pytest

from protocol import BatchRequest, Stamp
from replay.batches import BatchServer


def requests(incarnation: int = 1) -> Stamp:
    return Stamp("learner", incarnation)


def test_a_request_waits_until_served_and_its_batch_until_the_next_request() -> None:
    batches, stamp = BatchServer(), requests()
    first = BatchRequest(**stamp.next(), size=2, policy_version=0)
    assert batches.ask("learner", first) is None
    assert batches.waiting() == ("learner", first)
    batches.served("learner", first, b"batch-1", [], 0)
    assert batches.waiting() is None
    assert batches.resent("learner", first) == b"batch-1"  # the same request again
    second = BatchRequest(**stamp.next(), size=2, policy_version=1)
    assert batches.resent("learner", second) is None
    previous = batches.ask("learner", second)
    assert previous is not None and previous.frame == b"batch-1"
    assert previous.request == (first.incarnation, first.seq)
    assert batches.waiting() == ("learner", second)


def test_a_newer_request_replaces_the_waiting_one_and_size_0_waits_for_nothing() -> None:
    batches, stamp = BatchServer(), requests()
    batches.ask("learner", BatchRequest(**stamp.next(), size=2, policy_version=0))
    newer = BatchRequest(**stamp.next(), size=3, policy_version=1)
    batches.ask("learner", newer)
    assert batches.parked == [("learner", newer)]
    batches.ask("learner", BatchRequest(**stamp.next(), size=0, policy_version=2))
    assert batches.waiting() is None


def test_requests_are_served_oldest_first() -> None:
    batches = BatchServer()
    a = BatchRequest(**requests(1).next(), size=1, policy_version=0)
    b = BatchRequest(**requests(2).next(), size=1, policy_version=0)
    batches.ask("a", a)
    batches.ask("b", b)
    with pytest.raises(ValueError, match="oldest"):
        batches.served("b", b, b"frame", [], 0)
    batches.served("a", a, b"frame", [], 0)
    assert batches.waiting() == ("b", b)
