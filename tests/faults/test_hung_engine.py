"""An actor whose engine hangs alive during a weight update (its engine core
stopped, as a stuck kernel or a deadlock leaves it) counts the engine as
dead once the join or load exceeds its bound (actors/learner_link.py
``load_bound_s``), and exits with ``ENGINE_DIED_EXIT`` for a restart, leaving
no process: before, it heartbeat on and stayed a member of its lane, and
every later publication to it failed at its deadline. The learner here is a
scripted control socket (tests/protocol_clients.py ``ControlServer``); the
engine is vLLM's, on the CPU."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import zmq

from actors.learner_link import load_bound_s
from actors.process import ENGINE_DIED_EXIT
from protocol import GroupInfo, Hello, MemberWelcome, TensorSpec, WeightManifest, WeightsAnnounce
from tests.ports import free_ports, loopback_addresses
from tests.processes import SMALL_EPISODES, Background, engine_core, process_tree, running_after
from tests.protocol_clients import ControlServer
from tests.replay_thread import ReplayThread

pytestmark = pytest.mark.slow

#: The announced group's deadline: the bound is a few of them.
TIMEOUT_S = 1.0


def test_an_actor_whose_engine_hangs_in_a_weight_update_exits_for_a_restart(
        tiny_model_dir: Path, tmp_path: Path, short_tmp: Path, context: zmq.Context) -> None:
    [control_address] = loopback_addresses(1)
    [store_port] = free_ports(1)  # nobody listens: the engine never gets that far
    control = ControlServer(context, control_address)
    with ReplayThread.on_loopback(rollouts_per_batch=10_000, durable_log=False) as replay:
        actor = Background(["actor", "--run.model", str(tiny_model_dir),
                            "--replay", replay.config.actor_address,
                            "--learner", control_address,
                            "--actors.engine.cpu_threads_bind", "nobind", *SMALL_EPISODES],
                           tmp_path / "actor.log", env={"TMPDIR": str(short_tmp)})
        tree: list[int] = []
        try:
            hello = control.receive_until(Hello, 300)
            control.send(MemberWelcome, run_id="hung-engine", policy_version=0,
                         heartbeat_interval_s=1.0, heartbeat_liveness=30)
            tree = process_tree(actor.process.pid)
            os.kill(engine_core(actor.process.pid), signal.SIGSTOP)
            manifest = WeightManifest(tensors=[TensorSpec(name="w", dtype="float32",
                                                          shape=[4])], bucket_bytes=0)
            control.send(WeightsAnnounce, version=1, manifest=manifest, group=GroupInfo(
                generation=1, master_addr="127.0.0.1", master_port=store_port, world_size=2,
                rank=1, backend="gloo", timeout_s=TIMEOUT_S))
            announced = time.monotonic()
            assert actor.process.wait(timeout=120) == ENGINE_DIED_EXIT, actor.log()[-4000:]
            took = time.monotonic() - announced
            assert "the vLLM engine hangs: joining a weight group took longer" in actor.log()
            assert hello.engine.device == "cpu"
            print(f"\n[measured] the actor exited {took:.1f} s after the announcement "
                  f"(bound {load_bound_s(manifest, TIMEOUT_S):.1f} s)")
            # no process of the actor's is left, the stopped engine core included
            assert running_after(tree, 30) == []
        finally:
            actor.stop(signal.SIGKILL, timeout=30)
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

