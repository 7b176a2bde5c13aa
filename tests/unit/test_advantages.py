"""Cross-trajectory GAE against a plain loop and hand-computed cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.advantages import (
    adaptive_lambdas,
    advantages_and_returns,
    cross_trajectory_factors,
    cross_trajectory_gae,
    group_relative,
)
from tests.tolerances import rounding_tolerance


def loop_reference(values, lengths, rollout_of, rewards, gamma, lam, mode, token_rewards=None):
    """docs/design.md §2.3 written out token by token."""
    values = [float(v) for v in values]
    advantages, returns = [0.0] * len(values), [0.0] * len(values)
    offsets, start = [], 0
    for n in lengths:
        offsets.append(start)
        start += n
    for s, n in enumerate(lengths):
        start = offsets[s]
        later = sum(lengths[j] for j in range(s + 1, len(lengths))
                    if rollout_of[j] == rollout_of[s])
        running = 0.0
        for i in reversed(range(n)):
            t = start + i
            reward = float(token_rewards[t]) if token_rewards is not None else 0.0
            if i == n - 1:
                reward += float(rewards[rollout_of[s]])
                next_value = 0.0
            else:
                next_value = values[t + 1]
            delta = reward + gamma * next_value - values[t]
            running = delta + gamma * lam * running
            returns[t] = running + values[t]
            factor = (gamma * lam) ** later if mode == "cross" else 1.0
            advantages[t] = factor * running
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns,
                                                                        dtype=torch.float64)


@st.composite
def batches(draw):
    rollouts = draw(st.integers(1, 5))
    lengths, rollout_of = [], []
    for r in range(rollouts):
        for _ in range(draw(st.integers(1, 5))):
            lengths.append(draw(st.integers(0, 12)))  # empty segments included
            rollout_of.append(r)
    total = sum(lengths)
    values = draw(st.lists(st.floats(-2, 2), min_size=total, max_size=total))
    rewards = draw(st.lists(st.floats(-1, 1), min_size=rollouts, max_size=rollouts))
    per_token = draw(st.none() | st.lists(st.floats(-0.1, 0.1), min_size=total,
                                          max_size=total))
    return lengths, rollout_of, values, rewards, per_token


@settings(max_examples=300, deadline=None)
@given(batches(), st.sampled_from([1.0, 0.99]), st.sampled_from([1.0, 0.95, 0.0]),
       st.sampled_from(["cross", "independent"]))
def test_matches_the_loop_reference(batch, gamma: float, lam: float, mode: str) -> None:
    lengths, rollout_of, values, rewards, per_token = batch
    got_a, got_r = cross_trajectory_gae(
        torch.tensor(values, dtype=torch.float64), torch.tensor(lengths),
        torch.tensor(rollout_of), torch.tensor(rewards, dtype=torch.float64), gamma, lam, mode,
        None if per_token is None else torch.tensor(per_token, dtype=torch.float64))
    want_a, want_r = loop_reference(values, lengths, rollout_of, rewards, gamma, lam, mode,
                                    per_token)
    # The same float64 sums A_loc_i = sum_l (gamma lam)^l delta_{i+l} in another
    # order (a doubling scan, Horner's rule in the loop), over at most `longest`
    # terms of size <= max|delta|. Horner's rounding is bounded like a sum of
    # 2n terms (Higham §5.1), the scan's powers of gamma lam by squaring
    # likewise; +2: the discount factor and + V.
    longest = max(lengths, default=0)
    largest_value = max(map(abs, values), default=0.0)
    largest_delta = (max(map(abs, rewards)) + max(map(abs, per_token or [0.0]))
                     + (1 + gamma) * largest_value)
    tolerance = rounding_tolerance(longest * largest_delta + largest_value, 2 * longest + 2,
                                   torch.float64)
    torch.testing.assert_close(got_a, want_a, rtol=0, atol=tolerance)
    torch.testing.assert_close(got_r, want_r, rtol=0, atol=tolerance)


def test_hand_computed_two_segments() -> None:
    # one rollout: segment 0 has 2 trainable tokens, segment 1 has 1; R = 1
    values = torch.tensor([0.5, 0.25, 0.75], dtype=torch.float64)
    gamma, lam = 1.0, 0.5
    advantages, returns = cross_trajectory_gae(values, torch.tensor([2, 1]), torch.tensor([0, 0]),
                                               torch.tensor([1.0], dtype=torch.float64),
                                               gamma, lam)
    # segment 1: delta = 1 - 0.75 = 0.25; N_{>1} = 0
    # segment 0: delta_1 = 1 + 0 - 0.25 = 0.75 (reward at its own last token)
    #            delta_0 = 0 + 0.25 - 0.5 = -0.25; A_loc_0 = -0.25 + 0.5 * 0.75 = 0.125
    #            N_{>0} = 1 -> factor (gamma * lam)^1 = 0.5
    torch.testing.assert_close(advantages, torch.tensor([0.0625, 0.375, 0.25],
                                                        dtype=torch.float64))
    torch.testing.assert_close(returns, torch.tensor([0.625, 1.0, 1.0], dtype=torch.float64))


def test_discount_counts_only_later_segments_of_the_same_rollout() -> None:
    values = torch.zeros(6, dtype=torch.float64)
    advantages, _ = cross_trajectory_gae(values, torch.tensor([1, 2, 1, 2]),
                                         torch.tensor([0, 0, 1, 1]),
                                         torch.tensor([1.0, 1.0], dtype=torch.float64),
                                         gamma=1.0, lam=0.5)
    # rollout 0: segment 0 (1 token) has N = 2 later tokens; segment 1 has N = 0
    # rollout 1: segment 2 has N = 2; segment 3 has N = 0 (rollout 0 does not count)
    assert advantages[0].item() == pytest.approx(0.25)
    assert advantages[3].item() == pytest.approx(0.25)
    assert advantages[1].item() == pytest.approx(0.5) and advantages[2].item() == 1.0


def test_independent_mode_ignores_later_segments() -> None:
    values = torch.zeros(2, dtype=torch.float64)
    advantages, _ = cross_trajectory_gae(values, torch.tensor([1, 1]), torch.tensor([0, 0]),
                                         torch.tensor([1.0], dtype=torch.float64), 1.0, 0.5,
                                         mode="independent")
    assert advantages.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("bad", [
    dict(segment_lengths=torch.tensor([2, 2])),         # sums to 4, 3 values
    dict(segment_rollout=torch.tensor([1, 0])),          # decreasing
    dict(mode="grpo"),
])
def test_incoherent_inputs_are_rejected(bad: dict) -> None:
    args = dict(values=torch.zeros(3), segment_lengths=torch.tensor([1, 2]),
                segment_rollout=torch.tensor([0, 0]), rewards=torch.ones(1), gamma=1.0, lam=1.0)
    args.update(bad)
    with pytest.raises(ValueError):
        cross_trajectory_gae(**args)


def test_a_million_tokens_in_long_segments_stay_finite() -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 400, (5000,), generator=generator)
    lengths[0] = 200_000
    rollout = torch.sort(torch.randint(0, 500, (5000,), generator=generator)).values
    values = torch.randn(int(lengths.sum()), generator=generator, dtype=torch.float64)
    advantages, returns = cross_trajectory_gae(values, lengths, rollout,
                                               torch.ones(500, dtype=torch.float64), 1.0, 0.999)
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()


def test_the_entry_point_takes_a_share_s_rollouts_by_their_batch_index() -> None:
    """A rank's share holds some of the batch's rollouts: GAE sees only
    them, in order; grpo's groups are the whole batch's (rollouts 0 and 3 of
    task "a" here, one of them on another rank)."""
    values = torch.zeros(3, dtype=torch.float64)
    lengths, rollout_of = torch.tensor([1, 1, 1]), torch.tensor([1, 1, 3])
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    tasks = ["a", "b", "b", "a"]
    cross, returns = advantages_and_returns("cross", values, lengths, rollout_of, rewards, tasks,
                                            1.0, 0.5)
    expected = cross_trajectory_gae(values, lengths, torch.tensor([0, 0, 1]),
                                    rewards[[1, 3]], 1.0, 0.5)
    assert cross.tolist() == expected[0].tolist() and returns.tolist() == expected[1].tolist()
    grpo, grpo_returns = advantages_and_returns("grpo", values, lengths, rollout_of, rewards,
                                                tasks, 1.0, 0.5)
    # task b: rewards 1.0 and 0.5, std 0.25; task a: 0.0 and 0.25, std 0.125
    assert grpo.tolist() == pytest.approx([1.0, 1.0, 1.0], rel=1e-5)
    assert grpo_returns.tolist() == returns.tolist()


def test_the_entry_point_refuses_a_rollout_in_two_places() -> None:
    with pytest.raises(ValueError, match="consecutive"):
        advantages_and_returns("cross", torch.zeros(3), torch.tensor([1, 1, 1]),
                               torch.tensor([0, 1, 0]), torch.ones(2), ["a", "a"], 1.0, 1.0)


def adaptive_loop_reference(values, lengths, rollout_of, rewards, gamma, alpha, mode):
    """The segment-length-adaptive form written out: each segment's lambda_s =
    1 - 1/(alpha n_s), its own in its local GAE, and the later segments'
    (gamma lambda_j)^n_j multiplied into the discount."""
    lams = [max(0.0, 1 - 1 / (alpha * n)) if n else 1.0 for n in lengths]
    advantages, returns = [], []
    start = 0
    for s, n in enumerate(lengths):
        segment_values = values[start: start + n]
        adv, ret = loop_reference(segment_values, [n], [0], [rewards[rollout_of[s]]], gamma,
                                  lams[s], "independent")
        factor = 1.0
        if mode == "cross":
            for j in range(s + 1, len(lengths)):
                if rollout_of[j] == rollout_of[s] and lengths[j]:
                    factor *= (gamma * lams[j]) ** lengths[j]
        advantages += (adv * factor).tolist()
        returns += ret.tolist()
        start += n
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns,
                                                                        dtype=torch.float64)


@settings(max_examples=200, deadline=None)
@given(batch=batches(), gamma=st.sampled_from([1.0, 0.99]), alpha=st.sampled_from([0.5, 1.5, 4.0]),
       mode=st.sampled_from(["cross", "independent"]))
def test_adaptive_lambda_matches_its_loop_reference(batch, gamma: float, alpha: float,
                                                   mode: str) -> None:
    lengths, rollout_of, values, rewards, _ = batch
    lam = adaptive_lambdas(torch.tensor(lengths), alpha)
    got_adv, got_ret = cross_trajectory_gae(
        torch.tensor(values, dtype=torch.float64), torch.tensor(lengths),
        torch.tensor(rollout_of), torch.tensor(rewards, dtype=torch.float64), gamma, lam, mode)
    want_adv, want_ret = adaptive_loop_reference(values, lengths, rollout_of, rewards, gamma,
                                                 alpha, mode)
    # as the fixed-lambda test bounds it, plus the discount taken as exp of a
    # sum of n_j log(gamma lambda_j) (relative error of a few eps per segment
    # and per unit of the log) instead of a product
    longest = max(lengths, default=0)
    largest_value = max(map(abs, values), default=0.0)
    largest_delta = max(map(abs, rewards)) + (1 + gamma) * largest_value
    logs = sum(n * abs(torch.log(torch.tensor(gamma) * lam[i]).item())
               for i, n in enumerate(lengths) if n and lam[i] > 0)
    tolerance = rounding_tolerance(longest * largest_delta + largest_value,
                                   2 * longest + 2 + 2 * len(lengths) + int(logs) + 1,
                                   torch.float64)
    torch.testing.assert_close(got_adv, want_adv, rtol=0, atol=tolerance)
    torch.testing.assert_close(got_ret, want_ret, rtol=0, atol=tolerance)


def test_adaptive_lambdas_follow_the_segment_length() -> None:
    lam = adaptive_lambdas(torch.tensor([0, 1, 2, 100]), alpha=1.5)
    assert lam.tolist() == pytest.approx([1.0, 1 / 3, 2 / 3, 1 - 1 / 150])
    # the discount an earlier segment gets is far from 1: exp(-N/(alpha L)) for long ones
    adv, _ = cross_trajectory_gae(torch.zeros(200, dtype=torch.float64), torch.tensor([100, 100]),
                                  torch.tensor([0, 0]), torch.tensor([1.0], dtype=torch.float64),
                                  1.0, adaptive_lambdas(torch.tensor([100, 100]), 1.5))
    factor = float(adv[0] / adv[100])  # same local advantages, only the discount differs
    assert factor == pytest.approx((1 - 1 / 150) ** 100)
    assert factor < 0.52
    with pytest.raises(ValueError, match="alpha"):
        adaptive_lambdas(torch.tensor([3]), 0.0)


def test_one_lambda_for_every_segment_is_the_fixed_form_exactly() -> None:
    values = torch.linspace(-1, 1, 9, dtype=torch.float64)
    lengths, rollout = torch.tensor([4, 0, 5]), torch.tensor([0, 0, 1])
    rewards = torch.tensor([1.0, -0.5], dtype=torch.float64)
    fixed = cross_trajectory_gae(values, lengths, rollout, rewards, 0.99, 0.95)
    tensor = cross_trajectory_gae(values, lengths, rollout, rewards, 0.99,
                                  torch.full((3,), 0.95, dtype=torch.float64))
    for a, b in zip(fixed, tensor, strict=True):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_cross_trajectory_factors_are_the_discount_the_gae_applies() -> None:
    lengths, rollout = torch.tensor([3, 0, 4, 5, 2]), torch.tensor([0, 0, 0, 1, 1])
    assert cross_trajectory_factors(lengths, rollout, 0.9).tolist() == pytest.approx(
        [0.9 ** 4, 0.9 ** 4, 1.0, 0.9 ** 2, 1.0])
    lam = adaptive_lambdas(lengths, 1.5)
    per_segment = cross_trajectory_factors(lengths, rollout, lam)
    assert per_segment.tolist() == pytest.approx(
        [float(lam[2]) ** 4, float(lam[2]) ** 4, 1.0, float(lam[4]) ** 2, 1.0])
    # the GAE's cross advantages are the independent ones times these factors
    values = torch.linspace(-1, 1, 14, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    cross, _ = cross_trajectory_gae(values, lengths, rollout, rewards, 1.0, lam)
    alone, _ = cross_trajectory_gae(values, lengths, rollout, rewards, 1.0, lam, "independent")
    assert torch.allclose(cross, alone * torch.repeat_interleave(per_segment, lengths),
                          atol=1e-12, rtol=0)
    assert cross_trajectory_factors(torch.tensor([], dtype=torch.long),
                                    torch.tensor([], dtype=torch.long), 0.9).shape == (0,)


def test_grpo_over_segments_counts_a_rollout_once_per_segment_in_its_group() -> None:
    """The per-segment statistics are those of the rewards repeated once per
    segment: a rollout that compacted more pulls the group's mean its way;
    per rollout, each counts once."""
    rewards = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    tasks = ["a", "a", "a"]
    counts = torch.tensor([3.0, 1.0, 1.0], dtype=torch.float64)
    repeated = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    mean, std = repeated.mean(), repeated.std(unbiased=False)
    per_segment = group_relative(rewards, tasks, counts)
    assert per_segment.tolist() == pytest.approx(((rewards - mean) / (std + 1e-6)).tolist())
    per_rollout = group_relative(rewards, tasks)
    assert per_rollout.tolist() == pytest.approx(
        ((rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)).tolist())
    assert per_segment[1] < per_rollout[1]  # the short failure looks worse beside the long win
    values = torch.zeros(5, dtype=torch.float64)
    lengths, rollout_of = torch.ones(5, dtype=torch.long), torch.tensor([0, 0, 0, 1, 2])
    advantages, _ = advantages_and_returns("grpo_segments", values, lengths, rollout_of,
                                           rewards, tasks, 1.0, 0.5, None, counts)
    assert advantages.tolist() == pytest.approx(per_segment[rollout_of].tolist())
