"""A rollout's life, the same for the actor's own episodes (actors/slots.py)
and for harness sessions behind the recording endpoint
(actors/session_rollouts.py): a :class:`Rollout` spends a credit of the
replay's, begins (counted in flight, the replay told at once), writes its
segments, and ends finished or given up; it lands (leaves flight) when its
producer is done with it.

Segments go out in index order as they close, the newest held back, since a
rollout's last segment carries its reward and stats and, until the rollout
ends, any segment may be its last (:class:`RolloutWriter`). A rollout ends
finished (the held-back segment, then the last, with the episode's result)
or abandoned (the replay drops what it holds of it and returns the credit).

Usage::

    rollout = Rollout.take(actor)               # None: no credit is free
    await rollout.begin()
    await rollout.add(closed_segments)          # as they close
    await rollout.finish(last_segment, result)  # or: await rollout.abandon()
    rollout.land()                              # whatever happened since begin()

An episode hands the rollout's :meth:`RolloutWriter.emit` to ``run_episode``;
a harness session adds each call's segments and finishes with its reward
(actors/recording_endpoint.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from typing import Protocol

from actors.context import ClosedSegment
from actors.episode import EpisodeResult
from actors.metrics import ActorMetrics
from actors.replay_link import ReplayLink
from protocol import GroupTag


class SegmentSender(Protocol):
    """Where a rollout's segments go (:class:`actors.replay_link.ReplayLink`)."""

    async def send_segment(self, rollout_id: str, task_id: str, group: GroupTag | None,
                           index: int, segment: ClosedSegment, result: EpisodeResult | None
                           ) -> None: ...


class InFlight:
    """The actor's rollouts in flight, its own episodes and harness sessions
    alike: what its heartbeats report, and how each rollout is named."""

    def __init__(self, actor_id: str, incarnation: int) -> None:
        self.actor_id = actor_id
        self.incarnation = incarnation
        """The current incarnation: a new one names new rollouts."""
        self.count = 0
        self.ended = asyncio.Event()
        """Set when a rollout ends: the heartbeat task tells the replay at once
        (a start is told by the rollout itself, before it begins)."""
        self._numbers = itertools.count()

    def next_rollout(self) -> tuple[int, str]:
        """The next rollout's number (episode seeds derive from it) and id."""
        n = next(self._numbers)
        return n, f"{self.actor_id}-{self.incarnation}-{n}"

    def ours(self, rollout_id: str) -> bool:
        """The rollout was begun by the current incarnation."""
        return rollout_id.startswith(f"{self.actor_id}-{self.incarnation}-")

    def begun(self) -> None:
        self.count += 1

    def finished(self) -> None:
        self.count -= 1
        self.ended.set()


class RolloutHost(Protocol):
    """What a rollout uses of its actor (:class:`actors.process.Actor`)."""

    metrics: ActorMetrics
    replay_link: ReplayLink
    in_flight: InFlight

    async def tell_replay(self) -> None:
        """A heartbeat to the replay: a rollout that begins is told at once."""


class RolloutWriter:
    """A rollout's segments on their way to the replay, in index order."""

    def __init__(self, sender: SegmentSender, rollout_id: str, task_id: str = "") -> None:
        """``task_id``: the task played, or "" until the first segment says it
        (an episode learns its task when its environment resets)."""
        self.sender = sender
        self.rollout_id = rollout_id
        self.task_id = task_id
        self.group: GroupTag | None = None
        """The group it belongs to (its actor's episodes with ``group_size`` > 1)."""
        self.sent = 0
        """Segments sent so far (the next one's index)."""
        self.held: ClosedSegment | None = None
        """The newest closed segment, not sent until another closes or the rollout finishes."""

    @property
    def empty(self) -> bool:
        """Nothing closed yet: the rollout cannot finish, only be abandoned."""
        return self.sent == 0 and self.held is None

    async def add(self, closed: Iterable[ClosedSegment]) -> None:
        """Segments that closed, in order: each sends the one held before it."""
        for segment in closed:
            if self.held is not None:
                await self._send(self.held, None)
            self.held = segment

    async def finish(self, last: ClosedSegment | None, result: EpisodeResult) -> None:
        """The rollout ends with ``result``: ``last`` (None: the held-back
        segment is the last) carries its reward and stats."""
        if last is not None:
            await self.add([last])
        if self.held is None:
            raise ValueError(f"rollout {self.rollout_id} has no segment to finish with")
        final, self.held = self.held, None
        await self._send(final, result)

    async def emit(self, task_id: str, segment: ClosedSegment,
                   result: EpisodeResult | None) -> None:
        """``run_episode``'s ``emit``: segments in order, the result with the last."""
        self.task_id = task_id
        if result is None:
            await self.add([segment])
        else:
            await self.finish(segment, result)

    async def _send(self, segment: ClosedSegment, result: EpisodeResult | None) -> None:
        await self.sender.send_segment(self.rollout_id, self.task_id, self.group, self.sent,
                                       segment, result)
        self.sent += 1


class Rollout(RolloutWriter):
    """One rollout of the actor's, from the credit it spends to its last
    segment or its abandonment, its segments written to the replay link."""

    def __init__(self, host: RolloutHost, number: int, rollout_id: str) -> None:
        """``number``: the rollout's in the actor's count (seeds derive from it)."""
        super().__init__(host.replay_link, rollout_id)
        self.host = host
        self.number = number

    @classmethod
    def take(cls, host: RolloutHost) -> Rollout | None:
        """A new rollout, named, on one of the replay's credits, spent now;
        None when none is free. The credit is the rollout's for good unless
        it is abandoned (the replay returns it then)."""
        credits = host.replay_link.credits
        if not credits.spend():
            return None
        host.metrics.credits_held.set(credits.credits)
        return cls(host, *host.in_flight.next_rollout())

    async def begin(self) -> None:
        """In flight from now: counted, and the replay told at once, before
        anything else can run (a weight load may hold the event loop for
        seconds, and the heartbeat task with it)."""
        self.host.in_flight.begun()
        self.host.metrics.rollout_begun()
        await self.host.tell_replay()

    def land(self) -> None:
        """Its producer is done with it (finished, abandoned, or left for the
        actor to give up): no longer in flight, which the heartbeat tells."""
        self.host.metrics.rollout_landed()
        self.host.in_flight.finished()

    async def abandon(self) -> None:
        """The rollout will never finish: the replay drops it and returns its
        credit. One of an incarnation already declared dead is not told:
        the replay expired it."""
        if self.host.in_flight.ours(self.rollout_id):
            await self.host.replay_link.send_abandon(self.rollout_id, self.group)
