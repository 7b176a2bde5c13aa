"""Credit pacing: the staleness bound and freedom from deadlock, over random
interleavings of grants, finishes, drops and learner steps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from replay.pacing import CreditPacer, fair_shares

ACTORS = ("a", "b", "c")


class PacingModel(RuleBasedStateMachine):
    """Actors start rollouts only with credits; the learner asks for a batch,
    takes B when B are ready, trains, and asks again."""

    @initialize(batch=st.integers(1, 6), staleness=st.integers(0, 3),
                rollout_bytes=st.integers(1_000, 50_000), memory_rollouts=st.integers(0, 40))
    def setup(self, batch: int, staleness: int, rollout_bytes: int, memory_rollouts: int) -> None:
        self.batch, self.staleness, self.rollout_bytes = batch, staleness, rollout_bytes
        # the config check guarantees room for (S + 1) * B rollouts
        capacity = ((staleness + 1) * batch + memory_rollouts) * rollout_bytes
        self.pacer = CreditPacer(batch, staleness, capacity)
        self.credits = dict.fromkeys(ACTORS, 0)   # held by actors, not started
        self.running = dict.fromkeys(ACTORS, 0)   # started, not finished
        self.ready = 0
        self.buffer_bytes = 0
        self.started = 0
        self.learner_asked = True

    @rule(actor=st.sampled_from(ACTORS), wanted=st.integers(1, 8))
    def ask(self, actor: str, wanted: int) -> None:
        self.credits[actor] += self.pacer.grant(actor, wanted, self.buffer_bytes, self.ready)

    @rule(actor=st.sampled_from(ACTORS))
    def start(self, actor: str) -> None:
        if self.credits[actor]:
            self.credits[actor] -= 1
            self.running[actor] += 1
            self.started += 1

    @rule(actor=st.sampled_from(ACTORS), kept=st.booleans())
    def finish(self, actor: str, kept: bool) -> None:
        if self.running[actor]:
            self.running[actor] -= 1
            self.pacer.finished(actor, accepted=kept, rollout_bytes=self.rollout_bytes)
            if kept:
                self.ready += 1
                self.buffer_bytes += self.rollout_bytes

    @rule()
    def drop_stale(self) -> None:
        if self.ready:
            self.ready -= 1
            self.buffer_bytes -= self.rollout_bytes
            self.pacer.dropped()

    @rule()
    def learner_takes_batch(self) -> None:
        if self.learner_asked and self.ready >= self.batch:
            self.ready -= self.batch
            self.buffer_bytes -= self.batch * self.rollout_bytes
            self.pacer.consumed(self.batch)
            self.learner_asked = False

    @rule()
    def learner_asks(self) -> None:
        self.learner_asked = True
        self.pacer.learner_waiting()

    @rule(actor=st.sampled_from(ACTORS))
    def actor_dies(self, actor: str) -> None:
        self.pacer.forget(actor)
        self.credits[actor] = self.running[actor] = 0

    @invariant()
    def staleness_bound(self) -> None:
        in_flight = sum(self.credits.values()) + sum(self.running.values())
        assert self.pacer.accepted + in_flight <= (
            (self.staleness + self.pacer.batches_trained + 1) * self.batch)

    @invariant()
    def no_deadlock(self) -> None:
        idle = not any(self.credits.values()) and not any(self.running.values())
        if idle and self.learner_asked and self.ready < self.batch:
            assert self.pacer.available(self.buffer_bytes, self.ready) >= 1

    @invariant()
    def memory_bound(self) -> None:
        assert self.buffer_bytes <= self.pacer.max_buffer_bytes

    @invariant()
    def running_is_the_sum_of_the_actors_outstanding(self) -> None:
        assert self.pacer.running == sum(self.pacer.outstanding.values())


TestPacing = PacingModel.TestCase
TestPacing.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_no_credit_for_the_next_batch_while_the_learner_trains_synchronously() -> None:
    """At S = 0 a rollout started while the learner trains would carry the
    weights it is about to replace: stale before it ends."""
    pacer = CreditPacer(rollouts_per_batch=2, max_staleness=0, max_buffer_bytes=1 << 40)
    assert pacer.grant("a", 10, 0, 0) == 2
    for _ in range(2):
        pacer.finished("a", accepted=True, rollout_bytes=100)
    pacer.consumed(2)
    assert pacer.grant("a", 10, 0, 0) == 0
    pacer.learner_waiting()
    assert pacer.grant("a", 10, 0, 0) == 2


def test_a_ledger_totals_the_grants_until_its_actor_is_forgotten() -> None:
    pacer = CreditPacer(rollouts_per_batch=4, max_staleness=1, max_buffer_bytes=1 << 40)
    ledger, total = pacer.ledger("a")
    assert total == 0
    pacer.grant("a", 3, 0, 0)
    pacer.finished("a", accepted=True, rollout_bytes=10)
    pacer.grant("a", 2, 0, 0)
    assert pacer.ledger("a") == (ledger, 5)
    pacer.forget("a")
    renewed, total = pacer.ledger("a")
    assert renewed != ledger and total == 0


def test_incoherent_pacer_is_rejected() -> None:
    with pytest.raises(ValueError):
        CreditPacer(rollouts_per_batch=0, max_staleness=1, max_buffer_bytes=10)
    with pytest.raises(ValueError):
        CreditPacer(rollouts_per_batch=1, max_staleness=-1, max_buffer_bytes=10)


@given(st.integers(1, 8), st.integers(0, 4))
def test_fresh_pacer_grants_exactly_the_window(batch: int, staleness: int) -> None:
    pacer = CreditPacer(batch, staleness, 1 << 40)
    assert pacer.grant("a", 10_000, 0, 0) == (staleness + 1) * batch
    assert pacer.grant("b", 1, 0, 0) == 0


@given(st.integers(0, 60), st.dictionaries(
    st.text("abcdef", min_size=1, max_size=3),
    st.tuples(st.integers(1, 16), st.integers(0, 16), st.sampled_from([1, 1, 2, 4])),
    max_size=6))
def test_shares_fill_the_emptiest_actor_first_within_each_capacity(
        available: int, actors: dict[str, tuple[int, int, int]]) -> None:
    """Water-filling in whole groups: each actor's share is a multiple of
    its group size and within its room; no group that fits is left over
    while an actor has room for one; and no actor given a group held more of
    its capacity than one left with room (max-min fair, weighted by capacity)."""
    shares = fair_shares(available, actors)
    room = {actor: max(0, capacity - outstanding) // unit * unit
            for actor, (capacity, outstanding, unit) in actors.items()}
    assert all(0 < shares[actor] <= room[actor] and shares[actor] % actors[actor][2] == 0
               for actor in shares)
    left = available - sum(shares.values())
    assert all(shares.get(actor, 0) == room[actor] or actors[actor][2] > left
               for actor in actors)
    filled = {actor: (outstanding + shares.get(actor, 0)) / capacity
              for actor, (capacity, outstanding, _) in actors.items()}
    for actor, share in shares.items():
        capacity, outstanding, unit = actors[actor]
        before_last = (outstanding + share - unit) / capacity
        for other in actors:
            if (other != actor and shares.get(other, 0) < room[other]
                    and actors[other][2] == unit):
                assert before_last <= filled[other] + 1e-12, (actor, other)


def test_shares_follow_capacity_and_not_the_order_actors_are_listed() -> None:
    first = fair_shares(8, {"early": (4, 0, 1), "late": (4, 0, 1)})
    second = fair_shares(8, {"late": (4, 0, 1), "early": (4, 0, 1)})
    assert first == second == {"early": 4, "late": 4}
    assert fair_shares(6, {"big": (8, 0, 1), "small": (4, 0, 1)}) == {"big": 4, "small": 2}
    # an actor still holding credits (slower to return them) gets fewer new ones
    assert fair_shares(4, {"fast": (4, 0, 1), "slow": (4, 2, 1)}) == {"fast": 3, "slow": 1}


def test_an_actor_with_groups_gets_its_credits_a_whole_group_at_a_time() -> None:
    """Groups of 4 are granted whole (a group short of a credit would wait
    for a batch that waits for it): 6 credits give one group and leave 2 for
    an actor without groups; the pacer rounds a grant down to whole groups."""
    assert fair_shares(6, {"grouped": (8, 0, 4), "single": (8, 0, 1)}) == {
        "grouped": 4, "single": 2}
    assert fair_shares(3, {"grouped": (8, 0, 4)}) == {}
    assert fair_shares(8, {"grouped": (8, 5, 4)}) == {}  # no room for a whole group
    pacer = CreditPacer(rollouts_per_batch=4, max_staleness=0, max_buffer_bytes=1 << 30)
    assert pacer.grant("grouped", 6, 0, 0, unit=4) == 4
