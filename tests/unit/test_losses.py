"""The PPO losses against a per-token reference, and their gradients."""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import (
    explained_variance,
    loss_weights,
    policy_loss,
    residual_moments,
    value_loss,
)
from tests.tolerances import rounding_tolerance


def reference_policy_loss(logp, prox, behav, adv, mask, n, lo, hi, cap, mode
                          ) -> tuple[float, float]:
    """(the loss, the sum of its terms' absolute values: its size for a tolerance)."""
    total = magnitude = 0.0
    for t in range(len(logp)):
        if not mask[t]:
            continue
        rho = math.exp(logp[t] - prox[t])
        w = math.exp(prox[t] - behav[t])
        if mode == "truncate":
            w = min(w, cap)
        elif mode == "mask":
            w = 0.0 if (w > cap or w < 1 / cap) else w
        else:
            w = 1.0
        clipped = min(max(rho, 1 - lo), 1 + hi)
        term = -w * min(rho * adv[t], clipped * adv[t])
        total += term
        magnitude += abs(term)
    return total / n, magnitude / n


def random_inputs(seed: int, size: int = 64):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(size, generator=g, dtype=torch.float64) * 3
    prox = logp + torch.randn(size, generator=g, dtype=torch.float64) * 0.3  # clipped and not
    behav = prox + torch.randn(size, generator=g, dtype=torch.float64) * 0.8  # beyond the cap
    adv = torch.randn(size, generator=g, dtype=torch.float64)
    mask = torch.rand(size, generator=g) < 0.7
    return logp, prox, behav, adv, mask


@pytest.mark.parametrize("mode", ["truncate", "mask", "off"])
@pytest.mark.parametrize("seed", range(5))
def test_policy_loss_matches_the_reference(mode: str, seed: int) -> None:
    logp, prox, behav, adv, mask = random_inputs(seed)
    n = 100  # the global count may exceed this call's tokens (other ranks)
    loss, stats = policy_loss(logp, prox, behav, adv, mask.double() / n, 0.2, 0.28, 2.0, mode)
    want, magnitude = reference_policy_loss(logp.tolist(), prox.tolist(), behav.tolist(),
                                            adv.tolist(), mask.tolist(), n, 0.2, 0.28, 2.0, mode)
    # the same float64 terms summed in another order (a loop, a vectorised sum)
    assert loss.item() == pytest.approx(
        want, rel=0, abs=rounding_tolerance(magnitude, len(logp), torch.float64))
    assert 0 < stats["clipfrac"].item() < 1
    if mode != "off":
        assert 0 < stats["is_affected_frac"].item() < 1


def test_policy_gradient_equals_the_analytic_one() -> None:
    logp, prox, behav, adv, mask = random_inputs(11, size=32)
    logp = logp.clone().requires_grad_(True)
    lo, hi, cap, n = 0.2, 0.2, 2.0, 40
    loss, _ = policy_loss(logp, prox, behav, adv, mask.double() / n, lo, hi, cap, "truncate")
    loss.backward()
    expected = torch.zeros_like(logp)
    for t in range(len(logp)):
        rho = math.exp(logp[t].item() - prox[t].item())
        w = min(math.exp(prox[t].item() - behav[t].item()), cap)
        inside = 1 - lo <= rho <= 1 + hi
        unclipped_smaller = rho * adv[t].item() <= min(max(rho, 1 - lo), 1 + hi) * adv[t].item()
        if mask[t] and (inside or unclipped_smaller):
            expected[t] = -w * adv[t].item() * rho / n
    torch.testing.assert_close(logp.grad, expected)


def test_masked_tokens_and_weights_carry_no_gradient() -> None:
    logp, prox, behav, adv, mask = random_inputs(3)
    prox = prox.clone().requires_grad_(True)
    behav = behav.clone().requires_grad_(True)
    logp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, prox, behav, adv, mask.double() / 64)
    loss.backward()
    assert prox.grad is None and behav.grad is None
    assert (logp.grad[~mask] == 0).all()


def test_token_normalisation_gives_every_token_the_same_weight() -> None:
    # the same tokens split into one or two calls with the global count: same total
    logp, prox, behav, adv, mask = random_inputs(5)
    n = int(mask.sum())
    whole, _ = policy_loss(logp, prox, behav, adv, mask.double() / n)
    half = len(logp) // 2
    parts = [policy_loss(logp[s], prox[s], behav[s], adv[s], mask[s].double() / n)[0]
             for s in (slice(0, half), slice(half, None))]
    # the same float64 terms summed in another order: a tolerance relative to
    # the loss alone would be too tight if its terms cancelled
    _, magnitude = reference_policy_loss(logp.tolist(), prox.tolist(), behav.tolist(),
                                         adv.tolist(), mask.tolist(), n, 0.2, 0.2, 2.0,
                                         "truncate")  # policy_loss's defaults
    assert whole.item() == pytest.approx(sum(p.item() for p in parts), rel=0,
                                         abs=rounding_tolerance(magnitude, len(logp),
                                                                torch.float64))


def test_value_loss_is_clipped_and_token_normalised() -> None:
    values = torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64)
    returns = torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64)
    mask = torch.tensor([True, True, False])
    loss, stats = value_loss(values, old, returns, mask.double() / 4, value_clip=0.2)
    # token 0: plain 0, clipped (0.7 - 1)^2 = 0.09 -> 0.09; token 1: 1 and 1 -> 1
    assert loss.item() == pytest.approx(0.5 * (0.09 + 1.0) / 4)
    assert stats["clipfrac"].item() == pytest.approx(0.5)


def test_explained_variance_of_parts_is_that_of_the_whole() -> None:
    """Micro-batches and ranks add up their moments: the statistic is the
    whole batch's, even where one part's returns do not vary at all."""
    generator = torch.Generator().manual_seed(0)
    returns = torch.cat([torch.full((5,), 0.5, dtype=torch.float64),
                         torch.rand(7, generator=generator, dtype=torch.float64)])
    old = returns + 0.1 * torch.randn(12, generator=generator, dtype=torch.float64)
    mask = torch.ones(12, dtype=torch.bool)
    mask[3] = False
    parts = [residual_moments(returns[rows], old[rows], mask[rows])
             for rows in (slice(0, 5), slice(5, 12))]
    summed = {name: sum(part[name] for part in parts) for name in parts[0]}
    target, predicted = returns[mask], old[mask]
    expected = 1 - (target - predicted).var(unbiased=False) / target.var(unbiased=False)
    # moments lose to cancellation what E[G^2] / Var[G] says, on top of the sums' rounding
    magnitude = (target ** 2).mean() / target.var(unbiased=False)
    assert explained_variance(summed, int(mask.sum())) == pytest.approx(
        expected.item(), rel=0, abs=rounding_tolerance(magnitude.item(), 4 * len(target),
                                                       torch.float64))
    constant = residual_moments(returns[:5], old[:5], mask[:5])
    assert explained_variance(constant, int(mask[:5].sum())) == 0.0


def test_loss_weights_are_one_over_the_global_count_or_per_segment_or_per_rollout() -> None:
    """Token normalisation: every token 1/|M| (the global batch's |M|, which
    other ranks' tokens count in). Segment normalisation: each segment's
    tokens share 1/S, S the global batch's segments with tokens. Rollout
    normalisation: each rollout's tokens share 1/R, whatever its segments."""
    lengths = torch.tensor([3, 0, 1])
    counts = {"num_tokens": 10, "num_segments": 5, "rollout_tokens": 4, "num_rollouts": 2}
    token = loss_weights(lengths, "token", **counts)
    assert token.tolist() == pytest.approx([0.1] * 4)
    segment = loss_weights(lengths, "segment", **counts)
    assert segment.tolist() == pytest.approx([1 / 15] * 3 + [1 / 5])
    rollout = loss_weights(lengths, "rollout", **counts)
    assert rollout.tolist() == pytest.approx([1 / 8] * 4)
    assert float(rollout.sum()) == pytest.approx(1 / 2)
    # a rollout of two segments sent as two sequences: the same 1/R in all
    halves = [loss_weights(torch.tensor([n]), "rollout", **counts) for n in (3, 1)]
    assert float(sum(half.sum() for half in halves)) == pytest.approx(1 / 2)
    with pytest.raises(ValueError, match="loss_norm"):
        loss_weights(lengths, "sample", **counts)
