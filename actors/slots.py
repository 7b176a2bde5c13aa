"""An actor's own episodes: ``concurrent_episodes`` slots, each starting an
episode whenever the engine's weights are fresh enough and a credit is free,
until the actor stops. Each episode's rollout lives as a harness session's
does (:class:`actors.rollout_writer.Rollout`).

Usage::

    slots = EpisodeSlots(config, run_seed, engine, chat, actor)  # actor: an EpisodeHost
    slots.start(config.concurrent_episodes)
    slots.cancel()            # stopping, or declared dead: episodes in flight end
    await slots.give_up()     # the engine died: the replay drops what is open
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections.abc import Iterator
from typing import Protocol

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import Generation
from actors.engine import Engine
from actors.envs.base import Environment, load_environment
from actors.episode import GeneratingPolicy, run_episode
from actors.metrics import StallSeconds
from actors.rollout_writer import Rollout, RolloutHost
from actors.state import LearnerView
from ops.timeline import set_lane, span
from protocol import GroupTag

log = logging.getLogger("compactionrl.actor")


def training_seed(run_seed: int, actor_id: str, incarnation: int, n: int) -> int:
    """Episode seed, in [0, EVALUATION_SEEDS_FROM): distinct across actors,
    incarnations and episodes."""
    digest = hashlib.blake2b(f"{run_seed}/{actor_id}/{incarnation}/{n}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


def _cancelled() -> bool:
    """The current task was cancelled, though it may end by another error
    (an engine request aborted as it is cancelled can fail in turn, the
    engine dead)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class SummaryStall:
    """The engine writing an episode's summaries, each counted as the
    episode's stall while it is written, as its waits before it are: added
    when the episode ended, its summaries landed whole in one window of the
    views, whose stall share of slot time then read over 100 %."""

    def __init__(self, engine: GeneratingPolicy, stall: StallSeconds) -> None:
        self.engine = engine
        self.stall = stall

    async def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                       temperature: float | None = None) -> Generation:
        with self.stall.waiting("summary", marked=False):  # the episode marks it, with its tokens
            return await self.engine.generate(prompt, max_tokens, seed, temperature)


class EpisodeHost(RolloutHost, Protocol):
    """What the slots use of their actor (:class:`actors.process.Actor`):
    what its rollouts use, and when an episode may start."""

    weights: LearnerView
    """What the actor knows of the learner's versions: its ``changed`` event
    wakes a slot waiting for fresh weights."""
    stopping: asyncio.Event

    def weights_fresh(self) -> bool:
        """Generating now gives tokens the replay accepts."""


class EpisodeSlots:
    def __init__(self, config: ActorConfig, run_seed: int, engine: Engine, chat: ChatFormat,
                 host: EpisodeHost) -> None:
        self.config = config
        self.run_seed = run_seed
        self.engine = engine
        self.chat = chat
        self.host = host
        self.metrics = host.metrics
        self.replay_link = host.replay_link
        self.in_flight = host.in_flight
        self.tasks: list[asyncio.Task] = []
        self.playing = 0
        """The actor's own episodes under way (harness sessions are not)."""
        self.open_rollouts: dict[str, Rollout] = {}
        """The rollouts of this incarnation's own episodes begun and not yet
        finished (final segment sent) nor given up, by id."""
        self._counting: tuple[int, Iterator[int]] = -1, itertools.count()
        """(incarnation, the count of its own episodes)."""

    def start(self, count: int) -> None:
        self.tasks = [asyncio.create_task(self._slot(k)) for k in range(count)]

    def cancel(self) -> None:
        """Cancel the episodes in flight (their engine requests are aborted),
        counted as abandoned; harness sessions are the endpoint's to count."""
        self.metrics.abandoned_rollouts.inc(self.playing)
        for task in self.tasks:
            task.cancel()

    async def give_up(self) -> None:
        """The engine died: end the episodes, then tell the replay that their
        rollouts are given up (after their tasks are done, so that no
        segment follows an ``Abandon``)."""
        self.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for rollout_id in sorted(self.open_rollouts):
            await self.open_rollouts[rollout_id].abandon()

    async def _slot(self, number: int) -> None:
        set_lane(f"slot {number}")  # this task's spans: its episodes and their waits
        environment = load_environment(self.config.environment.factory,
                                       self.config.environment.options)
        try:
            while (rollout := await self._take_credit()) is not None:
                if not await self._episode(environment, rollout):
                    return
        finally:
            await environment.close()

    async def _episode(self, environment: Environment, rollout: Rollout) -> bool:
        """One episode, its rollout finished or given up; False once the engine
        is dead (the slot ends)."""
        size = self.config.group_size
        group = self._episode_number() // size
        if size > 1:
            rollout.group = GroupTag(id=f"group-{group}", size=size)
        task_seed, sampling_seed = (
            training_seed(self.run_seed, self.in_flight.actor_id, self.in_flight.incarnation,
                          number)
            for number in (group, rollout.number))
        self.playing += 1
        self.open_rollouts[rollout.rollout_id] = rollout
        try:
            await rollout.begin()
            with span("episode", rollout=rollout.rollout_id):
                await self._play(environment, rollout, task_seed, sampling_seed)
        except Exception as exc:  # a turn failed (the engine's): the episode cannot go on
            if not _cancelled():  # else cancel() counted it as it cancelled it
                self.metrics.abandoned_rollouts.inc()
            if self.engine.dead:
                return False  # the actor's watcher gives the rollout up and stops it
            log.error("episode %s given up: %r", rollout.rollout_id, exc)
            self.open_rollouts.pop(rollout.rollout_id, None)
            await rollout.abandon()
        finally:
            self.playing -= 1
            rollout.land()
        return True

    def _episode_number(self) -> int:
        """The episode's number among the incarnation's own, from 0: groups
        are consecutive episodes (a harness session's rollout takes no
        number here, so it splits no group)."""
        if self._counting[0] != self.in_flight.incarnation:
            self._counting = self.in_flight.incarnation, itertools.count()
        return next(self._counting[1])

    async def _take_credit(self) -> Rollout | None:
        """Wait for weights fresh enough and a credit, and spend it on a new
        rollout; None once the actor is stopping. Each wait counts as stall
        while it lasts."""
        with self.metrics.stall_seconds.waiting("weights"):
            while not self.host.weights_fresh() and not self.host.stopping.is_set():
                await self._until(self.host.weights.changed)
        rollout = None
        with self.metrics.stall_seconds.waiting("credits"):
            while (not self.host.stopping.is_set()
                   and (rollout := Rollout.take(self.host)) is None):
                await self._until(self.replay_link.credits.available)
        return rollout

    async def _until(self, event: asyncio.Event) -> None:
        """Clear ``event`` and wait until it is set again or the actor stops."""
        event.clear()
        woken = asyncio.create_task(event.wait())
        stop = asyncio.create_task(self.host.stopping.wait())
        await asyncio.wait([woken, stop], return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        stop.cancel()

    async def _play(self, environment: Environment, rollout: Rollout, seed: int,
                    sampling_seed: int) -> None:
        result = await run_episode(self.engine, environment, self.chat, self.config, seed,
                                   rollout.emit, sampling_seed=sampling_seed,
                                   summariser=SummaryStall(self.engine, self.metrics.stall_seconds))
        self.open_rollouts.pop(rollout.rollout_id, None)  # finished: nothing left to give up
        self.metrics.episode_finished(result.reward, result.stats, result.observations_cut,
                                      result.tool_call_errors)
