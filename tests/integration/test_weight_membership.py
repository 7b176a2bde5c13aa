"""Elastic membership of the weight broadcast, with real processes: a replay,
the learner under torchrun (2 ranks: gathering full tensors from FSDP2 shards
is a collective) and `compactionrl actor` processes with vLLM engines.

An actor that joins after the first publication gets the weights at once and
both end on the same version; an actor that freezes mid-run makes one
publication fail after the group timeout, the learner carries on, and the
next publication reaches the survivor."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.summary import scrape
from protocol.transport import TransportConfig
from tests.ports import free_ports, loopback_addresses
from tests.processes import SMALL_EPISODES, Background, wait_until
from tests.replay_thread import ReplayThread

pytestmark = pytest.mark.slow

#: Short episodes, frequent heartbeats, a short group timeout: a test-sized run.
SMALL_RUN = [*SMALL_EPISODES,
             "--actors.environment.max_steps", "8",
             "--actors.concurrent_episodes", "1",
             "--actors.metrics_port", "0",
             "--transport.heartbeat_interval_s", "0.5",
             "--transport.heartbeat_liveness", "16",
             "--learner.weight_timeout_s", "5",
             "--learner.metrics_port", "0",
             "--learner.max_steps", "1000"]


def _acknowledged_segments(port: int) -> float:
    samples = scrape(f"http://127.0.0.1:{port}/metrics") or {}
    sent = sum(v for _, v in samples.get("crl_actor_segments_sent_total", []))
    unacked = sum(v for _, v in samples.get("crl_actor_unacked_segments", []))
    return sent - unacked


def _versions(log: str, pattern: str) -> list[int]:
    return [int(v) for v in re.findall(pattern, log)]


@pytest.fixture
def run(tiny_model_dir: Path, tmp_path: Path) -> Iterator[dict]:
    [control_address] = loopback_addresses(1)
    [store_port] = free_ports(1)
    replay = ReplayThread.on_loopback(
        TransportConfig(heartbeat_interval_s=0.5, heartbeat_liveness=16),
        vocab_size=json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"],
        rollouts_per_batch=2, max_staleness=4, durable_log=False)
    actor_address, learner_address = replay.config.actor_address, replay.config.learner_address
    common = ["--run.model", str(tiny_model_dir), "--run.out_dir", str(tmp_path),
              "--replay.actor_address", actor_address, "--replay.learner_address",
              learner_address, "--learner.control_address", control_address,
              "--learner.weight_store_address", f"127.0.0.1:{store_port}", *SMALL_RUN]
    started: list[Background] = []

    def start(name: str, *args: str) -> Background:
        # the command, the shared settings, then this process's own (they win)
        process = Background([args[0], *common, *args[1:]], tmp_path / f"{name}.log")
        started.append(process)
        return process

    try:
        yield {"start": start}
    finally:
        for process in started:
            process.stop()
        replay.close()


def test_late_joiner_and_frozen_member(run: dict) -> None:
    """One run (engine starts are the cost): a late joiner gets the current
    weights at once, ends on the same version as the first actor and
    contributes segments; then it
    freezes, one publication fails after the group timeout, the learner
    carries on, and the next publication reaches the survivor alone."""
    learner = run["start"]("learner", "learner", "--learner.nproc", "1")
    survivor = run["start"]("a", "actor", "--actor-id", "actor-a", "--index", "0")
    learner.wait_for("published version 1 to 1 actors", timeout=300)
    survivor.wait_for("loaded version 1", timeout=30)

    [late_metrics] = free_ports(1)
    # index 0: its metrics port is exactly actors.metrics_port (actor i adds i).
    # Its own core: with "auto" vLLM pins every engine's worker to the same
    # core (all allowed but the last), and there the newcomer's worker,
    # migrated onto the core of the survivor's busy worker, was starved while
    # it imported (0.1 % of the core for minutes; Linux 6.18). `up` gives each
    # actor its core from birth; the faults test's second actor does this too.
    late = run["start"]("b", "actor", "--actor-id", "actor-b", "--index", "0",
                        "--actors.metrics_port", str(late_metrics),
                        "--actors.engine.cpu_threads_bind", str(max(os.sched_getaffinity(0))))
    late.wait_for("loaded version", timeout=300)  # at once, not at its first episode
    joined_at = _versions(late.log(), r"loaded version (\d+)")[0]
    assert joined_at > 1
    target = joined_at + 1  # a publication to both
    survivor.wait_for(f"loaded version {target}", timeout=120)
    late.wait_for(f"loaded version {target}", timeout=30)
    # the learner logs the publication once both confirmed: after they log the load
    learner.wait_for(f"published version {target} to 2 actors", timeout=30)
    # and it contributes: the replay acknowledged segments it generated
    wait_until(lambda: _acknowledged_segments(late_metrics) > 0, 120, "segments from actor-b")

    late.send(signal.SIGSTOP)  # still a member until its heartbeats are missed
    learner.wait_for("failed", timeout=120)  # the group did not form, or a broadcast timed out
    late.stop()
    # the learner carries on; the next publication reaches the survivor alone
    learner.wait_for("to 1 actors", timeout=120, count=2)
    last = _versions(learner.log(), r"published version (\d+) to 1 actors")[-1]
    survivor.wait_for(f"loaded version {last}", timeout=30)
    assert learner.process.poll() is None
