"""The actor's answer to being declared dead by the replay (a frozen process
resumed): abandon what is in flight and register as a new incarnation whose
seqs continue the old ones, so replies about the old incarnation are told
apart; and to one of its own loops failing: stop for a restart. The actor
runs without an engine: its engine, episode slots and sockets are
stand-ins."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from actors.config import ActorConfig
from actors.process import LOOP_FAILED_EXIT, Actor, ActorSettings
from protocol import DEFAULT_MAX_MESSAGE_BYTES, Error, ErrorCode, Hello, Stamp, decode, encode
from protocol.endpoint import ClientEndpoint
from protocol.transport import TransportConfig


class StandInEngine:
    """What the actor reads of its engine before any episode runs."""

    version = 0
    dead = False

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def device(self) -> str:
        return "cpu"

    def dtype(self) -> str:
        return "float32"


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> StandInEngine:
    from transformers import AutoTokenizer
    return StandInEngine(AutoTokenizer.from_pretrained(tiny_model_dir))


def make_actor(actor_id: str, engine: StandInEngine, socket: Any,
               transport: TransportConfig | None = None,
               config: ActorConfig | None = None) -> Actor:
    settings = ActorSettings(actor_id=actor_id, model="none",
                             replay_address="tcp://127.0.0.1:1", actor=config or ActorConfig(),
                             transport=transport or TransportConfig())
    return Actor(settings, engine, ClientEndpoint(socket, DEFAULT_MAX_MESSAGE_BYTES), None)


class _Frame:
    """A received ZeroMQ frame, as the receive loop reads it."""

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


class ScriptedSocket:
    """Hands the actor's receive loop the frames it is given, then waits;
    keeps what the actor sends."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.sent: list[bytes] = []

    async def send(self, frame: bytes, copy: bool = True) -> None:
        self.sent.append(bytes(frame))

    async def recv(self, copy: bool = False) -> _Frame:
        frame = await self.inbox.get()
        return _Frame(frame)

    def get_monitor_socket(self, events: int) -> ScriptedSocket:
        """A monitor that reports no event (its ``recv_multipart`` waits)."""
        return ScriptedSocket()

    async def recv_multipart(self) -> list[bytes]:
        return [await self.inbox.get()]

    def disable_monitor(self) -> None:
        pass

    def close(self, linger: int = 0) -> None:
        pass


async def _scenario(engine: StandInEngine) -> None:
    socket = ScriptedSocket()
    actor = make_actor("actor-f", engine, socket)
    actor.replay_endpoint.welcomed()
    link = actor.replay_link
    episodes: list[int] = []

    async def slot(number: int) -> None:  # an episode that runs until cancelled
        episodes.append(len(episodes))
        actor.in_flight.begun()
        actor.slots.playing += 1
        try:
            await asyncio.Event().wait()
        finally:
            actor.slots.playing -= 1
            actor.in_flight.finished()

    actor.in_flight.begun()  # a harness session in flight: the endpoint counts its end

    actor.slots._slot = slot  # type: ignore[method-assign]
    actor._start_slots()
    first_slots = actor.slots.tasks
    for _ in range(10):  # seqs 0..9 sent; 6..9 are segments still unacknowledged
        seq = actor.sender.header()["seq"]
        if seq >= 6:
            link.outbox.sent(seq, b"frame", time.monotonic())
    old_incarnation = actor.incarnation
    receive = asyncio.create_task(actor.replay_endpoint.serve(link.handlers,
                                                              actor._dropped("replay")))
    replay = Stamp("replay", 1)

    async def reply(ref_seq: int) -> None:
        await socket.inbox.put(encode(Error(**replay.next(), code=ErrorCode.DEAD_INCARNATION,
                                            text="declared dead", ref_seq=ref_seq)))
        while not socket.inbox.empty():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)

    def count(metric: str) -> float:
        return actor.metrics.registry.get_sample_value(metric) or 0.0

    await reply(7)  # the replay refuses a resent segment of the frozen incarnation
    assert actor.incarnation > old_incarnation
    assert actor.sender.number == actor.incarnation and actor.sender.stamp.first_seq == 10
    assert all(task.cancelled() for task in first_slots)
    assert len(episodes) == 2 * actor.config.concurrent_episodes  # slots started afresh
    assert not link.outbox and link.outbox.empty.is_set()
    assert link.credits.credits == 0
    register = asyncio.create_task(actor.replay_endpoint.register(link.hello, 60.0))
    await asyncio.sleep(0.05)
    [hello] = [decode(frame) for frame in socket.sent]  # forgotten: says Hello again
    assert isinstance(hello, Hello) and hello.incarnation == actor.incarnation
    assert count("crl_actor_reincarnations_total") == 1
    assert count("crl_actor_abandoned_rollouts_total") == actor.config.concurrent_episodes
    assert count("crl_actor_segments_abandoned_total") == 3  # 6, 8, 9 (7 was refused)

    reborn = actor.incarnation
    await reply(9)  # a later refusal of the old incarnation's messages: already handled
    assert actor.incarnation == reborn
    assert count("crl_actor_reincarnations_total") == 1

    await reply(actor.sender.header()["seq"])  # the new incarnation declared dead in turn
    assert actor.incarnation > reborn
    assert count("crl_actor_reincarnations_total") == 2

    for task in (receive, register, *actor.slots.tasks):
        task.cancel()
    await asyncio.gather(receive, register, *actor.slots.tasks, return_exceptions=True)


def test_a_dead_incarnation_abandons_its_episodes_and_registers_anew(engine) -> None:
    asyncio.run(asyncio.wait_for(_scenario(engine), 60))


class _Environment:
    async def close(self) -> None:
        pass


async def _heartbeat_scenario(monkeypatch, engine: StandInEngine) -> None:
    socket = ScriptedSocket()
    actor = make_actor("actor-h", engine, socket, TransportConfig(heartbeat_interval_s=3600.0))
    monkeypatch.setattr("actors.slots.load_environment", lambda *_: _Environment())
    actor.replay_link.credits.grant(ledger=1, credits_total=1, credits=1)  # one episode
    finish = asyncio.Event()

    async def play(*_: object) -> None:
        await finish.wait()

    actor.slots._play = play  # type: ignore[method-assign]

    async def reported() -> list[int]:
        await asyncio.sleep(0.1)
        return [decode(f).active_rollouts for f in socket.sent]

    heartbeat = asyncio.create_task(actor._heartbeat())
    slot = asyncio.create_task(actor.slots._slot(0))
    assert await reported() == [1]  # at the start, not an interval later
    finish.set()
    assert await reported() == [1, 0]
    actor.stopping.set()  # the slot waits for another credit until the actor stops
    await slot
    heartbeat.cancel()
    await asyncio.gather(heartbeat, return_exceptions=True)


def test_the_replay_hears_of_an_episode_the_moment_it_starts_and_ends(monkeypatch,
                                                                      engine) -> None:
    """If the process dies, the replay counts as lost the episodes of its last
    heartbeat: one started after a periodic report would go uncounted."""
    asyncio.run(asyncio.wait_for(_heartbeat_scenario(monkeypatch, engine), 60))


async def _broken_link_scenario(engine: StandInEngine) -> None:
    socket = ScriptedSocket()
    actor = make_actor("actor-b", engine, socket,
                       config=ActorConfig(shutdown_deadline_s=1.0, on_shutdown="abandon"))

    async def idle_slot(number: int) -> None:
        await asyncio.Event().wait()

    actor.slots._slot = idle_slot  # type: ignore[method-assign]

    async def broken_recv(copy: bool = False) -> _Frame:
        raise RuntimeError("the replay link's socket broke")

    socket.recv = broken_recv  # type: ignore[method-assign]
    assert await actor._serve() == LOOP_FAILED_EXIT
    assert actor.stopping.is_set()


def test_a_loop_that_raises_stops_the_actor_for_a_restart(engine, caplog) -> None:
    """The replay link's receive loop raising would leave the actor deaf to
    the replay, heartbeating on: it stops instead, with its own exit code and
    the cause in the log."""
    asyncio.run(asyncio.wait_for(_broken_link_scenario(engine), 60))
    assert "ClientEndpoint.serve failed, stopping for a restart" in caplog.text
    assert "the replay link's socket broke" in caplog.text
