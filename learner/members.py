"""The learner's weight-group members and what a publication owes them.

The control plane's thread (learner/control.py) adds and drops members as
actors say hello, goodbye or fall silent; the training thread asks whom to
publish to (:meth:`MemberTable.publishable`) and whether a publication is
wanted now, and reports what each broadcast did. One lock guards the table
for both threads.

Usage::

    table = MemberTable(max_staleness=2, late_joiner="immediate")
    with table.lock:
        table.by_id[member.actor_id] = member
    table.publishable()
    table.publication_wanted(version)
    table.delivered(members, version)   # or table.broken(members), table.failed(members)

A member that fails generations (it never joins, or the broadcast of a lane
it alone holds fails) is left out of publications for a while, twice as
long after each failure in a row, and for the rest of its incarnation after
``learner.member_failures_allowed`` of them (:class:`ExclusionPolicy`): rank
0 waits ``learner.weight_timeout_s`` for each of its failures, so what it
costs the learner is bounded in all, that many deadlines per incarnation,
not per publication (docs/weights.md "A member that never joins").
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Literal

from protocol import NO_COMPLETE_VERSION, EngineInfo, WeightsAnnounce


@dataclass(frozen=True)
class ExclusionPolicy:
    """How long publications leave out a member that made generations fail
    (``learner.member_backoff_s``, ``learner.member_failures_allowed``)."""

    backoff_s: float = 10.0
    """Left out this long after its first failure in a row; each next one doubles it."""
    failures_allowed: int = 5
    """Failures in a row after which it is left out for the rest of its incarnation."""

    def exclusion_s(self, failures: int) -> float:
        """How long a member is left out after its ``failures``-th failed
        generation in a row: a backoff, then for good (inf)."""
        if failures >= self.failures_allowed:
            return math.inf
        return self.backoff_s * 2 ** (failures - 1)


@dataclass
class Member:
    """One registered actor incarnation."""

    actor_id: str
    incarnation: int
    identity: bytes
    """The connection it registered on (its routing id, drawn by the ROUTER)."""
    token: bytes
    """From its first ``Hello``: a ``Hello`` on another connection must carry it to move it."""
    engine: EngineInfo
    version: int
    """Version of the weights it reported holding (Hello, then WeightsLoaded),
    or that a successful broadcast delivered to it (its report may lag)."""
    fresh: bool = True
    """Joined after the last publication that included it."""
    pending: WeightsAnnounce | None = None
    """The announcement of the publication under way, until it ends: sent
    again if the member says hello on a new connection meanwhile, since the
    first may have been lost with the old one (else the broadcast would wait
    its whole timeout for a member that never heard of it)."""
    unacknowledged: WeightsAnnounce | None = None
    """The announcement last sent to it, until its ``WeightsLoaded`` of that
    version arrives: only that report counts, and only once."""
    heard_at: float = 0.0
    """When its last message arrived (``time.monotonic``)."""
    broken_at: float | None = None
    """When a broadcast to it failed midway, until it is heard from again."""
    failures: int = 0
    """Generations it failed in a row (:meth:`MemberTable.failed`); a
    publication that reaches it resets them."""
    excluded_until: float = 0.0
    """Publications leave it out until then (``time.monotonic``; inf: for
    the rest of its incarnation), whatever it says meanwhile."""

    @property
    def suspect(self) -> bool:
        """A broadcast to it failed and it has not spoken since: it may have
        died (a killed process says no goodbye). A publication does not wait
        for it; a living member clears this within a heartbeat interval."""
        return self.broken_at is not None and self.heard_at <= self.broken_at


class MemberTable:
    def __init__(self, max_staleness: int,
                 late_joiner: Literal["immediate", "next_publication"],
                 exclusion: ExclusionPolicy | None = None) -> None:
        self.max_staleness = max_staleness
        self.late_joiner = late_joiner
        self.exclusion = exclusion or ExclusionPolicy()
        self.by_id: dict[str, Member] = {}
        """The registered members, by actor id."""
        self.lock = threading.Lock()

    def publishable(self) -> list[Member]:
        """The members a publication goes to, in a stable order (their
        broadcast ranks follow it): every live member but the suspects and
        those left out after failures."""
        with self.lock:
            return sorted(self._served(), key=lambda m: m.actor_id)

    def _served(self) -> list[Member]:
        """The caller holds the lock."""
        now = time.monotonic()
        return [m for m in self.by_id.values() if not m.suspect and m.excluded_until <= now]

    def excluded(self) -> int:
        """How many members publications leave out now after failures."""
        now = time.monotonic()
        with self.lock:
            return sum(m.excluded_until > now for m in self.by_id.values())

    def publication_wanted(self, version: int) -> bool:
        """Whether a member needs weights now: its weights are a mix (a load
        failed midway: its engine waits, paused), or older than the staleness
        bound (it cannot contribute), or a late joiner asks for them at once."""
        with self.lock:
            for member in self._served():
                if member.version == NO_COMPLETE_VERSION:
                    return True
                behind = version - member.version
                if behind > self.max_staleness:
                    return True
                if behind > 0 and member.fresh and self.late_joiner == "immediate":
                    return True
        return False

    def delivered(self, members: list[Member], version: int) -> None:
        """A broadcast of ``version`` reached ``members``."""
        with self.lock:
            for member in self.current(members):
                member.version = max(member.version, version)
                member.broken_at = None
                member.failures = 0

    def broken(self, members: list[Member]) -> None:
        """A broadcast to ``members`` failed midway: their engines hold a mix
        of versions, paused, until a publication reaches them. The failure
        does not say which member caused it, so each is a suspect until it
        speaks again: a dead one is left out of the next publication at once,
        not after its heartbeats are missed."""
        now = time.monotonic()
        with self.lock:
            for member in self.current(members):
                member.version = NO_COMPLETE_VERSION
                member.broken_at = now

    def failed(self, members: list[Member]) -> list[Member]:
        """A generation failed because of ``members`` (they never joined, or
        the broadcast of a lane they alone held failed): each is left out
        for :meth:`ExclusionPolicy.exclusion_s` of its failures in a row.
        Returns those left out for the rest of their incarnation by this failure."""
        now = time.monotonic()
        with self.lock:
            current = self.current(members)
            for member in current:
                member.failures += 1
                member.excluded_until = now + self.exclusion.exclusion_s(member.failures)
            return [m for m in current if m.failures == self.exclusion.failures_allowed]

    def current(self, members: list[Member]) -> list[Member]:
        """The registered members of these incarnations (a lane keeps the
        ``Member`` it was formed with; one that left and came back is another).
        The caller holds the lock."""
        current = [self.by_id.get(m.actor_id) for m in members]
        return [c for c, m in zip(current, members, strict=True)
                if c is not None and c.incarnation == m.incarnation]
