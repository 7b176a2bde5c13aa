"""An actor's link to the learner's control socket: registration, the
learner's announcements, and each publication received into the running
engine (docs/protocol.md, "actor (learner link)").

``Hello`` until a ``MemberWelcome`` arrives, and again whenever the learner
forgets the actor (it restarted: ``unregistered``) or a load left the engine
on a mix of weights (its ``Hello`` reports ``NO_COMPLETE_VERSION``, and the
learner publishes again at once). Each ``WeightsAnnounce`` is queued; the
newest one waiting is applied: join its group generation if new, receive and
load the weights (generation paused meanwhile: stall ``reason="weights"`` of
each rollout in progress),
then ``WeightsLoaded``. The learner announces a publication again to an
actor that reconnects while it is under way (the first announcement may have
been lost with the old connection); one already loaded is skipped. What the
actor knows of the learner's versions is the :class:`~actors.state.LearnerView`
it shares with its replay link."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from actors.config import ActorConfig
from actors.engine import Engine, EngineHung
from actors.metrics import ActorMetrics
from actors.state import Incarnation, LearnerView
from ops.timeline import span
from protocol import (
    NO_COMPLETE_VERSION,
    EngineInfo,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    MemberWelcome,
    Message,
    ProtocolError,
    WeightManifest,
    WeightsAnnounce,
    WeightsLoaded,
)
from protocol.endpoint import ClientEndpoint
from protocol.transport import CurveConfig
from protocol.weights import nbytes_of

log = logging.getLogger("compactionrl.actor")
T = TypeVar("T")

#: How often ``leave`` looks whether the load it waits for ended (or its engine died).
LEAVE_POLL_S = 0.05
#: A join and a load each get this many of the group's deadlines (the join's
#: own, the first broadcast's, and the pause and finish around them) ...
LOAD_DEADLINES = 3
#: ... plus the publication's bytes at this rate, far below any transport's
#: (the slowest measured, gloo between two processes on this 2-core machine,
#: moves hundreds of MB/s).
SLOWEST_LOAD_BYTES_PER_S = 50e6


def load_bound_s(manifest: WeightManifest, timeout_s: float) -> float:
    """How long joining a generation, and then loading a publication of
    ``manifest``, may each take before the engine counts as hung. Every
    broadcast the engine waits for has its own deadline (``timeout_s``) and
    a generation the learner gives up is abandoned, which ends the wait at
    once; an engine that answers neither within this is stuck itself, and is
    treated as dead (the actor exits for a restart) instead of holding every
    later publication of its lane back by a deadline."""
    publication_bytes = sum(map(nbytes_of, manifest.tensors))
    return LOAD_DEADLINES * timeout_s + publication_bytes / SLOWEST_LOAD_BYTES_PER_S


class LearnerLink:
    """The learner link's handler table and its weight loading."""

    def __init__(self, link: ClientEndpoint, engine: Engine, engine_info: EngineInfo,
                 config: ActorConfig, curve: CurveConfig, weights: LearnerView,
                 metrics: ActorMetrics, incarnation: Incarnation) -> None:
        """``incarnation``: the actor's (it changes when the actor registers
        anew), whose header and token its messages carry."""
        self.link = link
        self.engine = engine
        self.engine_info = engine_info
        self.config = config
        self.curve = curve
        self.weights = weights
        self.metrics = metrics
        self.incarnation = incarnation
        self.announcements: asyncio.Queue[tuple[int, WeightsAnnounce]] = asyncio.Queue()
        """Announcements to apply, in order, with the announcing learner's incarnation."""
        self.handlers: dict[type[Message], Callable[[Any], None]] = {
            MemberWelcome: self._on_member_welcome, WeightsAnnounce: self._on_announce,
            Error: self._on_error}
        self._loading = asyncio.Lock()
        """Held while a publication is joined and loaded."""
        self.left = False
        """Said goodbye: takes no more weights and does not register again."""

    def coroutines(self, dropped: Callable[[ProtocolError], None]
                   ) -> list[Coroutine[Any, Any, None]]:
        """What runs for the link's life: its replies, its registration, the
        weight loading and the count of dropped connections."""
        return [self.link.serve(self.handlers, dropped),
                self.link.register(self._hello, self.config.hello_retry_s),
                self._apply_weights(),
                self.link.count_disconnects(self.metrics.disconnects.labels("learner").inc)]

    def forgotten(self) -> None:
        """The learner no longer knows this actor: register again."""
        if not self.left:
            self.link.forgotten()

    async def leave(self, timeout_s: float) -> None:
        """Say goodbye once no load is under way (waiting at most
        ``timeout_s``): the learner drops this actor from its next
        publication at once, instead of failing a broadcast on it when the
        process exits and waiting out its heartbeats."""
        if self._loading.locked():
            try:
                async with asyncio.timeout(max(0.0, timeout_s)):
                    # a load into an engine that died (the stop's signal reached
                    # its process too) never ends: no wait for it
                    while self._loading.locked() and not self.engine.dead:
                        await asyncio.sleep(LEAVE_POLL_S)
            except TimeoutError:
                log.warning("a weight load is under way: leaving without waiting for it")
        self.left = True
        await self.link.send(Goodbye(**self.incarnation.header()))
        self.metrics.learner_registered.set(0)

    def _hello(self) -> Hello:
        return Hello(**self.incarnation.header(), engine=self.engine_info,
                     capacity=self.config.concurrent_episodes,
                     policy_version=self.engine.version, token=self.incarnation.token)

    def _on_member_welcome(self, welcome: MemberWelcome) -> None:
        self.weights.heard(welcome.policy_version)
        self.link.welcomed()
        self.metrics.learner_registered.set(1)

    def _on_announce(self, announce: WeightsAnnounce) -> None:
        self.weights.heard(announce.version)
        self.announcements.put_nowait((announce.incarnation, announce))

    def _on_error(self, error: Error) -> None:
        self.metrics.refused("learner", error)
        if error.code == ErrorCode.UNREGISTERED:  # the learner restarted, or our connection is new
            self.forgotten()

    async def _apply_weights(self) -> None:
        """Announcements, one at a time, the newest waiting first: an older
        one's generation was given up by the learner when it announced the
        next (joining it would wait out the group timeout for nothing, and
        an actor that did so for each would never catch up)."""
        while True:
            learner_incarnation, announce = await self.announcements.get()
            superseded = 0
            while not self.announcements.empty():
                learner_incarnation, announce = self.announcements.get_nowait()
                superseded += 1
            if superseded:
                log.info("skipped %d superseded weight announcements", superseded)
            group = (learner_incarnation, announce.group.generation)
            if group == self.weights.group and announce.version <= self.engine.version:
                continue  # announced again after a reconnect, and loaded already
            bound_s = load_bound_s(announce.manifest, announce.group.timeout_s)
            try:
                async with self._loading:
                    if self.left:  # announced before the learner read the goodbye
                        continue
                    if group != self.weights.group:
                        self.weights.group = None
                        await self._bounded(self.engine.join_weight_group(
                            announce.group, self.curve), bound_s, "joining a weight group")
                        self.weights.group = group
                    with span("weights load", lane="weights", version=announce.version):
                        times = await self._bounded(self.engine.load_weights(
                            announce.version, announce.manifest, self.config.kv_on_update),
                            bound_s, f"loading version {announce.version}")
            except EngineHung:
                return  # the actor stops for a restart (its engine counts as dead)
            except Exception as exc:  # a member died, a timeout: wait for the next one
                self.weights.group = None
                self.metrics.weight_failures.inc()
                log.warning("weights of version %d not loaded: %s", announce.version, exc)
                if self.engine.version == NO_COMPLETE_VERSION:
                    # paused on a mix of weights: tell the learner (a Hello
                    # reporting it), which publishes again at once
                    self.forgotten()
                continue
            self.metrics.generation_paused(times.stall_seconds)
            self.metrics.policy_version.set(announce.version)
            self.weights.changed.set()
            log.info("loaded version %d in %.3f s (generation paused %.3f s)",
                     announce.version, times.load_seconds, times.stall_seconds)
            await self.link.send(WeightsLoaded(
                **self.incarnation.header(), version=announce.version, seconds=times.load_seconds))

    async def _bounded(self, call: Coroutine[Any, Any, T], bound_s: float, what: str) -> T:
        """``call``'s result, unless it takes longer than ``bound_s``: then the
        engine is declared hung (:meth:`Engine.declare_hung`: it counts as
        dead from then on) and :class:`EngineHung` raised. A ``TimeoutError``
        of the engine's own (a broadcast's deadline) passes as it is: the
        engine answered."""
        bound = asyncio.timeout(bound_s)
        try:
            async with bound:
                return await call
        except TimeoutError:
            if not bound.expired():
                raise
            self.engine.declare_hung(f"{what} took longer than {bound_s:.0f} s")
            raise EngineHung(what) from None
