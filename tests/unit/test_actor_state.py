"""The actor's socket-free state (actors/state.py): credits counted by the
replay's ledger, segments awaiting acknowledgement, and weight freshness."""

from __future__ import annotations

from actors.state import CreditAccount, LearnerView, Outbox
from protocol import NO_COMPLETE_VERSION


def test_a_grant_adds_what_the_ledger_total_has_not_yet_counted() -> None:
    account = CreditAccount()
    assert account.grant(ledger=1, credits_total=4, credits=4) == 0
    assert account.credits == 4 and account.available.is_set()
    account.available.clear()
    assert account.grant(ledger=1, credits_total=4, credits=4) == 0  # a Welcome seen twice
    assert account.credits == 4 and not account.available.is_set()


def test_credits_of_a_lost_reply_are_made_up_by_the_next_and_counted() -> None:
    account = CreditAccount()
    account.grant(ledger=1, credits_total=2, credits=2)
    # the Ack granting 3 more was lost; the next grants 1 and carries total 6
    assert account.grant(ledger=1, credits_total=6, credits=1) == 3
    assert (account.credits, account.seen) == (6, 6)


def test_a_new_ledger_starts_the_account_over() -> None:
    account = CreditAccount()
    account.grant(ledger=1, credits_total=5, credits=5)
    assert account.grant(ledger=2, credits_total=2, credits=2) == 0
    assert (account.ledger, account.seen, account.credits) == (2, 2, 2)


def test_spending_stops_at_zero_and_a_forfeit_keeps_the_ledger() -> None:
    account = CreditAccount()
    account.grant(ledger=3, credits_total=2, credits=2)
    assert account.spend() and account.spend() and not account.spend()
    account.grant(ledger=3, credits_total=3, credits=1)
    account.forfeit()
    assert account.credits == 0 and not account.spend()
    assert account.grant(ledger=3, credits_total=3, credits=1) == 0  # not counted again
    assert account.credits == 0


def test_the_outbox_is_empty_exactly_when_nothing_awaits_an_ack() -> None:
    outbox = Outbox()
    assert outbox.empty.is_set() and len(outbox) == 0
    outbox.sent(1, b"a", now=0.0)
    outbox.sent(2, b"b", now=0.0)
    assert not outbox.empty.is_set()
    assert outbox.settle([1, 7]) == 1  # 7 was never pending
    assert not outbox.empty.is_set()
    assert outbox.settle([2]) == 1 and outbox.empty.is_set()


def test_overdue_frames_are_resent_once_per_timeout() -> None:
    outbox = Outbox()
    outbox.sent(1, b"old", now=0.0)
    outbox.sent(2, b"new", now=9.0)
    assert outbox.overdue(now=10.0, timeout=5.0) == [b"old"]
    assert outbox.overdue(now=12.0, timeout=5.0) == []  # resent at 10: not due until 15
    assert outbox.overdue(now=15.0, timeout=5.0) == [b"old", b"new"]


def test_abandoning_counts_what_was_pending_and_empties_the_outbox() -> None:
    outbox = Outbox()
    for seq in range(3):
        outbox.sent(seq, b"x", now=0.0)
    assert outbox.abandon() == 3
    assert not outbox and outbox.empty.is_set()


def test_weights_are_fresh_within_the_replays_staleness_bound() -> None:
    view = LearnerView()
    view.max_staleness = 2
    view.heard(5)
    view.heard(3)  # an older reply never moves the learner back
    assert view.version == 5 and view.changed.is_set()
    assert view.fresh(engine_version=3) and not view.fresh(engine_version=2)


def test_weights_left_a_mix_by_a_failed_load_are_never_fresh() -> None:
    view = LearnerView()
    view.max_staleness = 2
    assert view.fresh(engine_version=0)
    assert not view.fresh(engine_version=NO_COMPLETE_VERSION)  # 0 - (-1) <= 2 all the same
