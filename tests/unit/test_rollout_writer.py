"""A rollout's life, the same for episodes and harness sessions
(actors/rollout_writer.py): it spends a credit, begins (in flight, the replay
told at once) and lands; its segments leave in index order, the newest held
back until another closes or the rollout finishes, the last one with the
result; or it is given up."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from actors.config import ActorConfig
from actors.context import ClosedSegment
from actors.episode import EpisodeResult
from actors.metrics import ActorMetrics
from actors.recording_endpoint import EndpointError
from actors.rollout_writer import InFlight, Rollout, RolloutWriter
from actors.session_rollouts import SessionRollouts
from actors.slots import EpisodeSlots
from actors.state import CreditAccount, LearnerView
from protocol import GroupTag


class Sender:
    """The replay link as rollouts use it: segments and abandons sent, and credits."""

    def __init__(self) -> None:
        self.credits = CreditAccount()
        self.sent: list[tuple[str, str, int, str, EpisodeResult | None]] = []
        self.abandoned: list[str] = []

    async def send_segment(self, rollout_id: str, task_id: str, group: GroupTag | None,
                           index: int, segment: ClosedSegment, result: EpisodeResult | None
                           ) -> None:
        self.sent.append((rollout_id, task_id, index, segment.segment_type, result))

    async def send_abandon(self, rollout_id: str, group: GroupTag | None) -> None:
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


def test_a_rollout_with_no_segment_cannot_finish() -> None:
    sender = Sender()
    writer = RolloutWriter(sender, "r", "task")
    assert writer.empty
    with pytest.raises(ValueError, match="no segment"):
        asyncio.run(writer.finish(None, result()))
    assert sender.sent == []


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


class Host:
    """An actor as its rollouts, episode slots and sessions use it; its
    weights are always fresh unless told otherwise."""

    def __init__(self, credits: int) -> None:
        self.metrics = ActorMetrics()
        self.replay_link = Sender()
        self.replay_link.credits.grant(ledger=1, credits_total=credits, credits=credits)
        self.in_flight = InFlight("actor", 1)
        self.weights = LearnerView()
        self.stopping = asyncio.Event()
        self.fresh = True
        self.told: list[int] = []
        """The rollouts in flight as each heartbeat told the replay."""

    def weights_fresh(self) -> bool:
        return self.fresh

    async def tell_replay(self) -> None:
        self.told.append(self.in_flight.count)

    def sample(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(name) or 0.0


def test_a_rollout_spends_a_credit_is_told_as_it_begins_and_lands_once_done() -> None:
    host = Host(credits=1)
    rollout = Rollout.take(host)
    assert rollout is not None and (rollout.number, rollout.rollout_id) == (0, "actor-1-0")
    assert host.replay_link.credits.credits == 0 and host.sample("crl_actor_credits_held") == 0
    assert Rollout.take(host) is None  # no credit: nothing named, nothing counted
    asyncio.run(rollout.begin())
    assert host.told == [1] and host.sample("crl_actor_active_rollouts") == 1
    asyncio.run(rollout.emit("task-3", closed("execution"), result()))
    assert [s[:3] for s in host.replay_link.sent] == [("actor-1-0", "task-3", 0)]
    rollout.land()
    assert host.in_flight.count == 0 and host.in_flight.ended.is_set()
    assert host.sample("crl_actor_active_rollouts") == 0
    host.replay_link.credits.grant(ledger=1, credits_total=2, credits=1)
    assert Rollout.take(host).rollout_id == "actor-1-1"  # type: ignore[union-attr]


def test_a_rollout_given_up_is_told_unless_its_incarnation_was_declared_dead() -> None:
    host = Host(credits=2)
    first, second = Rollout.take(host), Rollout.take(host)
    assert first is not None and second is not None
    asyncio.run(first.abandon())
    host.in_flight.incarnation = 2  # the replay expired the old incarnation's rollouts
    asyncio.run(second.abandon())
    assert host.replay_link.abandoned == ["actor-1-0"]


def test_a_session_starts_like_an_episode_or_is_refused_and_nothing_is_spent() -> None:
    host = Host(credits=0)
    sessions = SessionRollouts(ActorConfig(), None, None, host)  # type: ignore[arg-type]

    def refused() -> str:
        with pytest.raises(EndpointError) as error:
            asyncio.run(sessions.open_rollout())
        return f"{error.value.status} {error.value.reason}"

    assert refused() == "429 no_credit"
    host.fresh = False
    assert refused() == "429 weights_behind"
    host.stopping.set()
    assert refused() == "503 stopping"
    assert host.told == [] and host.in_flight.count == 0
    host.stopping.clear()
    host.fresh = True
    host.replay_link.credits.grant(ledger=1, credits_total=1, credits=1)
    assert asyncio.run(sessions.open_rollout()).rollout_id == "actor-1-0"  # the first named


async def _session(host: Host, abandoned: bool) -> str:
    sessions = SessionRollouts(ActorConfig(), None, None, host)  # type: ignore[arg-type]
    rollout = await sessions.open_rollout()
    assert host.told == [1] and host.sample("crl_actor_active_rollouts") == 1
    await sessions.close_rollout(rollout, abandoned)
    return rollout.rollout_id


class _Environment:
    async def close(self) -> None:
        pass


async def _episode(host: Host, monkeypatch: pytest.MonkeyPatch, engine_dead: bool) -> str:
    """One episode whose turn fails; the slot ends once the actor stops."""
    monkeypatch.setattr("actors.slots.load_environment", lambda *_: _Environment())
    engine = SimpleNamespace(dead=engine_dead)
    slots = EpisodeSlots(ActorConfig(), 0, engine, None, host)  # type: ignore[arg-type]

    playing: list[tuple[list[int], float]] = []

    async def play(*_: object) -> None:
        playing.append((list(host.told), host.sample("crl_actor_active_rollouts")))
        raise RuntimeError("the engine's turn failed")

    slots._play = play  # type: ignore[method-assign]
    slots.start(1)
    while host.in_flight.count or not host.told:
        await asyncio.sleep(0.01)
    host.stopping.set()
    await asyncio.gather(*slots.tasks)
    assert playing == [([1], 1.0)]  # begun and told before the episode played
    assert list(slots.open_rollouts) == (["actor-1-0"] if engine_dead else [])
    if engine_dead:  # the actor's watcher gives it up
        await slots.give_up()
    return "actor-1-0"


@pytest.mark.parametrize("producer", ["session", "episode", "episode of a dead engine"])
def test_both_producers_give_a_rollout_up_alike(producer: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host(credits=1)
    if producer == "session":
        rollout_id = asyncio.run(_session(host, abandoned=True))
    else:
        rollout_id = asyncio.run(asyncio.wait_for(
            _episode(host, monkeypatch, engine_dead=producer != "episode"), 30))
    assert host.replay_link.credits.credits == 0 and host.replay_link.sent == []
    assert host.in_flight.count == 0 and host.sample("crl_actor_active_rollouts") == 0
    assert host.replay_link.abandoned == [rollout_id]
    assert host.sample("crl_actor_abandoned_rollouts_total") == 1


def test_a_rewarded_session_lands_and_gives_nothing_up() -> None:
    host = Host(credits=1)
    asyncio.run(_session(host, abandoned=False))
    assert host.in_flight.count == 0 and host.sample("crl_actor_active_rollouts") == 0
    assert host.replay_link.abandoned == []
    assert host.sample("crl_actor_abandoned_rollouts_total") == 0


def test_an_episode_cancelled_as_its_engine_dies_is_counted_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The actor's watcher gives up first: the slot's cancel() counts the
    episode, whose cancellation the dead engine turns into an error."""
    host = Host(credits=1)
    monkeypatch.setattr("actors.slots.load_environment", lambda *_: _Environment())
    engine = SimpleNamespace(dead=False)
    slots = EpisodeSlots(ActorConfig(), 0, engine, None, host)  # type: ignore[arg-type]

    async def play(*_: object) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            engine.dead = True
            raise RuntimeError("aborting the request met a dead engine") from None

    slots._play = play  # type: ignore[method-assign]

    async def die() -> None:
        slots.start(1)
        while not host.told:
            await asyncio.sleep(0.01)
        await slots.give_up()

    asyncio.run(asyncio.wait_for(die(), 30))
    assert host.replay_link.abandoned == ["actor-1-0"] and host.in_flight.count == 0
    assert host.sample("crl_actor_abandoned_rollouts_total") == 1


def test_a_session_cancelled_while_it_opens_gives_its_rollout_back() -> None:
    host = Host(credits=1)
    sessions = SessionRollouts(ActorConfig(), None, None, host)  # type: ignore[arg-type]
    telling = asyncio.Event()

    async def tell_replay() -> None:  # the heartbeat held up until the harness goes away
        telling.set()
        await asyncio.Event().wait()

    host.tell_replay = tell_replay  # type: ignore[method-assign]

    async def open_and_cancel() -> None:
        opening = asyncio.create_task(sessions.open_rollout())
        await telling.wait()
        assert host.in_flight.count == 1 and host.sample("crl_actor_active_rollouts") == 1
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening

    asyncio.run(asyncio.wait_for(open_and_cancel(), 30))
    assert host.in_flight.count == 0 and host.in_flight.ended.is_set()
    assert host.sample("crl_actor_active_rollouts") == 0
    assert host.replay_link.abandoned == ["actor-1-0"]  # the replay returns its credit
    assert host.sample("crl_actor_abandoned_rollouts_total") == 1
