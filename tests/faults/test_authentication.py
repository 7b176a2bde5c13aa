"""Authentication (issue item 7) with CURVE on, end to end: the real replay
process (`compactionrl replay` with `transport.curve.*`) and the learner's
control socket admit a client with an authorized key pair, and give a client
without one (no CURVE at all, or a key pair not in `authorized_keys_dir`)
nothing: no registration, no acknowledged segment, no batch, no welcome and
so never the address of a weight group. Its traffic never reaches the
application (no counter moves: the ZAP handler refuses the handshake)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import zmq

from learner.control import ControlPlane
from learner.metrics import LearnerMetrics
from protocol import Abandon, EngineInfo, Error, Hello, MemberWelcome
from protocol.synthetic import synthetic_segment
from protocol.transport import CurveConfig, TransportConfig, generate_keys
from tests.ports import loopback_addresses
from tests.processes import ReplayProcess
from tests.protocol_clients import ActorClient, ControlClient, LearnerClient

ENGINE = EngineInfo(device="cpu", dtype="float32", tensor_parallel=1, model="m")
#: How long a refused client waits for a reply that must not come.
SILENCE_S = 3.0


def _overrides(curve: CurveConfig) -> list[str]:
    return [arg for name, value in dataclasses.asdict(curve).items()
            for arg in (f"--transport.curve.{name}", str(value).lower()
                        if isinstance(value, bool) else str(value))]


def test_only_clients_with_an_authorized_key_reach_the_replay_and_the_learner(
        tmp_path: Path, curve: tuple[CurveConfig, Path]) -> None:
    curve_config, intruder_secret = curve
    secure = TransportConfig(curve=curve_config)
    # a second authorized client, which must not speak for the first one's actor
    generate_keys(tmp_path, ["client-1"])
    other_key = TransportConfig(curve=dataclasses.replace(
        curve_config, client_secret_key=str(tmp_path / "client-1.key_secret")))
    refused = {"no CURVE": TransportConfig(),
               "an unauthorized key": TransportConfig(curve=dataclasses.replace(
                   curve_config, client_secret_key=str(intruder_secret)))}
    replay = ReplayProcess(tmp_path, "--replay.vocab_size", "100",
                           "--replay.rollouts_per_batch", "1", *_overrides(curve_config))
    [control_address] = loopback_addresses(1)
    plane = ControlPlane(control_address, secure, run_id="r", max_staleness=2,
                         late_joiner="immediate", metrics=LearnerMetrics())
    context = zmq.Context()
    try:
        # every refused client tries everything at once, then all wait together
        attempts = []
        for n, (why, transport) in enumerate(refused.items()):
            actor = ActorClient(context, replay.actor_address, actor_id=f"intruder-{n}",
                                transport=transport)
            actor.hello()
            actor.push_rollout(segments=1)
            learner = LearnerClient(context, replay.learner_address, transport=transport)
            learner.request(1, version=0)
            member = ControlClient(context, control_address, f"intruder-{n}", transport)
            member.send(Hello, engine=ENGINE, capacity=1)
            attempts.append((why, actor, learner, member))
        time.sleep(SILENCE_S)
        for why, actor, learner, member in attempts:
            actor.pump(0.1)
            assert actor.credits == 0 and not actor.acked and not actor.errors, why
            assert learner.receive(0.1) is None, why
            assert not member.socket.poll(100), why
        assert plane.members() == []
        assert replay.metric("crl_replay_segments_total") == 0
        assert sum(replay.rejected().values()) == 0  # nothing reached the application

        actor = ActorClient(context, replay.actor_address, actor_id="actor-0", transport=secure)
        actor.hello()
        actor.push_rollout(segments=2)
        assert actor.pump_until(lambda: not actor.unacked) and not actor.errors
        learner = LearnerClient(context, replay.learner_address, transport=secure)
        learner.request(1, version=0)
        batch = learner.receive(10.0)
        assert batch is not None and len(batch.rollouts[0].segments) == 2
        member = ControlClient(context, control_address, "actor-0", secure)
        member.send(Hello, engine=ENGINE, capacity=1)
        assert isinstance(member.receive(), MemberWelcome)
        [registered] = plane.members()
        assert registered.actor_id == "actor-0"

        # another authorized key claiming actor-0, even as a newer incarnation
        # on a connection of its own: refused on both sockets, actor-0 unmoved
        impostor = ActorClient(context, replay.actor_address, actor_id="actor-0",
                               incarnation=actor.stamp.incarnation + 1, transport=other_key)
        impostor.hello()
        assert impostor.pump_until(lambda: impostor.errors)
        assert [e.code for e in impostor.errors] == ["identity"] and impostor.credits == 0
        other = ControlClient(context, control_address, "actor-0", other_key)
        other.send(Hello, engine=ENGINE, capacity=1)
        reply = other.receive()
        assert isinstance(reply, Error) and reply.code == "identity", reply
        actor.push_rollout(segments=1)
        assert actor.pump_until(lambda: not actor.unacked) and not actor.errors
        assert [m.identity for m in plane.members()] == [registered.identity]

        # that key's own actor cannot finish or abandon actor-0's rollout
        stranger = ActorClient(context, replay.actor_address, actor_id="actor-1",
                               transport=other_key)
        stranger.hello()  # welcomed (credits are flow control, not needed to be refused)
        actor.send(synthetic_segment(actor.stamp, "r-curve", 0, final=False))
        assert actor.pump_until(lambda: replay.metric("crl_replay_segments_total",
                                                      result="accepted") == 4)
        stranger.send(synthetic_segment(stranger.stamp, "r-curve", 1, final=True))
        stranger.send(Abandon(**stranger.stamp.next(), rollout_id="r-curve"))
        assert stranger.pump_until(lambda: len(stranger.errors) == 2)
        assert [e.code for e in stranger.errors] == ["owner", "owner"]
    finally:
        context.destroy(linger=0)
        plane.close()
        replay.stop()
