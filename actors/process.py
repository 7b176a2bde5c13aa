"""The actor process: concurrent episodes on one engine, segments to the replay.

Protocol with the replay (DEALER -> ROUTER):

- ``Hello`` until a ``Welcome`` arrives; the ``Welcome`` sets the credits.
- An episode starts only by spending a credit; more credits come with ``Ack``s.
  Waiting for one is stall time (``reason="credits"``). Credits are counted by
  the replay's ledger total, and each heartbeat says which total was seen, so
  credits in an ``Ack`` lost with a dropped connection are made up (counted).
- Every closed segment is sent at once and kept until an ``Ack`` lists its
  seq; unacknowledged segments are resent after ``ack_timeout_s`` with the
  same ``(actor_id, incarnation, seq)``, so the replay can drop duplicates.
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
- With a learner (``learner_address``): ``Hello`` to its control socket,
  heartbeats, and on each ``WeightsAnnounce`` join the group generation (if
  new), receive and load the weights into the running engine (generation
  paused only meanwhile: stall ``reason="weights"``), then ``WeightsLoaded``.
  No episode starts while the engine's weights are more than
  ``max_staleness`` versions behind the learner (also stall ``weights``).
- On SIGTERM: no new episode; in-flight ones are abandoned or finished
  (``on_shutdown``); unacknowledged segments are flushed until
  ``shutdown_deadline_s``. Exit code 0 only if every segment was acknowledged.

Usage::

    actor = Actor(settings)
    exit_code = asyncio.run(actor.run())
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import signal
import time
from dataclasses import dataclass, field

import numpy as np
import zmq
import zmq.asyncio

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import SegmentData
from actors.engine import Engine
from actors.envs.base import Environment, load_environment
from actors.episode import EpisodeResult, run_episode
from actors.metrics import ActorMetrics
from ops.metrics import MetricsServer
from protocol import (
    Ack,
    Array,
    EngineInfo,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    MemberWelcome,
    Message,
    ProtocolError,
    Segment,
    Stamp,
    WeightsAnnounce,
    WeightsLoaded,
    Welcome,
    decode,
    encode,
)
from protocol.transport import TransportConfig, connect_dealer

log = logging.getLogger("compactionrl.actor")

#: How often the resend loop looks for overdue segments, as a fraction of the
#: ack timeout: fine enough that a resend is at most 25 % late.
RESEND_CHECK_FRACTION = 0.25


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


#: Held-out episode seeds start here; training seeds are below, so an
#: evaluation never replays a training episode.
EVALUATION_SEEDS_FROM = 2**31


def training_seed(run_seed: int, actor_id: str, incarnation: int, n: int) -> int:
    """Episode seed, in [0, EVALUATION_SEEDS_FROM): distinct across actors,
    incarnations and episodes."""
    digest = hashlib.blake2b(f"{run_seed}/{actor_id}/{incarnation}/{n}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


@dataclass
class _Pending:
    frame: bytes
    sent_at: float


@dataclass
class _State:
    credits: int = 0
    credit_ledger: int = 0
    """The replay's ledger for this actor, and the total granted under it
    that this actor has counted (``Ack.credits_total``)."""
    credits_seen: int = 0
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    replay_lost: asyncio.Event = field(default_factory=asyncio.Event)
    """The replay declared this incarnation dead: say Hello again as a new one."""
    credit_available: asyncio.Event = field(default_factory=asyncio.Event)
    unacked: dict[int, _Pending] = field(default_factory=dict)
    all_acked: asyncio.Event = field(default_factory=asyncio.Event)
    active: int = 0
    active_changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when an episode ends: the heartbeat task tells the replay at once
    (a start is told by the episode itself, before it begins)."""
    learner_registered: asyncio.Event = field(default_factory=asyncio.Event)
    learner_lost: asyncio.Event = field(default_factory=asyncio.Event)
    """The learner no longer knows this actor (it restarted): say Hello again."""
    learner_version: int = 0
    max_staleness: int = 0
    weights_changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the engine's or the learner's version moves."""
    announcements: asyncio.Queue = field(default_factory=asyncio.Queue)
    group_key: tuple[int, int] | None = None
    """(learner incarnation, generation) of the broadcast group joined."""


class Actor:
    def __init__(self, settings: ActorSettings) -> None:
        self.settings = settings
        self.config = settings.actor
        self.incarnation = time.time_ns()
        self.stamp = Stamp(settings.actor_id, self.incarnation)
        self.metrics = ActorMetrics()
        self.state = _State()
        self.state.all_acked.set()
        self._stopping = asyncio.Event()
        self._episode_numbers = itertools.count()
        self._slots: list[asyncio.Task] = []

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        # fail fast, before the engine's slow start, if the environment cannot load
        await load_environment(self.config.environment.factory,
                               self.config.environment.options).close()
        self.engine = await Engine.start(self.settings.model, self.config.engine,
                                         self.config.sampling, seed_offset=self.settings.index,
                                         weight_transfer=self.settings.learner_address is not None)
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            loop.add_signal_handler(sig, self._stopping.set)
        metrics = MetricsServer(self.metrics.registry,
                                self.config.metrics_port + self.settings.index
                                if self.config.metrics_port else 0,
                                self.settings.transport.metrics_address)
        context = zmq.asyncio.Context()
        self.socket = connect_dealer(context, self.settings.replay_address,
                                     self.settings.transport, self.settings.actor_id.encode())
        self.learner_socket = (connect_dealer(context, self.settings.learner_address,
                                              self.settings.transport,
                                              self.settings.actor_id.encode())
                               if self.settings.learner_address else None)
        try:
            return await self._serve()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            await self.engine.shutdown()
            self.socket.close(linger=0)
            if self.learner_socket is not None:
                self.learner_socket.close(linger=0)
            context.term()
            metrics.close()

    async def _serve(self) -> int:
        engine_info = EngineInfo(device=self.engine.device(), dtype=self.engine.dtype(),
                                 tensor_parallel=self.config.engine.tensor_parallel,
                                 model=self.settings.model)
        self.metrics.set_engine(engine_info)
        self.metrics.episode_slots.set(self.config.concurrent_episodes)
        self.engine_info = engine_info
        self.chat = ChatFormat(self.engine.tokenizer, self.config.compaction,
                               self.config.environment)
        coroutines = [self._receive(), self._register(engine_info), self._heartbeat(),
                      self._resend(), self._count_disconnects(self.socket, "replay")]
        if self.learner_socket is not None:
            coroutines += [self._learner_receive(), self._learner_register(),
                           self._apply_weights(),
                           self._count_disconnects(self.learner_socket, "learner")]
        background = [asyncio.create_task(coroutine) for coroutine in coroutines]
        self._start_slots()
        await self._stopping.wait()
        log.info("stopping: %s in-flight episodes (%s)", self.state.active,
                 self.config.on_shutdown)
        deadline = time.monotonic() + self.config.shutdown_deadline_s
        slots = self._slots
        if self.config.on_shutdown == "abandon":
            self._abandon_episodes()
        await asyncio.wait(slots, timeout=max(0.0, deadline - time.monotonic()))
        for task in slots:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.state.all_acked.wait(),
                                   max(0.0, deadline - time.monotonic()))
        for task in background:
            task.cancel()
        await asyncio.gather(*background, *slots, return_exceptions=True)
        if self.state.unacked:
            log.error("%d segments never acknowledged", len(self.state.unacked))
            return 1
        return 0

    # ------------------------------------------------------------------ episodes

    def _start_slots(self) -> None:
        self._slots = [asyncio.create_task(self._episode_slot(slot))
                       for slot in range(self.config.concurrent_episodes)]

    def _abandon_episodes(self) -> None:
        """Cancel the episodes in flight (their engine requests are aborted)."""
        self.metrics.abandoned_rollouts.inc(self.state.active)
        for task in self._slots:
            task.cancel()

    async def _episode_slot(self, slot: int) -> None:
        environment = load_environment(self.config.environment.factory,
                                       self.config.environment.options)
        try:
            while await self._take_credit():
                n = next(self._episode_numbers)
                task_seed, sampling_seed = (
                    training_seed(self.settings.run_seed, self.settings.actor_id,
                                  self.incarnation, number)
                    for number in (n // self.config.group_size, n))
                rollout_id = f"{self.settings.actor_id}-{self.incarnation}-{n}"
                self.state.active += 1
                try:
                    # queued before anything else can run: a weight load may hold
                    # the event loop for seconds, and the heartbeat task with it
                    await self._send_heartbeat(self.socket)
                    self.metrics.active_rollouts.inc()
                    try:
                        await self._play(environment, rollout_id, task_seed, sampling_seed)
                    finally:
                        self.metrics.active_rollouts.dec()
                finally:
                    self.state.active -= 1
                    self.state.active_changed.set()
        finally:
            await environment.close()

    async def _take_credit(self) -> bool:
        """Wait for weights fresh enough and a credit, and spend it; False once
        the actor is stopping."""
        began = time.monotonic()
        while not self._weights_fresh() and not self._stopping.is_set():
            await self._until(self.state.weights_changed)
        self.metrics.stall("weights", time.monotonic() - began)
        began = time.monotonic()
        while self.state.credits <= 0 and not self._stopping.is_set():
            await self._until(self.state.credit_available)
        self.metrics.stall("credits", time.monotonic() - began)
        if self._stopping.is_set():
            return False
        self.state.credits -= 1
        return True

    async def _until(self, event: asyncio.Event) -> None:
        """Clear ``event`` and wait until it is set again or the actor stops."""
        event.clear()
        woken = asyncio.create_task(event.wait())
        stop = asyncio.create_task(self._stopping.wait())
        await asyncio.wait([woken, stop], return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        stop.cancel()

    def _weights_fresh(self) -> bool:
        """Generating now gives tokens the replay accepts (always, without a learner)."""
        if self.learner_socket is None:
            return True
        return (self.state.learner_registered.is_set() and
                self.state.learner_version - self.engine.version <= self.state.max_staleness)

    async def _play(self, environment: Environment, rollout_id: str, seed: int,
                    sampling_seed: int) -> None:
        index = itertools.count()

        async def emit(task_id: str, segment: SegmentData, result: EpisodeResult | None) -> None:
            await self._send_segment(rollout_id, task_id, next(index), segment, result)

        result = await run_episode(self.engine, environment, self.chat, self.config, seed, emit,
                                   sampling_seed=sampling_seed)
        self.metrics.episode_finished(result.reward, result.stats, result.summary_seconds,
                                      result.observations_cut)

    async def _send_segment(self, rollout_id: str, task_id: str, index: int, segment: SegmentData,
                      result: EpisodeResult | None) -> None:
        header = self.stamp.next()
        message = Segment(
            **header, rollout_id=rollout_id, task_id=task_id, index=index,
            segment_type=segment.segment_type,
            tokens=Array.from_numpy(np.asarray(segment.tokens, dtype=np.int32)),
            loss_mask=Array.from_numpy(np.asarray(segment.loss_mask, dtype=np.uint8)),
            logprobs=Array.from_numpy(np.asarray(segment.logprobs, dtype=np.float32)),
            versions=Array.from_numpy(np.asarray(segment.versions, dtype=np.int32)),
            final=result is not None, reward=None if result is None else result.reward,
            stats=None if result is None else result.stats)
        frame = encode(message)
        self.state.unacked[header["seq"]] = _Pending(frame, time.monotonic())
        self.state.all_acked.clear()
        self.metrics.unacked_segments.set(len(self.state.unacked))
        self.metrics.segments_sent.inc()
        await self.socket.send(frame, copy=False)

    # ------------------------------------------------------------------ replay link

    async def _register(self, engine: EngineInfo) -> None:
        while True:
            if self.state.registered.is_set():
                await self.state.replay_lost.wait()
                self.state.replay_lost.clear()
                self.state.registered.clear()
                continue
            await self.socket.send(encode(Hello(**self.stamp.next(), engine=engine,
                                                capacity=self.config.concurrent_episodes)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.state.registered.wait(), self.config.hello_retry_s)

    async def _receive(self) -> None:
        while True:
            frame = await self.socket.recv(copy=False)
            try:
                message = decode(frame.buffer, self.settings.transport.max_message_bytes)
            except ProtocolError as exc:
                self.metrics.rejected_frames.labels(exc.code.value).inc()
                log.warning("dropped a frame from the replay: %s", exc)
                continue
            if isinstance(message, Ack):
                for seq in message.stored_seqs:
                    self.state.unacked.pop(seq, None)
                self.metrics.unacked_segments.set(len(self.state.unacked))
                if not self.state.unacked:
                    self.state.all_acked.set()
                # The replay hears of a new learner version before the weights
                # are announced: credits granted for it must wait for them.
                self._learner_at(message.policy_version)
                self._grant(message)
            elif isinstance(message, Welcome):
                # the staleness bound's one source: the replay's configuration
                self.state.max_staleness = message.max_staleness
                # counted by the ledger: a second Welcome (a Hello retried) or
                # an Ack before it adds only what it has that was not seen
                self._grant(message)
                self.state.registered.set()
            elif isinstance(message, Error):
                # a rejection is final: the same bytes would be rejected again
                self.metrics.errors_received.labels(message.code).inc()
                log.warning("replay rejected seq %s: %s %s", message.ref_seq, message.code,
                            message.text)
                if self.state.unacked.pop(message.ref_seq, None) is not None:
                    self.metrics.unacked_segments.set(len(self.state.unacked))
                    if not self.state.unacked:
                        self.state.all_acked.set()
                # about this incarnation (older seqs: one already left behind)
                if (message.code == ErrorCode.DEAD_INCARNATION and message.ref_seq is not None
                        and message.ref_seq >= self.stamp.first_seq
                        and not self._stopping.is_set()):
                    self._reincarnate()

    def _reincarnate(self) -> None:
        """Start over as a new incarnation after the replay declared this one
        dead: it has expired the rollouts in flight, so they are abandoned with
        their unacknowledged segments (counted), and the process registers
        again with the replay and the learner."""
        old = self.incarnation
        self.incarnation = max(time.time_ns(), old + 1)
        self.stamp = Stamp(self.settings.actor_id, self.incarnation,
                           first_seq=self.stamp.next_seq)
        log.warning("the replay declared incarnation %d dead: abandoning %d episodes and %d "
                    "unacknowledged segments; registering as incarnation %d", old,
                    self.state.active, len(self.state.unacked), self.incarnation)
        self.metrics.reincarnations.inc()
        self._abandon_episodes()
        self.metrics.segments_abandoned.inc(len(self.state.unacked))
        self.state.unacked.clear()
        self.metrics.unacked_segments.set(0)
        self.state.all_acked.set()
        self.state.credits = 0
        self.state.replay_lost.set()
        self.state.learner_lost.set()
        self._start_slots()

    def _grant(self, reply: Ack | Welcome) -> None:
        """Count the credits of ``reply`` by its ledger (``Ack.credits_total``)."""
        state = self.state
        if reply.credit_ledger != state.credit_ledger:  # the replay's account starts over
            state.credit_ledger, state.credits_seen, state.credits = reply.credit_ledger, 0, 0
        new = reply.credits_total - state.credits_seen
        if new > 0:
            # more than this reply granted: the rest came in replies that were lost
            self.metrics.credits_recovered.inc(max(0, new - reply.credits))
            state.credits_seen = reply.credits_total
            state.credits += new
            state.credit_available.set()

    async def _heartbeat(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.state.active_changed.wait(),
                                       self.settings.transport.heartbeat_interval_s)
            self.state.active_changed.clear()
            for socket in (self.socket, self.learner_socket):
                if socket is not None:
                    await self._send_heartbeat(socket)

    async def _send_heartbeat(self, socket: zmq.asyncio.Socket) -> None:
        await socket.send(encode(Heartbeat(
            **self.stamp.next(), active_rollouts=self.state.active,
            stall_seconds=self.metrics.stall_totals(), credit_ledger=self.state.credit_ledger,
            credits_seen=self.state.credits_seen)))

    async def _resend(self) -> None:
        timeout = self.config.ack_timeout_s
        while True:
            await asyncio.sleep(timeout * RESEND_CHECK_FRACTION)
            now = time.monotonic()
            for pending in list(self.state.unacked.values()):
                if now - pending.sent_at >= timeout:
                    pending.sent_at = now
                    self.metrics.segments_resent.inc()
                    await self.socket.send(pending.frame)

    async def _count_disconnects(self, socket: zmq.asyncio.Socket, peer: str) -> None:
        """Count the connection to ``peer`` dropping: ZeroMQ reconnects by
        itself and what was lost is resent, so without this a flaky network
        would show only as resends."""
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                await monitor.recv_multipart()
                self.metrics.disconnects.labels(peer).inc()
        finally:
            socket.disable_monitor()
            monitor.close(linger=0)

    # ------------------------------------------------------------------ learner link

    async def _learner_register(self) -> None:
        while True:
            if self.state.learner_registered.is_set():
                await self.state.learner_lost.wait()
                self.state.learner_lost.clear()
                self.state.learner_registered.clear()
                continue
            await self.learner_socket.send(encode(Hello(
                **self.stamp.next(), engine=self.engine_info,
                capacity=self.config.concurrent_episodes, policy_version=self.engine.version)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.state.learner_registered.wait(),
                                       self.config.hello_retry_s)

    async def _learner_receive(self) -> None:
        while True:
            frame = await self.learner_socket.recv(copy=False)
            try:
                message: Message = decode(frame.buffer,
                                          self.settings.transport.max_message_bytes)
            except ProtocolError as exc:
                self.metrics.rejected_frames.labels(exc.code.value).inc()
                log.warning("dropped a frame from the learner: %s", exc)
                continue
            if isinstance(message, MemberWelcome):
                self._learner_at(message.policy_version)
                self.state.learner_registered.set()
            elif isinstance(message, WeightsAnnounce):
                self._learner_at(message.version)
                self.state.announcements.put_nowait((message.incarnation, message))
            elif isinstance(message, Error):
                self.metrics.errors_received.labels(message.code).inc()
                log.warning("learner rejected seq %s: %s %s", message.ref_seq, message.code,
                            message.text)
                if message.code == ErrorCode.UNREGISTERED:  # the learner restarted
                    self.state.learner_lost.set()

    def _learner_at(self, version: int) -> None:
        self.state.learner_version = max(self.state.learner_version, version)
        self.state.weights_changed.set()

    async def _apply_weights(self) -> None:
        """Announcements, one at a time, in order."""
        while True:
            learner_incarnation, announce = await self.state.announcements.get()
            group = (learner_incarnation, announce.group.generation)
            try:
                if group != self.state.group_key:
                    self.state.group_key = None
                    await self.engine.join_weight_group(announce.group)
                    self.state.group_key = group
                times = await self.engine.load_weights(announce.version, announce.manifest,
                                                       self.config.kv_on_update)
            except Exception as exc:  # a member died, a timeout: wait for the next one
                self.state.group_key = None
                self.metrics.weight_failures.inc()
                log.warning("weights of version %d not loaded: %s", announce.version, exc)
                continue
            self.metrics.stall("weights", times.stall_seconds)
            self.metrics.policy_version.set(announce.version)
            self.state.weights_changed.set()
            log.info("loaded version %d in %.3f s (generation paused %.3f s)",
                     announce.version, times.load_seconds, times.stall_seconds)
            await self.learner_socket.send(encode(WeightsLoaded(
                **self.stamp.next(), version=announce.version, seconds=times.load_seconds)))
