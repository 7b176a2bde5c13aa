"""Hostile input does not change learning (issue item 6): the learner, under
torchrun, trains the same steps on the same rollouts twice, once clean and
once while a hostile client floods the replay's actor socket and the
learner's control socket with every kind of bad frame. The step metrics and
the exported weights must be bit-identical: rejected frames reach neither a
batch nor the optimiser. (A real actor's generation is not deterministic, so
the rollouts come from a scripted actor.)"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
import zmq
from safetensors.torch import load_file

from protocol import Stamp
from protocol.transport import TransportConfig, connect_dealer
from tests.hostile_frames import control_catalogue, replay_catalogue
from tests.ports import free_ports, loopback_addresses
from tests.processes import compactionrl
from tests.replay_thread import ReplayThread

pytestmark = pytest.mark.slow

#: Rollouts per batch, rollouts pushed, learner steps: every rollout trained once.
BATCH, ROLLOUTS, STEPS = 2, 6, 3


class _Flood:
    """A thread sending bad frames to ``addresses`` round robin until stopped."""

    def __init__(self, context: zmq.Context, replay_address: str, control_address: str) -> None:
        self._targets = [
            (connect_dealer(context, replay_address, TransportConfig()),
             [frames for _, frames, _ in replay_catalogue(Stamp("hostile", 1))]),
            (connect_dealer(context, control_address, TransportConfig()),
             [frames for _, frames, _ in control_catalogue(Stamp("hostile", 1))])]
        self.sent = [0, 0]
        """Frames sent to the replay, to the control socket."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for target, (socket, catalogue) in enumerate(self._targets):
                try:
                    socket.send_multipart(catalogue[self.sent[target] % len(catalogue)],
                                          zmq.NOBLOCK)
                    self.sent[target] += 1
                except zmq.Again:  # its queue is full: the peer is not reading yet
                    pass
                while socket.poll(0):  # replies are read and dropped
                    socket.recv_multipart()
            self._stop.wait(0.001)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for socket, _ in self._targets:
            socket.close(linger=0)


def _train(model: Path, folder: Path, flood: bool) -> tuple[list[str], dict[str, torch.Tensor],
                                                           float, list[int]]:
    """Step log lines and exported weights of one learner run, the replay's
    rejected-message count, and the bad frames sent."""
    [control_address] = loopback_addresses(1)
    [store] = free_ports(1)  # not the default port, which another test's learner may hold
    replay = ReplayThread.on_loopback(rollouts_per_batch=BATCH, max_staleness=8,
                                      durable_log=False)
    actor_address, learner_address = replay.config.actor_address, replay.config.learner_address
    service, context = replay.service, replay.context
    actor = replay.actor(capacity=ROLLOUTS)
    flooding = None
    try:
        actor.hello()
        for _ in range(ROLLOUTS):
            actor.push_rollout(segments=3, tokens=48)
        assert actor.pump_until(lambda: not actor.unacked)
        if flood:
            flooding = _Flood(context, actor_address, control_address)
        result = compactionrl(
            "learner", "--run.model", str(model), "--run.out_dir", str(folder),
            "--run.name", "learn", "--replay.learner_address", learner_address,
            "--replay.actor_address", actor_address, "--learner.nproc", "1",
            "--learner.control_address", control_address, "--learner.metrics_port", "0",
            "--learner.weight_store_address", f"127.0.0.1:{store}",
            "--learner.max_steps", str(STEPS), "--learner.checkpoint_every", "1000",
            timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
        steps = re.findall(r"step \d+: .*", result.stderr)
        weights = load_file(folder / "learn" / "export" / "model.safetensors")
        rejected = sum(sample.value for sample in service.metrics.rejected.collect()[0].samples
                       if sample.name.endswith("_total"))
        return steps, weights, rejected, flooding.sent if flooding else [0, 0]
    finally:
        if flooding is not None:
            flooding.close()
        actor.close()
        replay.close()


def test_a_flood_of_bad_frames_leaves_training_bit_identical(tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    clean_steps, clean_weights, clean_rejected, _ = _train(tiny_model_dir, tmp_path / "clean",
                                                           flood=False)
    steps, weights, rejected, sent = _train(tiny_model_dir, tmp_path / "flood", flood=True)
    print(f"MEASURED flood during training: bad frames sent to the replay / the control "
          f"socket {sent}, rejections counted by the replay {rejected:.0f}; {len(steps)} "
          "steps and the exported weights identical to the clean run")
    assert len(clean_steps) == STEPS and clean_rejected == 0
    assert min(sent) > 500 and rejected > 0  # exact counting: test_hostile_input.py
    assert steps == clean_steps
    assert weights.keys() == clean_weights.keys()
    for name, tensor in clean_weights.items():
        assert torch.equal(weights[name], tensor), name
