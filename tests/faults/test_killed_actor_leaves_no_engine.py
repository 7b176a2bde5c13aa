"""An actor and its vLLM engine do not outlive each other.

An actor started by hand and SIGKILLed takes its engine with it: the engine
core (which on CPU runs the model itself; a worker per GPU elsewhere) and
multiprocessing's resource tracker, which in a chaos
run outlived the actor for minutes (on a GPU they hold the memory the
restarted actor's engine needs). The engine's ipc socket files, left in the
actor's socket folder, go when the next engine on the machine starts.

An actor whose engine core dies (vLLM's process goes on without it) gives
its rollouts in flight up and exits with ``ENGINE_DIED_EXIT``, leaving no
process: before, it heartbeat on with no episodes. ``up`` restarts a child
that exited whatever its exit code (``Up._restart_if_exited``): the fault run's phase 2
(tests/faults/test_up_faults.py) has it restart an actor SIGKILLed with
episodes in flight, which rejoins with the current weights."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from actors.engine import SOCKET_FOLDER_PREFIX
from actors.process import ENGINE_DIED_EXIT
from tests.processes import (
    SMALL_EPISODES,
    Background,
    command_line,
    engine_core,
    process_tree,
    run_command,
    running_after,
    wait_until,
)
from tests.replay_thread import ReplayThread

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]


def test_a_sigkilled_actor_leaves_no_engine_process_and_its_sockets_go_at_the_next_start(
        tiny_model_dir: Path, tmp_path: Path, short_tmp: Path) -> None:
    # a plain TCP listener, not a replay: the actor connects to it once its
    # engine runs, then waits for a greeting that never comes
    tmp = short_tmp
    listener = socket.create_server(("127.0.0.1", 0))
    actor = Background(["actor", "--run.model", str(tiny_model_dir), "--no-learner",
                        "--replay", f"tcp://127.0.0.1:{listener.getsockname()[1]}",
                        "--actors.engine.cpu_threads_bind", "nobind"],
                       tmp_path / "actor.log", env={"TMPDIR": str(tmp)})
    tree: list[int] = []
    try:
        with listener:
            listener.settimeout(1.0)
            deadline = time.monotonic() + 240
            while True:
                with contextlib.suppress(TimeoutError):
                    listener.accept()[0].close()
                    break
                assert actor.process.poll() is None, actor.log()[-4000:]
                assert time.monotonic() < deadline, f"no engine:\n{actor.log()[-4000:]}"
        tree = process_tree(actor.process.pid)
        engine = [p for p in tree if "EngineCore" in command_line(p)]
        assert engine, [command_line(p) for p in tree]
        os.kill(actor.process.pid, signal.SIGKILL)  # the actor alone, not its group
        actor.process.wait()
        left = running_after(tree, 30)
        assert left == [], {p: command_line(p) for p in left}
        [folder] = tmp.glob(f"{SOCKET_FOLDER_PREFIX}*")
        assert any(p.is_socket() for p in folder.iterdir())  # vLLM's, left by the kill
    finally:
        actor.stop()
        for pid in tree:  # the group's kill misses nothing that escaped it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # the next process to make a socket folder (before its engine starts)
    # removes the dead actor's, and its own at exit
    sweep = run_command([sys.executable, "-c",
                         "from actors.engine import vllm_socket_folder; vllm_socket_folder()"],
                        timeout=60, env={"TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)})
    assert sweep.returncode == 0, sweep.stderr[-4000:]
    assert list(tmp.glob(f"{SOCKET_FOLDER_PREFIX}*")) == []
    assert [p for p in tmp.rglob("*") if p.is_socket()] == []


def test_an_actor_whose_engine_dies_gives_its_rollouts_up_and_exits_for_a_restart(
        tiny_model_dir: Path, tmp_path: Path, short_tmp: Path) -> None:
    # no learner: every rollout the actor finishes stays ready in the replay
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    with ReplayThread.on_loopback(vocab_size=vocab_size, rollouts_per_batch=10_000,
                                  durable_log=False) as replay:
        actor = Background(["actor", "--run.model", str(tiny_model_dir), "--no-learner",
                            "--replay", replay.config.actor_address,
                            "--actors.engine.cpu_threads_bind", "nobind", *SMALL_EPISODES,
                            "--actors.environment.max_steps", "40"],  # long: several segments
                           tmp_path / "actor.log", env={"TMPDIR": str(short_tmp)})
        tree: list[int] = []
        try:
            def pending() -> float:
                return replay.metric("crl_replay_rollouts", state="pending")

            wait_until(lambda: pending() >= 1, 300, "a rollout in flight at the replay",
                       actor.process, lambda: actor.log()[-4000:])
            tree = process_tree(actor.process.pid)
            engine = engine_core(actor.process.pid)
            in_flight, ready = pending(), replay.metric("crl_replay_rollouts", state="ready")
            os.kill(engine, signal.SIGKILL)  # the engine core alone: the actor lives on
            assert actor.process.wait(timeout=120) == ENGINE_DIED_EXIT, actor.log()[-4000:]
            assert "the vLLM engine died" in actor.log()
            # each rollout in flight at the kill was given up at once (not
            # expired: the replay has not declared the actor dead), unless it
            # finished first
            assert pending() == 0
            assert replay.metric("crl_replay_dropped_total", reason="expired") == 0
            abandoned = replay.metric("crl_replay_dropped_total", reason="abandoned")
            finished = replay.metric("crl_replay_rollouts", state="ready") - ready
            assert abandoned + finished >= in_flight and abandoned >= 1, (in_flight, abandoned,
                                                                          finished)
            left = running_after(tree, 30)
            assert left == [], {p: command_line(p) for p in left}
        finally:
            actor.stop()
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
