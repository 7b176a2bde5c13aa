"""One rollout on its way to the replay, written the same way by the actor's
own episodes (actors/slots.py) and by harness sessions behind the recording
endpoint (actors/recording_endpoint.py).

A rollout is opened with a credit; its segments go out in index order as
they close, the newest held back, since a rollout's last segment carries
its reward and stats and, until the rollout ends, any segment may be its
last; it ends finished (the held-back segment, then the last, with the
episode's result) or abandoned (the replay drops what it holds of it and
returns the credit).

Usage::

    writer = RolloutWriter(replay_link, rollout_id, task_id)
    await writer.add(closed_segments)          # as they close
    await writer.finish(last_segment, result)  # or: await writer.abandon()

An episode hands the writer's :meth:`RolloutWriter.emit` to ``run_episode``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from actors.context import ClosedSegment
from actors.episode import EpisodeResult


class SegmentSender(Protocol):
    """Where a rollout's segments go (:class:`actors.replay_link.ReplayLink`)."""

    async def send_segment(self, rollout_id: str, task_id: str, index: int,
                           segment: ClosedSegment, result: EpisodeResult | None) -> None: ...

    async def send_abandon(self, rollout_id: str) -> None: ...


class RolloutWriter:
    def __init__(self, sender: SegmentSender, rollout_id: str, task_id: str = "") -> None:
        """``task_id``: the task played, or "" until the first segment says it
        (an episode learns its task when its environment resets)."""
        self.sender = sender
        self.rollout_id = rollout_id
        self.task_id = task_id
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

    async def abandon(self) -> None:
        """The rollout will never finish: the replay drops it and returns its credit."""
        self.held = None
        await self.sender.send_abandon(self.rollout_id)

    async def emit(self, task_id: str, segment: ClosedSegment,
                   result: EpisodeResult | None) -> None:
        """``run_episode``'s ``emit``: segments in order, the result with the last."""
        self.task_id = task_id
        if result is None:
            await self.add([segment])
        else:
            await self.finish(segment, result)

    async def _send(self, segment: ClosedSegment, result: EpisodeResult | None) -> None:
        await self.sender.send_segment(self.rollout_id, self.task_id, self.sent, segment, result)
        self.sent += 1
