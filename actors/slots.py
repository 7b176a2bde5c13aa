"""An actor's own episodes: ``concurrent_episodes`` slots, each starting an
episode whenever the engine's weights are fresh enough and a credit is free,
until the actor stops; and the count of rollouts in flight, which its own
episodes and a harness's sessions (actors/recording_endpoint.py) share.

Usage::

    slots = EpisodeSlots(config, run_seed, engine, chat, metrics, replay_link, in_flight,
                         weights, weights_fresh, stopping, tell_replay)
    slots.start(config.concurrent_episodes)
    slots.cancel()            # stopping, or declared dead: episodes in flight end
    await slots.give_up()     # the engine died: the replay drops what is open
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from typing import Protocol

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.engine import Engine
from actors.envs.base import Environment, load_environment
from actors.episode import run_episode
from actors.metrics import ActorMetrics
from actors.replay_link import ReplayLink
from actors.rollout_writer import RolloutWriter
from actors.state import LearnerView
from ops.timeline import set_lane, span

log = logging.getLogger("compactionrl.actor")


def training_seed(run_seed: int, actor_id: str, incarnation: int, n: int) -> int:
    """Episode seed, in [0, EVALUATION_SEEDS_FROM): distinct across actors,
    incarnations and episodes."""
    digest = hashlib.blake2b(f"{run_seed}/{actor_id}/{incarnation}/{n}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


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


class EpisodeHost(Protocol):
    """What the slots use of their actor (:class:`actors.process.Actor`)."""

    metrics: ActorMetrics
    replay_link: ReplayLink
    in_flight: InFlight
    weights: LearnerView
    """What the actor knows of the learner's versions: its ``changed`` event
    wakes a slot waiting for fresh weights."""
    stopping: asyncio.Event

    def weights_fresh(self) -> bool:
        """Generating now gives tokens the replay accepts."""

    async def tell_replay(self) -> None:
        """A heartbeat to the replay: an episode that starts is told at once."""


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
        self.open_rollouts: set[str] = set()
        """The rollouts of this incarnation's own episodes begun and not yet
        finished (final segment sent) nor given up."""

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
            await self.replay_link.send_abandon(rollout_id)

    async def _slot(self, number: int) -> None:
        set_lane(f"slot {number}")  # this task's spans: its episodes and their waits
        environment = load_environment(self.config.environment.factory,
                                       self.config.environment.options)
        try:
            while await self._take_credit():
                if not await self._episode(environment):
                    return
        finally:
            await environment.close()

    async def _episode(self, environment: Environment) -> bool:
        """One episode, its rollout sent or given up; False once the engine
        is dead (the slot ends)."""
        n, rollout_id = self.in_flight.next_rollout()
        task_seed, sampling_seed = (
            training_seed(self.run_seed, self.in_flight.actor_id, self.in_flight.incarnation,
                          number)
            for number in (n // self.config.group_size, n))
        writer = RolloutWriter(self.replay_link, rollout_id)
        self.in_flight.begun()
        self.playing += 1
        self.open_rollouts.add(rollout_id)
        try:
            # queued before anything else can run: a weight load may hold
            # the event loop for seconds, and the heartbeat task with it
            await self.host.tell_replay()
            self.metrics.active_rollouts.inc()
            try:
                with span("episode", rollout=rollout_id):
                    await self._play(environment, writer, task_seed, sampling_seed)
            finally:
                self.metrics.active_rollouts.dec()
        except Exception as exc:  # a turn failed (the engine's): the episode cannot go on
            if self.engine.dead:
                return False  # the actor's watcher gives the rollout up and stops it
            log.error("episode %s given up: %r", rollout_id, exc)
            self.metrics.abandoned_rollouts.inc()
            self.open_rollouts.discard(rollout_id)
            await writer.abandon()
        finally:
            self.playing -= 1
            self.in_flight.finished()
        return True

    async def _take_credit(self) -> bool:
        """Wait for weights fresh enough and a credit, and spend it; False once
        the actor is stopping. Each wait counts as stall while it lasts."""
        with self.metrics.stall_seconds.waiting("weights"):
            while not self.host.weights_fresh() and not self.host.stopping.is_set():
                await self._until(self.host.weights.changed)
        credits = self.replay_link.credits
        with self.metrics.stall_seconds.waiting("credits"):
            while not self.host.stopping.is_set() and not credits.spend():
                await self._until(credits.available)
        self.metrics.credits_held.set(credits.credits)
        return not self.host.stopping.is_set()

    async def _until(self, event: asyncio.Event) -> None:
        """Clear ``event`` and wait until it is set again or the actor stops."""
        event.clear()
        woken = asyncio.create_task(event.wait())
        stop = asyncio.create_task(self.host.stopping.wait())
        await asyncio.wait([woken, stop], return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        stop.cancel()

    async def _play(self, environment: Environment, writer: RolloutWriter, seed: int,
                    sampling_seed: int) -> None:
        result = await run_episode(self.engine, environment, self.chat, self.config, seed,
                                   writer.emit, sampling_seed=sampling_seed)
        self.open_rollouts.discard(writer.rollout_id)  # finished: nothing left to give up
        self.metrics.episode_finished(result.reward, result.stats, result.summary_seconds,
                                      result.observations_cut, result.tool_call_errors)
