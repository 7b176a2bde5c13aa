"""The PPO step on the tiny model in one process, and batch checks."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from learner.batch import BatchError, to_train_batch
from learner.config import LearnerConfig
from learner.models import load_critic, load_policy
from learner.ppo import PPOTrainer
from protocol import Batch, Rollout
from protocol.synthetic import synthetic_batch


def trainer(model_dir: Path, **changes) -> PPOTrainer:
    torch.manual_seed(0)
    return PPOTrainer(load_policy(str(model_dir)), load_critic(str(model_dir)),
                      LearnerConfig(**changes))


def snapshot(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("changes", [
    {}, {"advantage": "independent"}, {"advantage": "grpo"}, {"loss_norm": "segment"},
    {"is_mode": "mask", "ppo_epochs": 2, "minibatches": 2}, {"whiten_advantages": True},
])
def test_a_step_updates_policy_and_critic(tiny_model_dir: Path, changes: dict) -> None:
    ppo = trainer(tiny_model_dir, **changes)
    before = snapshot(ppo.policy), snapshot(ppo.critic)
    metrics = ppo.step(to_train_batch(synthetic_batch(), train_summary=True))
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["tokens"] > 0 and "losses/clipfrac" in metrics
    for old, module in zip(before, (ppo.policy, ppo.critic), strict=True):
        assert any(not torch.equal(a, b) for a, b in zip(old, module.parameters(), strict=True))


def test_one_minibatch_takes_prox_and_old_values_from_its_first_update(tiny_model_dir: Path
                                                                      ) -> None:
    batch = to_train_batch(synthetic_batch(), train_summary=True)
    fused = trainer(tiny_model_dir, ppo_epochs=2)
    fused_metrics = fused.step(batch)
    # the general path: no-gradient forward passes at the step's start first
    reference = trainer(tiny_model_dir, ppo_epochs=2)
    part = reference._prepare(batch, batch.assign(batch.minibatches(1)[0], 1)[0], fused=False)
    sums: defaultdict[str, float] = defaultdict(float)
    for _ in range(2):
        reference._update(part, sums, batch)
    for module, expected in ((fused.policy, reference.policy), (fused.critic, reference.critic)):
        for a, b in zip(module.parameters(), expected.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fused_metrics["losses/policy_loss"] == pytest.approx(
        sums["losses/policy_loss"] / 2, rel=1e-4, abs=1e-7)


def test_a_summary_shares_the_sequence_of_the_window_it_summarises() -> None:
    wire = synthetic_batch(rollouts=8)
    batch = to_train_batch(wire, train_summary=True)
    apart = to_train_batch(wire, train_summary=True, share_prefixes=False)
    assert len(batch.sequences) < len(apart.sequences)
    for rollout in range(8):
        shared = [s for s in batch.sequences if s.rollout == rollout]
        alone = [s for s in apart.sequences if s.rollout == rollout]
        # execution + summary in one sequence, then the last execution segment
        assert [s.segment_lengths for s in shared] == (
            [[int(alone[0].trainable.sum()), int(alone[1].trainable.sum())],
             [int(alone[2].trainable.sum())]] if len(alone) == 3
            else [[int(alone[0].trainable.sum())]])
        assert torch.equal(shared[0].tokens, alone[1 if len(alone) == 3 else 0].tokens)
    assert sum(int(s.trainable.sum()) for s in batch.sequences) == sum(
        int(s.trainable.sum()) for s in apart.sequences)
    assert sum(len(s.tokens) for s in batch.sequences) < sum(
        len(s.tokens) for s in apart.sequences)


@pytest.mark.parametrize("changes", [
    {}, {"advantage": "independent"}, {"advantage": "grpo"}, {"loss_norm": "segment"},
    {"train_summary": False},
])
def test_shared_prefixes_leave_the_update_unchanged(tiny_model_dir: Path, changes: dict) -> None:
    wire = synthetic_batch(rollouts=8)
    updated = []
    for share in (True, False):
        ppo = trainer(tiny_model_dir, **changes)
        ppo.step(to_train_batch(wire, changes.get("train_summary", True), share))
        updated.append([*ppo.policy.parameters(), *ppo.critic.parameters()])
    for a, b in zip(*updated, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_without_summary_training_summary_tokens_leave_the_loss(tiny_model_dir: Path) -> None:
    batch = to_train_batch(synthetic_batch(), train_summary=False, share_prefixes=False)
    summaries = [s for s in batch.sequences if s.segment_type == "summary"]
    assert summaries and not any(s.trainable.any() for s in summaries)
    # a batch whose only trainable tokens were summaries: no gradient, no update
    ppo = trainer(tiny_model_dir)
    before = snapshot(ppo.policy)
    batch.sequences = summaries
    metrics = ppo.step(batch)
    assert metrics["tokens"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, ppo.policy.parameters(), strict=True))


def _without_final(batch: Batch) -> Batch:
    rollout = batch.rollouts[0]
    batch.rollouts[0] = Rollout(rollout_id=rollout.rollout_id, staleness=0,
                                segments=rollout.segments[:-1] or [])
    return batch


@pytest.mark.parametrize("damage, message", [
    (_without_final, "no final segment"),
    (lambda b: [setattr(b.rollouts[1].segments[-1], "reward", float("nan")), b][1],
     "no finite reward"),
])
def test_bad_batches_are_refused_before_any_update(damage, message: str) -> None:
    with pytest.raises(BatchError, match=message):
        to_train_batch(damage(synthetic_batch()), train_summary=True)


def test_minibatches_and_rank_shares_are_the_same_cut_for_any_world_size() -> None:
    batch = to_train_batch(synthetic_batch(rollouts=7), train_summary=True)
    minibatches = batch.minibatches(3)
    assert sorted(r for m in minibatches for r in m) == list(range(7))
    for world in (1, 2, 3):
        shares = batch.assign(minibatches[0], world)
        assert sorted(r for share in shares for r in share) == minibatches[0]
