"""One rollout writer for episodes and harness sessions (actors/rollout_writer.py):
segments leave in index order, the newest held back until another closes or
the rollout finishes, the last one with the result; or the rollout is abandoned."""

from __future__ import annotations

import asyncio

import pytest

from actors.context import ClosedSegment
from actors.episode import EpisodeResult
from actors.rollout_writer import RolloutWriter


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, int, str, EpisodeResult | None]] = []
        self.abandoned: list[str] = []

    async def send_segment(self, rollout_id: str, task_id: str, index: int,
                           segment: ClosedSegment, result: EpisodeResult | None) -> None:
        self.sent.append((rollout_id, task_id, index, segment.segment_type, result))

    async def send_abandon(self, rollout_id: str) -> None:
        self.abandoned.append(rollout_id)


def closed(kind: str) -> ClosedSegment:
    return ClosedSegment(segment_type=kind, tokens=[1, 2], loss_mask=[0, 1],
                         logprobs=[0.0, -1.0], versions=[-1, 0])


def result() -> EpisodeResult:
    return EpisodeResult.of("task", "done", 1.0, True, steps=2, compactions=1,
                            generated_tokens=2, summary_tokens=1, duration_s=0.5, tags={},
                            summary_seconds=0.1)


def test_the_newest_segment_waits_until_another_closes_and_the_last_carries_the_result(
        ) -> None:
    sender = Sender()
    writer = RolloutWriter(sender, "r", "task")
    done = result()

    async def write() -> None:
        await writer.add([closed("execution"), closed("summary")])
        assert [s[3] for s in sender.sent] == ["execution"]  # the summary waits
        await writer.finish(closed("execution"), done)

    asyncio.run(write())
    assert sender.sent == [("r", "task", 0, "execution", None),
                           ("r", "task", 1, "summary", None),
                           ("r", "task", 2, "execution", done)]
    assert writer.sent == 3 and writer.held is None


def test_a_session_finishes_with_the_segment_it_held_back() -> None:
    sender = Sender()
    writer = RolloutWriter(sender, "r", "task")
    done = result()
    asyncio.run(writer.add([closed("execution")]))
    asyncio.run(writer.finish(None, done))
    assert sender.sent == [("r", "task", 0, "execution", done)]


def test_a_rollout_with_no_segment_cannot_finish_only_be_abandoned() -> None:
    sender = Sender()
    writer = RolloutWriter(sender, "r", "task")
    assert writer.empty
    with pytest.raises(ValueError, match="no segment"):
        asyncio.run(writer.finish(None, result()))
    asyncio.run(writer.abandon())
    assert sender.abandoned == ["r"] and sender.sent == []


def test_an_episode_s_emit_learns_its_task_and_ends_with_the_result() -> None:
    sender = Sender()
    writer = RolloutWriter(sender, "r")
    done = result()

    async def episode() -> None:
        await writer.emit("task-7", closed("execution"), None)
        await writer.emit("task-7", closed("summary"), None)
        await writer.emit("task-7", closed("execution"), done)

    asyncio.run(episode())
    assert [(s[1], s[2], s[4]) for s in sender.sent] == [
        ("task-7", 0, None), ("task-7", 1, None), ("task-7", 2, done)]
