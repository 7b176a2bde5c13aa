"""The learner under torchrun (2 ranks) against the real replay service:
it pulls batches, trains, checkpoints, exports, and resumes. Its critic is a
value head here (`compactionrl up`'s tests run the default, a critic model),
warmed up for one value-only step, with the paper's adaptive lambda."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.ports import free_ports, loopback_addresses
from tests.processes import compactionrl
from tests.replay_thread import ReplayThread

pytestmark = pytest.mark.slow


def test_learner_trains_checkpoints_exports_and_resumes(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    [control] = loopback_addresses(1)
    [store] = free_ports(1)
    replay = ReplayThread.on_loopback(rollouts_per_batch=2, max_staleness=8, durable_log=False)
    actor_address, learner_address = replay.config.actor_address, replay.config.learner_address
    service = replay.service
    actor = replay.actor()
    common = ["--run.model", str(tiny_model_dir), "--run.out_dir", str(tmp_path),
              "--run.name", "learn", "--replay.learner_address", learner_address,
              "--replay.actor_address", actor_address, "--learner.nproc", "2",
              "--learner.metrics_port", "0", "--learner.checkpoint_every", "1",
              # ports of its own: not the defaults another run on this machine may hold
              "--learner.control_address", control,
              "--learner.weight_store_address", f"127.0.0.1:{store}",
              "--learner.critic", "value_head"]
    try:
        actor.hello()
        for _ in range(12):
            actor.push_rollout(segments=3, tokens=48)
        assert actor.pump_until(lambda: not actor.unacked)

        first = compactionrl("learner", *common, "--learner.max_steps", "3",
                             "--learner.critic_warmup_steps", "1",
                             "--learner.lam_mode", "adaptive",
                             "--learner.keep_last", "2", "--learner.export_every", "2",
                             "--tracking.backends", '["tensorboard"]',
                             "--tracking.samples_every", "2", timeout=300)
        assert first.returncode == 0, first.stderr[-4000:]
        run = tmp_path / "learn"
        # rank 0 tracked every step, and sampled rollouts at step 2
        events = EventAccumulator(str(run / "tracking" / "tensorboard"),
                                  size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        assert [e.step for e in events.Scalars("rollouts/reward")] == [1, 2, 3]
        assert [t.step for t in events.Tensors("rollouts/samples/text_summary")] == [2]
        checkpoints = run / "checkpoints"
        # retention: the newest two; an export beside the checkpoint of step 2;
        # the warm-up step moved no version
        assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-2", "step-3"]
        assert json.loads((checkpoints / "step-2" / "meta.json").read_text()) == {
            "version": 1, "step": 2}
        assert "step 1: version 0" in first.stderr and "step 3: version 2" in first.stderr
        assert (run / "exports" / "step-2" / "model.safetensors").is_file()

        # resuming from step 2 sets the later branch aside and goes on from there
        resumed = compactionrl("learner", *common, "--learner.max_steps", "4", "--resume", "2",
                               timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert "resumed from" in resumed.stderr and "step-2" in resumed.stderr
        assert (checkpoints / "abandoned-after-step-2" / "step-3" / "meta.json").is_file()
        assert json.loads((checkpoints / "step-4" / "meta.json").read_text())["step"] == 4
        assert service.metrics.registry.get_sample_value("crl_replay_batches_total") == 5

        missing = compactionrl("learner", *common, "--resume", "99", timeout=300)
        assert missing.returncode != 0 and "no complete checkpoint" in missing.stderr

        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(run / "export")
        assert not any(name.startswith("value_head.")
                       for name in load_file(run / "export" / "model.safetensors"))
    finally:
        actor.close()
        replay.close()
