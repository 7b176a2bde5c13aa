"""What an actor knows of its peers, without sockets: credits to start
episodes, segments awaiting acknowledgement, and how far the learner is
ahead of the engine. The process (actors/process.py) feeds them the replies
its links receive; each is unit-tested alone (tests/unit/test_actor_state.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from protocol import Stamp
from protocol.messages import new_token


class Incarnation:
    """The actor's current incarnation as its messages carry it: the header
    of its next message and its ``Hello`` token. Renewed when the replay
    declares it dead; its seqs go on, so that a refusal's ``ref_seq`` tells
    which incarnation it is about."""

    def __init__(self, actor_id: str, number: int) -> None:
        self.stamp = Stamp(actor_id, number)
        self.token = new_token()
        """Drawn once per incarnation: a reconnect moves the incarnation with it."""

    @property
    def number(self) -> int:
        return self.stamp.incarnation

    def header(self) -> dict[str, Any]:
        """The header fields of the next message."""
        return self.stamp.next()

    def sent(self, seq: int) -> bool:
        """Whether the message ``seq`` was sent by this incarnation (not an older one)."""
        return seq >= self.stamp.first_seq

    def renew(self, number: int) -> None:
        self.stamp = Stamp(self.stamp.sender_id, number, first_seq=self.stamp.next_seq)
        self.token = new_token()


class CreditAccount:
    """Credits to start an episode, counted by the replay's ledger.

    Invariant, within one ledger: ``credits = seen − spent``, where ``seen`` is
    the largest ``credits_total`` any reply has carried. A reply lost with a
    dropped connection is therefore made up by the next one (counted as
    recovered), and a reply seen twice (a ``Welcome`` to a retried ``Hello``)
    adds nothing. A new ledger (the replay restarted, or forgot this actor)
    starts the account over.
    """

    def __init__(self) -> None:
        self.credits = 0
        self.ledger = 0
        self.seen = 0
        self.available = asyncio.Event()
        """Set whenever credits are added."""

    def grant(self, ledger: int, credits_total: int, credits: int) -> int:
        """Count a reply's grant; returns how many of the credits it brings
        came in earlier replies that were lost."""
        if ledger != self.ledger:
            self.ledger, self.seen, self.credits = ledger, 0, 0
        new = credits_total - self.seen
        if new <= 0:
            return 0
        self.seen = credits_total
        self.credits += new
        self.available.set()
        return max(0, new - credits)

    def spend(self) -> bool:
        """Spend one credit if there is one."""
        if self.credits <= 0:
            return False
        self.credits -= 1
        return True

    def forfeit(self) -> None:
        """Drop the credits held (a new incarnation is granted its own); the
        ledger stays, so credits already seen are not counted again."""
        self.credits = 0


@dataclass
class _Pending:
    frame: bytes
    sent_at: float


class Outbox:
    """Segments sent and not yet acknowledged, by seq: each is resent after
    the ack timeout with the same bytes (the replay drops duplicates), until
    an ``Ack`` lists it or an ``Error`` refuses it."""

    def __init__(self) -> None:
        self.pending: dict[int, _Pending] = {}
        self.empty = asyncio.Event()
        """Set while nothing awaits acknowledgement."""
        self.empty.set()

    def __len__(self) -> int:
        return len(self.pending)

    def sent(self, seq: int, frame: bytes, now: float) -> None:
        self.pending[seq] = _Pending(frame, now)
        self.empty.clear()

    def settle(self, seqs: list[int]) -> int:
        """Forget ``seqs`` (acknowledged, or refused for good); returns how
        many of them were pending."""
        settled = sum(self.pending.pop(seq, None) is not None for seq in seqs)
        if not self.pending:
            self.empty.set()
        return settled

    def overdue(self, now: float, timeout: float) -> list[bytes]:
        """The frames sent at least ``timeout`` ago, marked as sent now."""
        frames = []
        for pending in self.pending.values():
            if now - pending.sent_at >= timeout:
                pending.sent_at = now
                frames.append(pending.frame)
        return frames

    def abandon(self) -> int:
        """Drop everything pending (their incarnation is over); returns how many."""
        count = len(self.pending)
        self.pending.clear()
        self.empty.set()
        return count


class LearnerView:
    """How far the learner is ahead of the engine's weights, and the weight
    group joined. An episode may start only while generating gives tokens the
    replay accepts: ``learner version − engine version ≤ max_staleness``."""

    def __init__(self) -> None:
        self.version = 0
        """The newest learner version heard of (from any reply)."""
        self.max_staleness = 0
        """The replay's bound (its ``Welcome``: the one source)."""
        self.changed = asyncio.Event()
        """Set when the learner's or the engine's version moves."""
        self.group: tuple[int, int] | None = None
        """(learner incarnation, generation) of the broadcast group joined."""

    def heard(self, version: int) -> None:
        self.version = max(self.version, version)
        self.changed.set()

    def fresh(self, engine_version: int) -> bool:
        # NO_COMPLETE_VERSION (< 0): a mix of two versions is never fresh
        return engine_version >= 0 and self.version - engine_version <= self.max_staleness
