"""The actor process: concurrent episodes on one engine, segments to the
replay. The messages it exchanges are in docs/protocol.md ("actor (replay
link)", "actor (learner link)"); the two links are
:class:`actors.replay_link.ReplayLink` and
:class:`actors.learner_link.LearnerLink`, its own episodes
:class:`actors.slots.EpisodeSlots`. What this module decides:

- ``Heartbeat`` every ``heartbeat_interval_s``, and at once whenever an
  episode starts or ends: it carries the episodes in flight, which the replay
  counts as lost if this process dies (a periodic report alone would miss
  those started since the last one).
- If the replay answers ``dead_incarnation`` (this process was frozen or
  starved past the liveness, so the replay declared it dead and expired its
  rollouts), the actor abandons its episodes in flight and their
  unacknowledged segments and registers as a new incarnation, its seqs
  continuing the old ones: nothing of the dead incarnation counts twice. The
  replay's word decides, not the actor's own sense of a gap: only the replay
  knows whether it declared the actor dead.
- No episode starts while the engine's weights are more than
  ``max_staleness`` versions behind the learner (stall ``reason="weights"``).
- With ``actors.endpoint.enabled`` the actor runs no episodes of its own: an
  agent harness drives its engine through the recording endpoint
  (actors/recording_endpoint.py, docs/endpoint.md), each harness session one
  rollout, started with a credit like an episode.
- On SIGTERM: no new episode; in-flight ones are abandoned or finished
  (``on_shutdown``); unacknowledged segments are flushed until
  ``shutdown_deadline_s``. Then ``Goodbye``, to the learner once no weight
  load is under way and to the replay last: the learner drops the actor
  from its next publication and the replay hands its credits to the other
  actors at once, instead of both waiting out its heartbeats. Exit code 0
  only if every segment was acknowledged.
- When the engine dies (vLLM's engine core exited; the actor's process goes
  on without it): the rollouts in flight are given up (``Abandon``, so the
  replay drops them at once), unacknowledged segments are flushed and
  goodbyes said as on SIGTERM, and the process exits with
  ``ENGINE_DIED_EXIT`` for its supervisor to restart it.
- When one of its loops raises (a link's replies, its registration, resends,
  heartbeats, weight loading), the actor stops as on SIGTERM and exits with
  ``LOOP_FAILED_EXIT``, the cause in its log: running on without the loop
  would leave it deaf or silent to a peer, unseen.

Usage::

    exit_code = asyncio.run(run_actor(settings))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.engine import Engine
from actors.learner_link import LearnerLink
from actors.metrics import ActorMetrics
from actors.preflight import check_episode_setup
from actors.recording_endpoint import RecordingEndpoint, serve_until
from actors.replay_link import ReplayLink
from actors.rollout_writer import InFlight
from actors.session_rollouts import SessionRollouts
from actors.slots import EpisodeSlots
from actors.state import Incarnation, LearnerView
from ops.metrics import Health, MetricsServer, PortInUse, port_in_use
from protocol import EngineInfo, Heartbeat, ProtocolError
from protocol.endpoint import ClientEndpoint
from protocol.transport import TransportConfig, advertised_address, connect_dealer
from protocol.weights import GROUP_TIMEOUT_S

log = logging.getLogger("compactionrl.actor")

#: How often the actor looks whether its engine still runs: vLLM marks it
#: dead within a second of its engine core's exit.
ENGINE_CHECK_S = 1.0
#: The exit code of an actor whose engine died.
ENGINE_DIED_EXIT = 3
#: How long closing a link may take to send what is queued on it (the
#: goodbyes): a peer that is gone must not hold the exit up.
GOODBYE_LINGER_MS = 1000
#: The exit code of an actor one of whose loops (a link's replies, its
#: registration, resends, heartbeats, weight loading) raised.
LOOP_FAILED_EXIT = 4


@dataclass
class ActorSettings:
    """Everything one actor process needs; ``deploy`` builds it from the run config."""

    actor_id: str
    model: str
    replay_address: str
    actor: ActorConfig
    transport: TransportConfig
    learner_address: str | None = None
    """The learner's control socket; None: never take weight updates."""
    run_seed: int = 0
    index: int = 0
    """Position among the actors of a launcher (offsets the metrics port and engine seed)."""
    weight_timeout_s: float = GROUP_TIMEOUT_S
    """The run's ``learner.weight_timeout_s``: the engine's process starts
    with what its weight group's deadlines need (torch reads it once)."""

    @property
    def metrics_port(self) -> int:
        """Its Prometheus port: ``actors.metrics_port + index`` (0: not served)."""
        return self.actor.metrics_port + self.index if self.actor.metrics_port else 0


async def run_actor(settings: ActorSettings) -> int:
    """The actor process: start the engine, connect the links, run until
    SIGTERM; the exit code of :meth:`Actor.run`."""
    config = settings.actor
    # fail fast, before the engine's slow start, if an episode cannot run or
    # its metrics port is another process's
    await check_episode_setup(settings.model, config)
    if settings.metrics_port and port_in_use(settings.transport.metrics_address,
                                             settings.metrics_port):
        raise PortInUse(settings.metrics_port, settings.transport.metrics_address)
    engine = await Engine.start(settings.model, config.engine, config.sampling,
                                seed_offset=settings.index,
                                weight_timeout_s=(settings.weight_timeout_s
                                                  if settings.learner_address is not None
                                                  else None))
    kv_tokens = engine.kv_tokens()
    if shortfall := config.kv_shortfall(kv_tokens):
        log.warning("%s", shortfall)
    else:
        log.info("the engine's KV cache holds %d tokens: %d episodes' full windows of %d",
                 kv_tokens, kv_tokens // config.window_tokens(), config.window_tokens())
    context = zmq.asyncio.Context()
    max_bytes = settings.transport.max_message_bytes
    replay = ClientEndpoint(connect_dealer(context, settings.replay_address, settings.transport),
                            max_bytes)
    learner = (ClientEndpoint(connect_dealer(context, settings.learner_address,
                                             settings.transport), max_bytes)
               if settings.learner_address else None)
    try:
        return await Actor(settings, engine, replay, learner).run()
    finally:
        await engine.shutdown()
        for link in (replay, learner):
            if link is not None:  # time for the goodbyes to leave, not for more
                link.socket.close(linger=GOODBYE_LINGER_MS)
        context.term()


class Actor:
    """Concurrent episodes on one engine (its slots) or a harness's sessions
    (the recording endpoint's :class:`SessionRollouts`); the replay link's and
    the learner link's handler tables over the socket-free state of
    actors/state.py. It is the :class:`EpisodeHost` of both and the owner of
    its incarnation."""

    def __init__(self, settings: ActorSettings, engine: Engine, replay: ClientEndpoint,
                 learner: ClientEndpoint | None) -> None:
        """``learner``: None to never take weight updates."""
        self.settings = settings
        self.config = settings.actor
        self.engine = engine
        self.replay_endpoint = replay
        self.learner_endpoint = learner
        self.in_flight = InFlight(settings.actor_id, time.time_ns())
        self.sender = Incarnation(settings.actor_id, self.incarnation)
        """The incarnation as its messages carry it (header, ``Hello`` token)."""
        self.metrics = ActorMetrics()
        self.engine_info = EngineInfo(device=engine.device(), dtype=engine.dtype(),
                                      tensor_parallel=self.config.engine.tensor_parallel,
                                      model=settings.model)
        # a template or a tool parser that cannot serve this model is refused at start
        self.chat = ChatFormat(engine.tokenizer, self.config.compaction, self.config.environment)
        self.chat.tool_calls.check()
        self.weights = LearnerView()
        self.replay_link = ReplayLink(replay, self.engine_info, self.config, self.weights,
                                      self.metrics, self.sender, self)
        self.learner_link = (LearnerLink(learner, engine, self.engine_info, self.config,
                                         settings.transport.curve, self.weights, self.metrics,
                                         self.sender)
                             if learner is not None else None)
        self.health = Health()
        """Ready once registered with the replay (the engine has started by
        then); alive while the event loop runs its heartbeat task."""
        self.health.readiness = lambda: (None if self.replay_endpoint.registered.is_set()
                                         else "registering with the replay")
        self.stopping = asyncio.Event()
        """Set on SIGTERM or Ctrl-C, or when the engine died: no episode starts."""
        self.slots = EpisodeSlots(self.config, settings.run_seed, engine, self.chat, self)
        self.endpoint = (RecordingEndpoint(SessionRollouts(self.config, self.chat, engine, self),
                                           settings.model)
                         if self.config.endpoint.enabled else None)
        self._ending_sessions: asyncio.Task | None = None
        self.engine_died = False
        self.loop_failed = False

    @property
    def incarnation(self) -> int:
        return self.in_flight.incarnation

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            loop.add_signal_handler(sig, self.stopping.set)
        transport = self.settings.transport
        metrics = MetricsServer(self.metrics.registry, self.settings.metrics_port,
                                transport.metrics_address, self.health)
        if metrics.port:  # the replay lists it for Prometheus (file-based discovery)
            self.replay_link.metrics_address = advertised_address(
                transport.metrics_address, metrics.port, self.settings.replay_address)
        try:
            return await self._serve()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            metrics.close()

    async def _serve(self) -> int:
        self.metrics.set_engine(self.engine_info)
        self.metrics.episode_slots.set(self.config.concurrent_episodes)
        coroutines = [*self.replay_link.coroutines(self._dropped("replay")),
                      self._heartbeat(), self._watch_engine()]
        if self.learner_link is not None:
            coroutines += self.learner_link.coroutines(self._dropped("learner"))
        if self.endpoint is not None:
            port = self.config.endpoint.port
            coroutines.append(serve_until(self.endpoint, port + self.settings.index if port else 0,
                                          self.stopping))
        background = [asyncio.create_task(coroutine) for coroutine in coroutines]
        for task in background:
            task.add_done_callback(self._loop_ended)
        self._start_slots()
        await self.stopping.wait()
        log.info("stopping: %s in-flight episodes (%s)", self.in_flight.count,
                 self.config.on_shutdown)
        deadline = time.monotonic() + self.config.shutdown_deadline_s
        slots = self.slots.tasks
        if self.config.on_shutdown == "abandon":
            self.slots.cancel()
        await asyncio.wait(slots, timeout=max(0.0, deadline - time.monotonic()))
        for task in slots:
            task.cancel()
        if self.endpoint is not None:  # its sessions abandoned, told to the replay
            await self.endpoint.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.replay_link.outbox.empty.wait(),
                                   max(0.0, deadline - time.monotonic()))
        if self.learner_link is not None:  # a dead engine's load never ends: no wait for it
            await self.learner_link.leave(0.0 if self.engine.dead else deadline - time.monotonic())
        for task in background:
            task.cancel()
        await asyncio.gather(*background, *slots, return_exceptions=True)
        await self.replay_link.leave()
        if self.replay_link.outbox:
            log.error("%d segments never acknowledged", len(self.replay_link.outbox))
            return 1
        if self.engine_died:  # the cause of whatever else failed with it
            return ENGINE_DIED_EXIT
        return LOOP_FAILED_EXIT if self.loop_failed else 0

    def _loop_ended(self, task: asyncio.Task) -> None:
        """A loop that raised would leave the actor running without it (deaf
        to a peer, or never resending): stop for a restart instead, the
        cause in the log. Loops end without raising only when cancelled at
        shutdown, or once stopping (the recording endpoint's server)."""
        if task.cancelled() or (error := task.exception()) is None:
            return
        log.error("%s failed, stopping for a restart", task.get_coro().__qualname__,
                  exc_info=error)
        self.loop_failed = True
        self.stopping.set()

    async def _watch_engine(self) -> None:
        """Stop the actor once its engine has died. vLLM does not exit with
        its engine core: without this the actor would heartbeat on with no
        episodes, a zombie its supervisor never restarts, and hold back every
        publication to its weight group."""
        while not self.engine.dead:
            await asyncio.sleep(ENGINE_CHECK_S)
        if self.stopping.is_set():
            # asked to stop first: the signal reached the engine's process too
            # (a process group's or a unit's stop), and the stop goes on as asked
            log.info("the vLLM engine ended while the actor was stopping")
            await self.slots.give_up()
            return
        log.error("the vLLM engine died: giving up %d rollouts in flight; exiting with code "
                  "%d for a restart", len(self.slots.open_rollouts), ENGINE_DIED_EXIT)
        self.engine_died = True
        await self.slots.give_up()
        self.stopping.set()

    # ------------------------------------------------------------------ episodes

    def _start_slots(self) -> None:
        """The actor's own episodes (none where a harness drives the endpoint)."""
        self.slots.start(self.config.concurrent_episodes if self.endpoint is None else 0)

    def weights_fresh(self) -> bool:
        """Generating now gives tokens the replay accepts (always, without a learner)."""
        if self.learner_endpoint is None:
            return True
        return self.learner_endpoint.registered.is_set() and self.weights.fresh(self.engine.version)

    # ------------------------------------------------------------------ both links

    def _dropped(self, peer: str) -> Callable[[ProtocolError], None]:
        def dropped(error: ProtocolError) -> None:
            self.metrics.rejected_frames.labels(error.code.value).inc()
            log.warning("dropped a frame from the %s: %s", peer, error)
        return dropped

    async def _heartbeat(self) -> None:
        while True:
            self.health.beat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.in_flight.ended.wait(),
                                       self.settings.transport.heartbeat_interval_s)
            self.in_flight.ended.clear()
            for link in (self.replay_endpoint, self.learner_endpoint):
                if link is not None:
                    await self._send_heartbeat(link)

    async def tell_replay(self) -> None:
        """A heartbeat to the replay now (a rollout that starts is told at once)."""
        await self._send_heartbeat(self.replay_endpoint)

    async def _send_heartbeat(self, link: ClientEndpoint) -> None:
        await link.send(Heartbeat(
            **self.sender.header(), active_rollouts=self.in_flight.count,
            stall_seconds=self.metrics.stall_totals(),
            credit_ledger=self.replay_link.credits.ledger,
            credits_seen=self.replay_link.credits.seen))

    # ------------------------------------------------------------------ incarnations

    def declared_dead(self, ref_seq: int) -> None:
        """The replay refused message ``ref_seq`` as of a dead incarnation:
        this one if the seq is its own (older seqs: one already left behind)."""
        if self.sender.sent(ref_seq) and not self.stopping.is_set():
            self._reincarnate()

    def _reincarnate(self) -> None:
        """Start over as a new incarnation after the replay declared this one
        dead: it has expired the rollouts in flight, so they are abandoned with
        their unacknowledged segments (counted), and the process registers
        again with the replay and the learner."""
        old = self.incarnation
        self.in_flight.incarnation = max(time.time_ns(), old + 1)
        self.sender.renew(self.incarnation)
        log.warning("the replay declared incarnation %d dead: abandoning %d episodes and %d "
                    "unacknowledged segments; registering as incarnation %d", old,
                    self.in_flight.count, len(self.replay_link.outbox), self.incarnation)
        self.metrics.reincarnations.inc()
        self.slots.cancel()
        self.slots.open_rollouts.clear()  # expired by the replay
        self.replay_link.forfeit()
        if self.learner_link is not None:
            self.learner_link.forgotten()
        if self.endpoint is not None:  # harness sessions of the dead incarnation end too
            self._ending_sessions = asyncio.get_running_loop().create_task(
                self.endpoint.abandon_all())
        self._start_slots()
