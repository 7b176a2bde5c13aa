"""A harness CompactionRL did not write trains end to end through the
recording endpoint: `compactionrl up` (replay, learner under torchrun, one
actor whose vLLM engine serves the endpoint instead of its own episodes),
and examples/keyvault_agent.py, an agent loop on the ``openai`` client with
its own compaction prompt, playing KeyVault episodes against it (its
readiness wait and its rewards are docs/endpoint.md's code). Its calls
become execution and summary segments, its rewards close the rollouts, and
the learner trains on them (summary segments included)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ops.browser import CHROMIUM, rendered_dom
from tests.ports import free_ports
from tests.processes import UpOnLoopback, metric, wait_until

pytestmark = pytest.mark.slow

HARNESS = Path(__file__).parents[2] / "examples" / "keyvault_agent.py"
EPISODES = 8


def test_a_harness_s_calls_and_its_own_compactions_are_trained(tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    [endpoint_port] = free_ports(1)
    # the guide's command, with the user's own settings in one file layered
    # over the default
    harness_toml = tmp_path / "harness.toml"
    harness_toml.write_text(f"[actors.endpoint]\nport = {endpoint_port}\n")
    up = UpOnLoopback(tmp_path, "harness", tiny_model_dir, 1, "--learner.max_steps", "1000",
                      "--replay.rollouts_per_batch", "4", "--actors.concurrent_episodes", "4",
                      "--config", str(harness_toml), "--actors.endpoint.enabled", "true")
    ports = up.ports
    process = up.start()
    try:
        def up_output() -> str:
            """`up`'s output once it has exited (before, reading it would block)."""
            return process.stdout.read()[-4000:] if process.poll() is not None else ""

        wait_until(lambda: metric(ports["actor"], "crl_actor_credits_held") >= 1, 300,
                   "credit at the actor (its engine up, registered)", process, up_output,
                   poll_s=1)
        harness = subprocess.run(
            [sys.executable, str(HARNESS), "--base-url", f"http://127.0.0.1:{endpoint_port}/v1",
             "--episodes", str(EPISODES), "--concurrency", "4", "--max-steps", "12"],
            capture_output=True, text=True, timeout=600)
        assert harness.returncode == 0, harness.stderr[-4000:]
        episodes = [json.loads(line) for line in harness.stdout.splitlines()]
        assert len(episodes) == EPISODES
        wait_until(lambda: metric(ports["learner"], "crl_learner_step") >= 1, 300,
                   "learner step", process, up_output, poll_s=1)
        trained = {kind: metric(ports["learner"], "crl_learner_trained_segments_total",
                                segment_type=kind) for kind in ("execution", "summary")}
        calls = {kind: metric(ports["actor"], "crl_actor_endpoint_calls_total",
                              segment_type=kind) for kind in ("execution", "summary")}
        rewarded = metric(ports["actor"], "crl_actor_endpoint_sessions_total", end="rewarded")
        # a session that starts before a finished one's credit is back is
        # told to retry (429); nothing else may be refused
        errors = (metric(ports["actor"], "crl_actor_endpoint_errors_total")
                  - metric(ports["actor"], "crl_actor_endpoint_errors_total", reason="no_credit")
                  - metric(ports["actor"], "crl_actor_endpoint_errors_total",
                           reason="weights_behind"))
        accepted = metric(ports["replay"], "crl_replay_segments_total", result="accepted")
        steps = metric(ports["learner"], "crl_learner_step")
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=300)
    finally:
        up.stop_tree()
    assert process.returncode == 130, output[-4000:]
    # the run's figures (pytest -s shows them)
    print(json.dumps({"sessions": len(episodes), "segments": accepted,
                      "summaries_per_session": [e["summaries"] for e in episodes],
                      "calls": calls, "trained_segments": trained,
                      "learner_steps_when_read": steps}))
    summaries = sum(e["summaries"] for e in episodes)
    assert summaries > 0, episodes  # the harness compacted with its own prompt
    assert calls["summary"] == summaries
    assert calls["execution"] == sum(e["steps"] for e in episodes)
    assert rewarded == EPISODES and errors == 0
    # every session's segments reached the replay: one per summary and one
    # per execution window at least
    assert accepted >= sum(2 * e["summaries"] + 1 for e in episodes)
    assert sum(e["recorded"]["segments"] for e in episodes) == accepted
    assert trained["summary"] > 0 and trained["execution"] > 0, trained
    assert (up.folder / "export" / "config.json").is_file()
    # what the learner trained with, and where the run's time went, as a
    # reader opens them: the viewer's page and the Chrome trace
    trace = json.loads((up.folder / "trace.json").read_text())
    spans = {(e["pid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["name"] == "process_name"}
    assert {(processes[pid], name) for pid, name in spans} >= {("learner", "step"),
                                                               ("replay", "batch")}
    if CHROMIUM is not None:
        dom = rendered_dom(up.folder / "viewer.html")
        assert re.search(r'class="rollout" data-id="\d+-\d+"', dom)  # kept rollouts shown
        # the shown rollouts' trained tokens, coloured by the advantage they
        # were trained with (test_viewer_page.py checks the rest of the page)
        assert re.search(r'<span class="trained"[^>]*style="background: rgb\(', dom)
        assert '<rect' in dom
