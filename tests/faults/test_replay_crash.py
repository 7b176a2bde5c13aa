"""Crash recovery: the replay is SIGKILLed at random moments while an actor
pushes segments; after each restart every acknowledged segment is present
exactly once and every rollout is served exactly once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import zmq

from tests.ports import free_ports
from tests.processes import VENV_BIN
from tests.protocol_clients import ActorClient, LearnerClient

ROLLOUTS = 60
SEGMENTS = 3
KILLS = 3
STARTUP_S = 30


def start_replay(ports: list[int], log_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(VENV_BIN / "compactionrl"), "replay",
         "--replay.actor_address", f"tcp://127.0.0.1:{ports[0]}",
         "--replay.learner_address", f"tcp://127.0.0.1:{ports[1]}",
         "--replay.log_path", str(log_path), "--replay.metrics_port", "0",
         "--replay.rollouts_per_batch", "1", "--replay.max_staleness", "0",
         "--run.model", str(log_path.parent / "no-model")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def stop(process: subprocess.Popen, sig: int) -> None:
    if process.poll() is None:
        os.killpg(process.pid, sig)
    process.wait(timeout=30)


def test_every_acknowledged_segment_survives_sigkill(tmp_path: Path) -> None:
    rng = random.Random(1129)
    ports = free_ports(2)
    log_path = tmp_path / "replay" / "segments.log"
    context = zmq.Context()
    actor = ActorClient(context, f"tcp://127.0.0.1:{ports[0]}")
    learner = LearnerClient(context, f"tcp://127.0.0.1:{ports[1]}")
    replay = start_replay(ports, log_path)
    kills_at = sorted(rng.sample(range(5, ROLLOUTS - 5), KILLS))
    acked_before_kill: list[int] = []
    try:
        actor.hello()
        # the first kill must find acknowledged segments: wait for the replay to be up
        assert actor.pump_until(lambda: actor.credits > 0, timeout_s=STARTUP_S)
        in_flight_at_kill = []
        for n in range(ROLLOUTS):
            actor.push_rollout(segments=SEGMENTS)
            if n in kills_at:  # kill with this rollout's segments in flight
                time.sleep(rng.random() * 0.005)
                stop(replay, signal.SIGKILL)
                actor.pump(0.1)
                acked_before_kill.append(len(actor.acked))
                in_flight_at_kill.append(len(actor.unacked))
                replay = start_replay(ports, log_path)
            else:
                actor.pump(0.02)
        # resend until everything is acknowledged (the replay is back)
        deadline = time.monotonic() + STARTUP_S + 60
        while actor.unacked and time.monotonic() < deadline:
            actor.resend_unacked()
            actor.pump(1.0)
        assert not actor.unacked, f"{len(actor.unacked)} segments never acknowledged"
        # a restarted replay knows no connection: the actor registers again
        assert {e.code for e in actor.errors} <= {"unregistered"}

        served: Counter[tuple[str, int]] = Counter()
        rollouts = 0
        while rollouts < ROLLOUTS:
            learner.request(1, version=0)
            batch = learner.receive(10.0)
            assert batch is not None, f"only {rollouts} rollouts served"
            for rollout in batch.rollouts:
                rollouts += 1
                for segment in rollout.segments:
                    served[(segment.rollout_id, segment.index)] += 1
        learner.request(1, version=0)
        assert learner.receive(1.0) is None, "a rollout was served twice"

        acked = Counter((s.rollout_id, s.index) for s in actor.acked.values())
        assert len(acked) == ROLLOUTS * SEGMENTS
        assert served == acked  # each acknowledged segment exactly once, nothing else
        assert all(count > 0 for count in acked_before_kill)
        print(f"acknowledged {len(acked)}, unacknowledged at the kills {in_flight_at_kill}, "
              f"served {sum(served.values())}, lost 0; {len(actor.errors)} messages refused "
              "as unregistered after the restarts")
    finally:
        stop(replay, signal.SIGTERM)
        actor.close()
        learner.close()
        context.destroy(linger=0)
