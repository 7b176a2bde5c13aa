"""Rollout assembly, expiry, staleness and serving order."""

from __future__ import annotations

import numpy as np
import pytest

from protocol import Array, GroupTag, Segment, encode
from protocol.validation import check_segment_content
from replay.buffer import SEGMENT_OVERHEAD_BYTES, RolloutBuffer, to_rollout

_seq = iter(range(10**9))


def segment(rollout: str, index: int, final: bool = False, version: int = 5,
            actor: str = "a", incarnation: int = 1, n: int = 4, group: str | None = None,
            size: int = 4) -> Segment:
    def array(values, dtype):
        return Array.from_numpy(np.asarray(values, dtype=dtype))

    return Segment(sender_id=actor, incarnation=incarnation, seq=next(_seq), sent_at=0.0,
                   rollout_id=rollout, task_id="t", index=index, segment_type="execution",
                   tokens=array(range(n), "int32"), loss_mask=array([0, 1] * (n // 2), "uint8"),
                   logprobs=array([0.0, -1.0] * (n // 2), "float32"),
                   versions=array([-1, version] * (n // 2), "int32"), final=final,
                   reward=1.0 if final else None,
                   group=None if group is None else GroupTag(id=group, size=size))


def add(buffer: RolloutBuffer, seg: Segment, now: float = 0.0) -> str:
    oldest = check_segment_content(seg, vocab_size=100, oldest_version=0, newest_version=99)
    result = buffer.add(seg, encode(seg), now, oldest)
    buffer.promote(seg.rollout_id, now)
    return result


def served(buffer: RolloutBuffer, size: int, learner_version: int, now: float = 10.0
           ) -> list[str]:
    """The ids of the rollouts ``take`` serves, group by group."""
    return [rollout_id for group in buffer.take(size, learner_version, now)
            for rollout_id in group.ready]


def buffer(**changes) -> RolloutBuffer:
    values = dict(max_staleness=2, serve_order="fifo", rollout_timeout_s=60.0)
    values.update(changes)
    return RolloutBuffer(**values)


def test_rollout_is_ready_only_when_final_and_complete() -> None:
    b = buffer()
    segments = [segment("r", 2, final=True), segment("r", 0), segment("r", 1)]
    add(b, segments[0])
    add(b, segments[1])
    assert "r" in b.pending and not b.ready
    add(b, segments[2])
    assert "r" in b.ready and not b.pending
    # served as stored: the frames, in index order
    served = to_rollout(b.ready["r"], 5).segments
    assert [bytes(frame) for frame in served] == [encode(s) for s in segments[1:] + [segments[0]]]
    assert b.nbytes == sum(len(encode(s)) + SEGMENT_OVERHEAD_BYTES for s in segments)


@pytest.mark.parametrize("second", [
    lambda: segment("r", 0),                  # the same index again (other seq)
    lambda: segment("r", 3, final=True),      # a second final
    lambda: segment("r", 5),                  # beyond the final
])
def test_conflicting_segments_are_reported(second) -> None:
    b = buffer()
    add(b, segment("r", 0))
    add(b, segment("r", 3, final=True))
    assert add(b, second()) == "conflict"


def test_served_rollouts_are_not_revived_by_late_segments() -> None:
    b = buffer()
    add(b, segment("r", 0, final=True))
    assert served(b, 1, learner_version=5) == ["r"] and b.nbytes == 0
    assert add(b, segment("r", 0, final=True)) == "late"
    assert not b.pending and not b.ready


def test_expiry_by_age_and_by_dead_actor() -> None:
    b = buffer(rollout_timeout_s=10.0)
    add(b, segment("old", 0), now=0.0)
    add(b, segment("fresh", 0, actor="b", incarnation=7), now=8.0)
    assert [e.rollout_id for e in b.expired(11.0, set())] == ["old"]
    assert {e.rollout_id for e in b.expired(9.0, {("b", 7)})} == {"fresh"}
    add(b, segment("done", 0, final=True), now=0.0)
    assert "done" not in {e.rollout_id for e in b.expired(100.0, {("a", 1)})}


def test_staleness_is_measured_from_the_oldest_trainable_token() -> None:
    b = buffer(max_staleness=2)
    add(b, segment("r1", 0, version=3))
    add(b, segment("r1", 1, final=True, version=6))
    add(b, segment("r2", 0, final=True, version=5))
    assert b.ready["r1"].staleness(6) == 3
    assert [e.rollout_id for e in b.stale(6)] == ["r1"]
    assert b.stale(5) == []


def test_fifo_freshest_and_oldest_orders() -> None:
    for order, expected in (("fifo", ["a", "b"]), ("freshest", ["c", "b"]),
                            ("oldest", ["a", "b"])):
        b = buffer(serve_order=order)
        add(b, segment("a", 0, final=True, version=1), now=1.0)
        add(b, segment("b", 0, final=True, version=3), now=2.0)
        add(b, segment("c", 0, final=True, version=4), now=3.0)
        assert served(b, 2, learner_version=4) == expected
        assert served(b, 2, learner_version=4) == []  # only one left


def test_oldest_order_breaks_ties_by_readiness_and_skips_the_fresher() -> None:
    b = buffer(serve_order="oldest")
    add(b, segment("fresh", 0, final=True, version=4), now=1.0)
    add(b, segment("old-late", 0, final=True, version=2), now=3.0)
    add(b, segment("old-early", 0, final=True, version=2), now=2.0)
    assert served(b, 2, learner_version=4) == ["old-early", "old-late"]


def finish(b: RolloutBuffer, rollout: str, group: str, now: float = 0.0, **fields) -> None:
    """A one-segment member of ``group`` (of 4), complete."""
    add(b, segment(rollout, 0, final=True, group=group, **fields), now)


def test_a_group_is_served_only_whole_even_when_enough_rollouts_are_ready() -> None:
    b = buffer()
    for member in ("g0", "g1", "g2"):
        finish(b, f"{member}", "g")
    add(b, segment("g3", 0, group="g"))            # the fourth is under way
    for member in range(4):
        finish(b, f"h{member}", "h")
    assert served(b, 4, learner_version=5) == ["h0", "h1", "h2", "h3"]
    assert served(b, 4, learner_version=5) == []   # 3 ready, but their group is not
    add(b, segment("g3", 1, final=True, group="g"))
    assert served(b, 4, learner_version=5) == ["g0", "g1", "g2", "g3"]


def test_a_batch_takes_the_fewest_whole_groups_that_fill_it() -> None:
    b = buffer()
    for group in ("x", "y", "z"):
        for member in range(4):
            finish(b, f"{group}{member}", group)
    taken = b.take(8, learner_version=5, now=10.0)
    assert [g.key[2] for g in taken] == ["x", "y"] and all(g.complete for g in taken)


def test_a_group_that_lost_a_member_is_served_with_the_rest_once_they_are_settled() -> None:
    b = buffer()
    for member in range(3):
        finish(b, f"g{member}", "g")
    add(b, segment("g3", 0, group="g"))
    assert served(b, 3, learner_version=5) == []
    b.remove("g3")                                  # abandoned, say
    [group] = b.take(3, learner_version=5, now=10.0)
    assert list(group.ready) == ["g0", "g1", "g2"] and not group.complete


def test_a_member_given_up_before_its_first_segment_still_settles_its_group() -> None:
    b = buffer()
    for member in range(3):
        finish(b, f"g{member}", "g")
    b.remove("g3", owner=("a", 1), group=GroupTag(id="g", size=4))
    assert served(b, 3, learner_version=5) == ["g0", "g1", "g2"]


def test_a_group_whose_actor_is_gone_or_that_waited_past_the_timeout_is_served_as_it_is() -> None:
    b = buffer(rollout_timeout_s=60.0)
    finish(b, "a0", "g", actor="a")
    finish(b, "b0", "g", actor="b", now=30.0)      # another actor's group of the same name
    assert served(b, 1, learner_version=5, now=59.0) == []
    b.groups.owner_gone(("a", 1))
    assert served(b, 1, learner_version=5, now=59.0) == ["a0"]
    assert served(b, 1, learner_version=5, now=89.0) == []
    assert served(b, 1, learner_version=5, now=91.0) == ["b0"]


def test_a_stale_group_is_dropped_whole_and_its_late_members_are_refused() -> None:
    b = buffer(max_staleness=2)
    finish(b, "g0", "g", version=3)
    finish(b, "g1", "g", version=5)
    add(b, segment("g2", 0, group="g", version=5))
    assert b.stale(5) == []
    assert sorted(e.rollout_id for e in b.stale(6)) == ["g0", "g1", "g2"]
    for rollout_id in ("g0", "g1", "g2"):
        b.remove(rollout_id)
    assert add(b, segment("g3", 0, group="g")) == "late_member"
    assert not b.groups.open


def test_a_groups_segments_must_agree_on_its_group() -> None:
    b = buffer()
    add(b, segment("r", 0, group="g"))
    assert add(b, segment("r", 1, group="other")) == "conflict"
    assert add(b, segment("r", 1, final=True)) == "conflict"
    assert add(b, segment("r", 1, group="g", size=2)) == "conflict"


def test_groups_served_to_a_learner_that_died_come_back_whole_and_first() -> None:
    b = buffer()
    for group in ("x", "y"):
        for member in range(4):
            finish(b, f"{group}{member}", group)
    [first] = b.take(4, learner_version=5, now=10.0)
    b.restore(list(first.ready.values()))
    assert served(b, 4, learner_version=5) == ["x0", "x1", "x2", "x3"]
