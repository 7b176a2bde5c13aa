"""The rollouts of harness sessions, as the recording endpoint opens and
closes them (its :class:`~actors.recording_endpoint.SessionHost`): a session
starts like one of the actor's own episodes, with weights fresh enough and a
credit, or is refused (429: the harness retries); it counts in flight, the
replay is told at once, and a session that ends without a reward gives its
rollout up."""

from __future__ import annotations

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.engine import Engine
from actors.recording_endpoint import EndpointError
from actors.replay_link import ReplayLink
from actors.slots import EpisodeHost


class SessionRollouts:
    def __init__(self, config: ActorConfig, chat: ChatFormat, engine: Engine,
                 host: EpisodeHost) -> None:
        """``host``: the actor, as its episode slots see it (its credits,
        weights, rollouts in flight, and whether it is stopping)."""
        self.config = config
        self.chat = chat
        self.policy = engine
        self.host = host
        self.metrics = host.metrics

    @property
    def segments(self) -> ReplayLink:
        """Where a session's rollout goes (its :class:`RolloutWriter`)."""
        return self.host.replay_link

    async def open_rollout(self) -> str:
        """A session's rollout, started like an episode: with weights fresh
        enough and a credit, or refused (429, the harness retries)."""
        host, credits = self.host, self.host.replay_link.credits
        if host.stopping.is_set():
            raise EndpointError(503, "stopping", "the actor is stopping")
        if not host.weights_fresh():
            raise EndpointError(429, "weights_behind", "the actor's weights are more than "
                                "max_staleness versions behind the learner's: retry shortly")
        if not credits.spend():
            raise EndpointError(429, "no_credit", "no rollout credit is free: retry shortly")
        self.metrics.credits_held.set(credits.credits)
        host.in_flight.begun()
        self.metrics.active_rollouts.inc()
        await host.tell_replay()
        return host.in_flight.next_rollout()[1]

    async def close_rollout(self, rollout_id: str, abandoned: bool) -> None:
        """A session ended; ``abandoned``: without a reward, so the replay
        drops the rollout and returns its credit. A rollout of an incarnation
        already declared dead is not told: the replay expired it."""
        self.host.in_flight.finished()
        self.metrics.active_rollouts.dec()
        if abandoned:
            self.metrics.abandoned_rollouts.inc()
            if self.host.in_flight.ours(rollout_id):
                await self.host.replay_link.send_abandon(rollout_id)
