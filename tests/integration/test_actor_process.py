"""The actor process against a real ZeroMQ peer speaking the protocol:
credits, resends after a lost ack, heartbeats, a flushing SIGTERM, and the
run timeline it writes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from ops.timeline import TRACE_FOLDER, chrome_trace
from tests.ports import free_ports
from tests.processes import SMALL_EPISODES, VENV_BIN, wait_until
from tests.replay_peer import ReplayPeer

pytestmark = pytest.mark.slow

ACTOR_RUN = [*SMALL_EPISODES, "--actors.ack_timeout_s", "1.0", "--actors.on_shutdown", "finish",
             "--actors.shutdown_deadline_s", "60", "--transport.heartbeat_interval_s", "0.5"]
ENGINE_START_S = 120


@dataclass
class ActorRun:
    peer: ReplayPeer
    exit_code: int
    sigterm_at: float
    first_rollouts: set[str]
    stderr: str
    metrics: str
    credits_recovered: float
    probes: dict[str, str]
    """/readyz and /healthz once registered and running."""
    run_dir: Path
    """Where its timeline went: run.out_dir/run.name."""


def _scrape(port: int, path: str = "/metrics") -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).read().decode()


def _rollouts_counted(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("crl_actor_rollouts_total{"))


def _resent(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("crl_actor_segments_resent_total"))


@pytest.fixture(scope="module")
def actor_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ActorRun:
    peer = ReplayPeer(credits_on_welcome=3)
    [port] = free_ports(1)
    out_dir = tmp_path_factory.mktemp("runs")
    process = subprocess.Popen(
        [str(VENV_BIN / "compactionrl"), "actor", "--no-learner", "--replay", peer.address,
         "--actor-id", "actor-t", "--run.model", str(tiny_model_dir), *ACTOR_RUN,
         "--actors.metrics_port", str(port), "--run.out_dir", str(out_dir),
         "--run.name", "added"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # three credited rollouts, the first ack lost on the way
        wait_until(lambda: peer.finished() == 3, ENGINE_START_S + 120, "three rollouts finished",
                   process, poll_s=0.2, between=peer.pump)
        first = set(peer.rollouts())
        # the actor counts a rollout just after sending its last segment, and
        # resends the segment whose ack was lost once ack_timeout_s has passed
        # (short episodes can all end before that)
        scraped: list[str] = []

        def all_counted() -> bool:
            scraped.append(_scrape(port))
            return (_rollouts_counted(scraped[-1]) == 3
                    and _resent(scraped[-1]) >= 1)

        wait_until(all_counted, 30, "every rollout counted", process, poll_s=0.2,
                   between=peer.pump)
        metrics = scraped[-1]
        probes = {path: _scrape(port, path).strip() for path in ("/readyz", "/healthz")}
        # one more rollout, its credit in a reply lost on the way (made up after
        # the actor's next heartbeat) and its acks withheld; SIGTERM while it runs
        peer.withhold_acks = True
        peer.grant(1, lost=True)
        wait_until(lambda: len(peer.rollouts()) == 4, 60, "a fourth rollout", process,
                   poll_s=0.2, between=peer.pump)
        credits_recovered = _sample(_scrape(port), "crl_actor_credits_recovered_total")
        sigterm_at = time.monotonic()
        process.send_signal(signal.SIGTERM)
        peer.pump(3.0)  # the actor finishes the episode and resends while unacknowledged
        peer.release_acks()
        end = time.monotonic() + 90
        while process.poll() is None and time.monotonic() < end:
            peer.pump(0.2)
        exit_code = process.wait(timeout=5)
        return ActorRun(peer, exit_code, sigterm_at, first, process.stderr.read(), metrics,
                        credits_recovered, probes, out_dir / "added")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        else:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # engine children, if any remain
            except ProcessLookupError:
                pass
        process.wait()
        peer.close()


def test_actor_registers_and_sends_heartbeats(actor_run: ActorRun) -> None:
    assert actor_run.peer.hellos == 1
    assert actor_run.peer.heartbeats >= 2


def test_starts_no_more_rollouts_than_credits(actor_run: ActorRun) -> None:
    assert len(actor_run.peer.rollouts()) == 4  # 3 on Welcome + 1 granted


def test_credits_of_a_lost_reply_are_made_up_and_counted(actor_run: ActorRun) -> None:
    assert actor_run.peer.credits_seen == actor_run.peer.credits_total == 4
    assert actor_run.credits_recovered == 1


def test_lost_ack_is_resent_with_the_same_identity_and_not_duplicated(actor_run: ActorRun) -> None:
    peer = actor_run.peer
    assert peer.duplicates >= 1
    first_frame = peer.frames[0][1]
    assert sum(frame == first_frame for _, frame in peer.frames) >= 2
    for rollout_id, segments in peer.rollouts().items():
        assert [s.index for s in segments] == list(range(len(segments))), rollout_id
        assert segments[-1].final and not any(s.final for s in segments[:-1])


def test_sigterm_finishes_the_episode_and_flushes_every_segment(actor_run: ActorRun) -> None:
    assert actor_run.exit_code == 0, actor_run.stderr[-3000:]
    [last] = set(actor_run.peer.rollouts()) - actor_run.first_rollouts
    segments = actor_run.peer.rollouts()[last]
    assert segments[-1].final
    late = [t for t, _ in actor_run.peer.frames if t > actor_run.sigterm_at]
    assert late, "segments were flushed after SIGTERM"


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_metrics_use_the_design_names(actor_run: ActorRun) -> None:
    metrics = actor_run.metrics
    assert _rollouts_counted(metrics) == 3
    assert _sample(metrics, "crl_actor_compactions_total") >= 0
    assert _sample(metrics, "crl_actor_compaction_tokens_total") >= 0
    assert _sample(metrics, "crl_actor_generated_tokens_total") > 0
    assert _sample(metrics, "crl_actor_policy_version") == 0
    for reason in ("weights", "credits", "summary"):
        assert f'crl_actor_stall_seconds_total{{reason="{reason}"}}' in metrics
    assert 'crl_actor_engine_info{device="cpu",dtype="bfloat16"' in metrics
    assert _sample(metrics, "crl_actor_segments_resent_total") >= 1
    # vLLM's own engine metrics, renamed lint-clean (vllm:x -> vllm_x)
    assert _sample(metrics, "vllm_num_requests_running") >= 0
    assert not [line for line in metrics.splitlines() if line.startswith("vllm:")]


def test_a_registered_actor_is_ready_and_alive(actor_run: ActorRun) -> None:
    assert actor_run.probes == {"/readyz": "ready", "/healthz": "alive"}


def test_the_actor_says_at_start_how_many_episodes_windows_its_kv_cache_holds(
        actor_run: ActorRun) -> None:
    assert re.search(r"the engine's KV cache holds \d+ tokens: \d+ episodes' full windows",
                     actor_run.stderr), actor_run.stderr[-3000:]


def test_an_added_actor_writes_every_episode_to_the_run_timeline(actor_run: ActorRun) -> None:
    """An actor started on its own (as a user adds one to a running job)
    writes its spans to RUN/trace/actor-<id>.jsonl, those of the episode it
    finished after SIGTERM included, and ``compactionrl view`` merges them."""
    lines = (actor_run.run_dir / TRACE_FOLDER / "actor-actor-t.jsonl").read_text().splitlines()
    spans = [json.loads(line) for line in lines]
    episodes = [s for s in spans if s["name"] == "episode"]
    assert {s["args"]["rollout"] for s in episodes} == set(actor_run.peer.rollouts())
    assert all(re.fullmatch(r"slot \d+", s["tid"]) and s["dur"] > 0 for s in episodes)
    merged = chrome_trace(actor_run.run_dir)["traceEvents"]
    assert sum(e["ph"] == "X" and e["name"] == "episode" for e in merged) == len(episodes)
