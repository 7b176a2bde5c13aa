"""The rollouts of harness sessions, as the recording endpoint opens and
closes them (its :class:`~actors.recording_endpoint.SessionHost`): a session
starts like one of the actor's own episodes, with weights fresh enough and a
credit, or is refused (429: the harness retries); its rollout then lives as
an episode's does (:class:`actors.rollout_writer.Rollout`), the session
writing its segments with it, and a session that ends without a reward gives
it up."""

from __future__ import annotations

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.engine import Engine
from actors.recording_endpoint import EndpointError
from actors.rollout_writer import Rollout
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

    async def open_rollout(self) -> Rollout:
        """A session's rollout, begun like an episode's: with weights fresh
        enough and a credit, or refused (429, the harness retries)."""
        if self.host.stopping.is_set():
            raise EndpointError(503, "stopping", "the actor is stopping")
        if not self.host.weights_fresh():
            raise EndpointError(429, "weights_behind", "the actor's weights are more than "
                                "max_staleness versions behind the learner's: retry shortly")
        rollout = Rollout.take(self.host)
        if rollout is None:
            raise EndpointError(429, "no_credit", "no rollout credit is free: retry shortly")
        try:
            await rollout.begin()
        except BaseException:
            # Cancelled (the harness went away) or failed while the replay was
            # told: no session holds the rollout to close it, so it is given
            # up here, its place in flight and its credit returned.
            await self.close_rollout(rollout, abandoned=True)
            raise
        return rollout

    async def close_rollout(self, rollout: Rollout, abandoned: bool) -> None:
        """A session ended; ``abandoned``: without a reward, so the replay
        drops the rollout and returns its credit."""
        rollout.land()
        if abandoned:
            self.metrics.abandoned_rollouts.inc()
            await rollout.abandon()
