"""A member that makes generations fail is left out of publications with a
backoff, then for the rest of its incarnation (learner/members.py), and the
failure is put down to the members that never joined, not to those that
came (protocol/weights.py ``ranks_not_joined``), on a real store."""

from __future__ import annotations

import math

import pytest

from learner.members import ExclusionPolicy, Member, MemberTable
from protocol import EngineInfo
from protocol.weights import (
    abandon_generation,
    connect_store,
    host_store,
    join_key,
    ranks_not_joined,
)

POLICY = ExclusionPolicy()


def _table(*actor_ids: str) -> MemberTable:
    table = MemberTable(max_staleness=2, late_joiner="immediate")
    for actor_id in actor_ids:
        table.by_id[actor_id] = Member(actor_id, 1, actor_id.encode(), b"t" * 16,
                                       EngineInfo(device="cpu", dtype="float32", tensor_parallel=1,
                                                  model="m"), version=0)
    return table


class Clock:
    """``time.monotonic`` of learner/members.py, moved by hand."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr("learner.members.time.monotonic", lambda: self.now)


def test_the_backoff_doubles_then_leaves_the_member_out_for_good() -> None:
    waits = [POLICY.exclusion_s(failures) for failures in range(1, POLICY.failures_allowed + 1)]
    assert waits[0] == POLICY.backoff_s
    assert all(later == 2 * earlier for earlier, later in zip(waits[:-2], waits[1:-1], strict=True))
    assert waits[-1] == math.inf


def test_a_member_that_failed_is_neither_published_to_nor_wanting_until_its_backoff_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind and fresh, it would make every step boundary publish again,
    each waiting out the deadline for a join that never comes."""
    clock = Clock(monkeypatch)
    table = _table("healthy", "silent")
    table.delivered([table.by_id["healthy"]], 3)
    assert table.publication_wanted(3)  # the silent one is behind and fresh
    table.failed([table.by_id["silent"]])
    assert [m.actor_id for m in table.publishable()] == ["healthy"]
    assert not table.publication_wanted(3) and table.excluded() == 1
    clock.now += POLICY.backoff_s
    assert [m.actor_id for m in table.publishable()] == ["healthy", "silent"]
    assert table.publication_wanted(3) and table.excluded() == 0


def test_a_member_failing_every_generation_costs_a_bounded_number_of_tries(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """However long the run, a member that never joins is tried
    ``learner.member_failures_allowed`` times in its incarnation, each costing rank 0
    one deadline; a new incarnation (the actor restarted) is tried afresh."""
    clock = Clock(monkeypatch)
    table = _table("silent")
    tries, for_good = 0, []
    for _ in range(1000):  # a step boundary a minute
        clock.now += 60.0
        if table.publishable():
            tries += 1
            for_good += table.failed(table.publishable())
    assert tries == POLICY.failures_allowed
    assert [m.actor_id for m in for_good] == ["silent"]
    restarted = _table("silent").by_id["silent"]
    restarted.incarnation = 2
    table.by_id["silent"] = restarted
    assert table.publishable() == [restarted]


def test_a_publication_that_reaches_a_member_forgives_its_failures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch)
    table = _table("slow")
    member = table.by_id["slow"]
    for _ in range(POLICY.failures_allowed - 1):
        table.failed([member])
        clock.now += 3600.0
    table.delivered([member], 4)
    table.failed([member])
    assert member.failures == 1 and table.excluded() == 1


def test_a_failure_of_an_earlier_incarnation_is_not_put_down_to_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    Clock(monkeypatch)
    table = _table("a")
    earlier = table.by_id["a"]
    table.by_id["a"] = _table("a").by_id["a"]
    table.by_id["a"].incarnation = 2
    assert table.failed([earlier]) == [] and table.excluded() == 0


def test_a_generation_that_did_not_form_names_the_ranks_that_never_joined() -> None:
    store = host_store(0, timeout_s=5)
    member = connect_store("127.0.0.1", store.port, 5)
    try:
        member.prefixed("weights/7").set(join_key(1), "1")  # rank 1 came, 2 and 3 did not
        assert ranks_not_joined(store, 7, range(1, 4)) == [2, 3]
        abandon_generation(store, 8)
        assert ranks_not_joined(store, 6, range(1, 2)) == [1]
    finally:
        member.close()
        store.close()
