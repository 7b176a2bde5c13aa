"""Heartbeat liveness: a peer is dead after `liveness` silent intervals."""

from protocol.transport import Liveness


def test_peer_expires_after_liveness_intervals() -> None:
    live = Liveness(interval_s=1.0, liveness=3)
    live.seen(b"a", now=0.0)
    live.seen(b"b", now=2.0)
    assert live.expire(now=3.0) == []
    assert live.expire(now=3.5) == [b"a"]
    assert b"b" in live and b"a" not in live and len(live) == 1


def test_any_message_refreshes_a_peer() -> None:
    live = Liveness(interval_s=1.0, liveness=2)
    live.seen(b"a", now=0.0)
    live.seen(b"a", now=1.9)
    assert live.expire(now=3.0) == []
    live.forget(b"a")
    assert b"a" not in live and len(live) == 0
