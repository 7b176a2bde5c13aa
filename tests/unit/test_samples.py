"""What the learner keeps of its steps for the rollout viewer
(learner/samples.py): the tokens as the loss used them, within a bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from learner.batch import to_train_batch
from learner.config import LearnerConfig
from learner.losses import importance_weights
from learner.models import load_critic, load_policy, token_logprobs, token_values
from learner.ppo import PPOTrainer, share_values
from learner.samples import (
    SampleRecorder,
    TrainedRollout,
    kept_stride,
    read_samples,
)
from protocol.synthetic import synthetic_batch


def test_a_long_run_keeps_a_bounded_number_of_steps_from_its_start_to_its_end(
        tmp_path: Path) -> None:
    recorder = SampleRecorder(tmp_path / "samples", most_steps=8)
    one = TrainedRollout("t", 1.0, True, 2, {}, {})
    recorded = [step for step in range(1, 10_001) if recorder.wants(step)]
    for step in recorded:
        recorder.record(step, step, [one])
    kept = [sample["step"] for sample in read_samples(tmp_path)]
    assert kept == [1024 * n for n in range(1, 10)][:len(kept)] and 4 <= len(kept) <= 8
    assert kept[0] <= 10_000 // 4 and kept[-1] >= 10_000 * 3 // 4  # early and late
    assert len(recorded) < 8 * 15  # a few per doubling of the run
    assert kept_stride(8, 8) == 1 and kept_stride(9, 8) == 2 and kept_stride(10_000, 8) == 2048
    assert not list((tmp_path / "samples").glob("*.partial"))


def test_every_step_is_kept_up_to_64_then_every_second_up_to_128_then_every_fourth(
        tmp_path: Path) -> None:
    recorder = SampleRecorder(tmp_path / "samples")
    one = TrainedRollout("t", 1.0, True, 2, {}, {})
    kept = {}
    for step in range(1, 201):
        if recorder.wants(step):
            recorder.record(step, step, [one])
        if step in (64, 100, 128, 200):
            kept[step] = [sample["step"] for sample in read_samples(tmp_path)]
    assert kept == {64: list(range(1, 65)), 100: list(range(2, 101, 2)),
                    128: list(range(2, 129, 2)), 200: list(range(4, 201, 4))}


def test_a_step_file_cut_short_is_skipped(tmp_path: Path) -> None:
    recorder = SampleRecorder(tmp_path / "samples")
    recorder.record(1, 1, [TrainedRollout("t", 0.0, False, 0, {}, {})])
    (tmp_path / "samples" / "step-0000002.json").write_text('{"step": 2, "rol')
    assert [sample["step"] for sample in read_samples(tmp_path)] == [1]


@pytest.mark.parametrize("changes", [{}, {"loss_norm": "segment", "advantage": "independent"},
                                     {"lam_mode": "adaptive", "is_cap": 1.5}])
def test_a_step_hands_over_each_token_as_its_loss_used_it(tiny_model_dir: Path,
                                                          changes: dict) -> None:
    """The advantages, importance weights and loss weights kept are those
    of the step: the advantages from the critic's values and pi_prox/mu from
    the policy at the step's start weights, computed apart here."""
    torch.manual_seed(0)
    config = LearnerConfig(**changes)
    policy, critic = load_policy(str(tiny_model_dir)), load_critic(str(tiny_model_dir))
    ppo = PPOTrainer(policy, critic, config)
    batch = to_train_batch(synthetic_batch(rollouts=8), train_summary=True)
    batch.infos = [{"rollout": float(r)} for r in range(batch.num_rollouts)]
    assert batch.actors == ["a"] * batch.num_rollouts  # the segments' sender_id
    batch.actors = [f"actor-{r}" for r in range(batch.num_rollouts)]
    share = ppo.plan(batch).shares[0]
    with torch.no_grad():
        starts = [(token_logprobs(policy, s.tokens[None])[0],
                   token_values(critic, s.tokens[None])[0]) for s in share.sequences]
    advantages = share_values(config, batch, share.sequences,
                              [v for _, v in starts]).advantages
    kept: list[list[TrainedRollout]] = []
    ppo.step(batch, sample=kept.append, sampled_rollouts=3)
    (rollouts,) = kept
    assert len(rollouts) == 3
    counts = [r.compactions for r in rollouts]
    assert counts == sorted(counts) and counts[0] == min(batch.compactions) and counts[-1] == max(
        batch.compactions)  # spread from fewest to most
    by_tokens = {tuple(s.tokens.tolist()): i for i, s in enumerate(share.sequences)}
    for rollout in rollouts:
        assert rollout.sequences
        for trained in rollout.sequences:
            i = by_tokens[tuple(trained.tokens)]
            sequence = share.sequences[i]
            assert rollout.info == batch.infos[sequence.rollout]
            assert rollout.actor == batch.actors[sequence.rollout]
            mask = sequence.trainable
            assert trained.trainable == mask.nonzero().flatten().tolist()
            assert len(trained.advantage) == int(mask.sum()) == sum(trained.segment_lengths)
            weight, _ = importance_weights(starts[i][0], sequence.behaviour_logprobs,
                                           config.is_cap, config.is_mode)
            scale = 1e-3  # four significant digits
            assert trained.is_weight == pytest.approx(weight[mask].tolist(), rel=scale)
            assert trained.advantage == pytest.approx(advantages[i][mask].tolist(), rel=scale,
                                                      abs=1e-5)
            assert trained.loss_weight == pytest.approx(share.loss_weights[i][mask].tolist(),
                                                        rel=scale)
            assert trained.versions == sequence.versions[mask].tolist()
            assert len(trained.factors) == len(trained.segment_types) == len(
                trained.segment_lengths)
    json.dumps([r.__dict__ for r in rollouts], default=lambda o: o.__dict__)
