"""Resource bounds (issue item 8), on the real replay process: with the
learner paused, actors that start rollouts only with credits stall, the
replay's buffer stays within ``replay.max_buffer_bytes`` and its resident
memory within that plus a fixed allowance, for as long as the pause lasts
(10 s by default; ``pytest --soak-seconds 600`` for a soak).

The actors and the learner here are scripted protocol clients: the RSS of
real vLLM actors and torchrun learner ranks under a paused learner is not
measured by this test."""

from __future__ import annotations

import time
from pathlib import Path

import zmq

from tests.processes import ReplayProcess, rss_bytes
from tests.protocol_clients import ActorClient, LearnerClient

MAX_BUFFER_BYTES = 16 * 2**20
#: Two segments of this many tokens: ~5 MB a rollout, so the byte bound, not
#: only the staleness bound, decides when credits stop.
TOKENS = 200_000
ACTORS = 3
BATCHES_BEFORE_PAUSE = 2
FAST_PAUSE_S = 10.0
#: A batch before the pause takes seconds; a stuck one fails the test instead
#: of hanging it.
BATCH_TIMEOUT_S = 120.0
#: Resident memory the replay may use beyond its buffer (interpreter, frames
#: in flight, allocator slack).
RSS_ALLOWANCE = 64 * 2**20


def test_a_paused_learner_stalls_actors_and_bounds_replay_memory(
        tmp_path: Path, soak_seconds: float) -> None:
    pause_s = max(FAST_PAUSE_S, soak_seconds)
    replay = ReplayProcess(tmp_path, "--replay.vocab_size", "100",
                           "--replay.rollouts_per_batch", "2", "--replay.max_staleness", "1",
                           "--replay.max_buffer_bytes", str(MAX_BUFFER_BYTES))
    context = zmq.Context()
    try:
        baseline = rss_bytes(replay.pid)
        actors = [ActorClient(context, replay.actor_address, actor_id=f"actor-{n}",
                              capacity=4) for n in range(ACTORS)]
        started = [0] * ACTORS

        def work(seconds: float) -> None:
            """Each actor starts what its credits allow (its segments are
            dropped once acknowledged: the client keeps no history)."""
            for n, actor in enumerate(actors):
                while actor.credits > 0:
                    actor.credits -= 1
                    actor.push_rollout(segments=2, tokens=TOKENS)
                    started[n] += 1
                actor.heartbeat()
                actor.pump(seconds / ACTORS)
                actor.acked.clear()
                actor.sent = {seq: actor.sent[seq] for seq in actor.unacked}

        for actor in actors:
            actor.hello()
        learner = LearnerClient(context, replay.learner_address)
        for version in range(BATCHES_BEFORE_PAUSE):
            learner.request(2, version=version)
            deadline = time.monotonic() + BATCH_TIMEOUT_S
            while learner.receive(0.1) is None:
                assert time.monotonic() < deadline, f"batch {version} not served"
                work(0.3)
        # the learner pauses: credits run out, then nothing more starts
        end = time.monotonic() + pause_s
        started_at_pause, peak_rss, peak_buffer = sum(started), 0, 0.0
        # Before any rollout completed, the credits assumed a smaller rollout
        # (replay.pacing.INITIAL_ROLLOUT_BYTES) and ingest's bound may have
        # dropped one; since then the credits know the size and stop first.
        dropped_full_at_pause = replay.metric("crl_replay_dropped_total", reason="full")
        last_start = time.monotonic()
        while (now := time.monotonic()) < end:
            before = sum(started)
            work(1.0)
            if sum(started) > before:
                last_start = now
            peak_rss = max(peak_rss, rss_bytes(replay.pid))
            peak_buffer = max(peak_buffer, replay.metric("crl_replay_buffer_bytes"))
        stalled_for = time.monotonic() - last_start
        print(f"paused {pause_s:.0f} s: rollouts started {started_at_pause} -> {sum(started)} "
              f"(none in the last {stalled_for:.0f} s), replay buffer peak "
              f"{peak_buffer / 2**20:.1f} MiB (bound {MAX_BUFFER_BYTES / 2**20:.0f}), RSS "
              f"{baseline / 2**20:.0f} -> peak {peak_rss / 2**20:.0f} MiB")
        assert stalled_for >= pause_s / 2, "actors kept starting rollouts without a learner"
        assert peak_buffer <= MAX_BUFFER_BYTES
        assert peak_rss <= baseline + MAX_BUFFER_BYTES + RSS_ALLOWANCE
        assert replay.metric("crl_replay_dropped_total", reason="full") == dropped_full_at_pause
    finally:
        context.destroy(linger=0)
        replay.stop()
