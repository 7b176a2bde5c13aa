"""The PPO step on the tiny model in one process, and batch checks."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from learner.batch import BatchError, microbatches, to_train_batch
from learner.config import LearnerConfig
from learner.models import (
    checkpoint_layers,
    engine_parameters,
    is_value_head,
    load_critic,
    load_policy,
    pad,
    token_logprobs,
    token_logprobs_and_values,
    token_values,
)
from learner.ppo import PPOTrainer, StepStatistics
from protocol import Batch, Rollout
from protocol.synthetic import synthetic_batch
from tests.tolerances import logprob_tolerance, rounding_tolerance
from tests.trainers import plain_sgd, trained_modules

#: Each trains the tiny model for steps (seconds to a minute): make check leaves
#: them to make test.
pytestmark = pytest.mark.trains


def trainer(model_dir: Path, dtype: torch.dtype = torch.float32, **changes) -> PPOTrainer:
    """A trainer on the model in ``model_dir``, its critic a model of its
    own or, with ``critic="value_head"``, a head on the policy."""
    torch.manual_seed(0)
    config = LearnerConfig(**changes)
    if config.critic == "value_head":
        return PPOTrainer(load_policy(str(model_dir), dtype, value_head=True), None, config)
    return PPOTrainer(load_policy(str(model_dir), dtype), load_critic(str(model_dir), dtype),
                      config)


def value_modules(ppo: PPOTrainer) -> torch.nn.Module:
    """What computes the values: the critic model, or the policy's value head."""
    return ppo.policy.value_head if ppo.critic is None else ppo.critic


def record_gradients(ppo: PPOTrainer) -> list[list[torch.Tensor]]:
    """Filled, as ``ppo`` steps, with the gradients each optimizer step
    receives (clipped), one list per step in order."""
    steps: list[list[torch.Tensor]] = []

    def record(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        steps.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                      for group in optimizer.param_groups for p in group["params"]])

    for optimizer in ppo.optimizers:
        optimizer.register_step_pre_hook(record)
    return steps


def snapshot(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("changes", [
    {}, {"advantage": "independent"}, {"advantage": "grpo"}, {"advantage": "grpo_segments"},
    {"loss_norm": "segment"}, {"loss_norm": "rollout"},
    {"is_mode": "mask", "ppo_epochs": 2, "minibatches": 2}, {"whiten_advantages": True},
    {"critic": "value_head"}, {"critic": "value_head", "ppo_epochs": 2, "minibatches": 2},
])
def test_a_step_updates_policy_and_critic(tiny_model_dir: Path, changes: dict) -> None:
    ppo = trainer(tiny_model_dir, **changes)
    modules = ppo.policy.model, value_modules(ppo)
    before = [snapshot(module) for module in modules]
    metrics = ppo.step(to_train_batch(synthetic_batch(), train_summary=True))
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["tokens"] > 0 and "losses/clipfrac" in metrics
    for old, module in zip(before, modules, strict=True):
        assert any(not torch.equal(a, b) for a, b in zip(old, module.parameters(), strict=True))


@pytest.mark.parametrize("critic", ["model", "value_head"])
def test_one_minibatch_takes_prox_and_old_values_from_its_first_update(tiny_model_dir: Path,
                                                                      critic: str) -> None:
    batch = to_train_batch(synthetic_batch(), train_summary=True)
    fused = plain_sgd(trainer(tiny_model_dir, ppo_epochs=2, critic=critic))
    fused_metrics = fused.step(batch)
    # the general path: no-gradient forward passes at the step's start first
    reference = plain_sgd(trainer(tiny_model_dir, ppo_epochs=2, critic=critic))
    [share] = reference.plan(batch).shares
    prox, values = reference.start_values(share, batch, fused=False)
    statistics = StepStatistics()
    for _ in range(2):
        start = reference.update(share, prox, values, batch, statistics)
        prox, values = start.logp_prox, start.values
    # The two paths may differ by rounding only (a forward pass with or without
    # autograd can pick other kernels on another CPU). Each gradient element is
    # a sum over token positions of terms bounded by the clipped gradient norm;
    # two updates of lr each. A prox or old value taken from the wrong pass
    # moves the update by whole terms.
    positions = sum(len(s.tokens) for s in batch.sequences)
    lr = max(fused.config.lr, fused.config.critic_lr)
    tolerance = 2 * lr * rounding_tolerance(fused.config.max_grad_norm, positions)
    for module, expected in zip(trained_modules(fused), trained_modules(reference), strict=True):
        for a, b in zip(module.parameters(), expected.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=tolerance)
    # the loss is a mean of per-token terms -A * ratio, each of order 1 here
    # (rewards in [0, 1]): the sum of their magnitudes is within |loss| + 1
    loss = statistics.policy_loss / 2
    assert fused_metrics["losses/policy_loss"] == pytest.approx(
        loss, abs=rounding_tolerance(abs(loss) + 1.0, positions))


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
    {"loss_norm": "rollout"}, {"train_summary": False},
])
def test_shared_prefixes_leave_the_update_unchanged(tiny_model_dir: Path, changes: dict) -> None:
    """The gradients each optimizer step receives are compared, not the
    parameters after AdamW: its m / (sqrt(v) + 1e-8) turns the rounding noise
    of a near-zero gradient element into a step of up to lr. The two layouts
    sum the same per-token contributions in a different order (a prompt's
    gradient gathers its window's and its summary's tokens in one sequence,
    or comes from two copies of it), so they agree up to rounding only."""
    wire = synthetic_batch(rollouts=8)
    train_summary = changes.get("train_summary", True)
    received = []
    for share in (True, False):
        # double, so that the models' own sums add no rounding of note; what
        # is left is float32 (transformers' RMSNorm, the learner's
        # log-softmax and loss), hence a float32 tolerance
        ppo = trainer(tiny_model_dir, torch.float64, **changes)
        received.append(record_gradients(ppo))
        ppo.step(to_train_batch(wire, train_summary, share))
    shared, apart = received
    assert len(shared) == len(apart) == 2  # one step of the policy, one of the critic
    # A gradient element sums one contribution per token position (the separate
    # sequences have more positions); the tensor's largest element stands for
    # their size. Measured: ~1e-7 of that; one token left out of the loss: ~3e-2.
    positions = sum(len(s.tokens) for s in to_train_batch(wire, train_summary, False).sequences)
    for got, expected in zip(shared, apart, strict=True):
        for a, b in zip(got, expected, strict=True):
            tolerance = rounding_tolerance(b.abs().max().item(), positions)
            torch.testing.assert_close(a, b, rtol=0, atol=tolerance)


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


def test_chunked_log_probabilities_equal_those_of_all_logits_at_once(tiny_model_dir: Path
                                                                    ) -> None:
    policy = load_policy(str(tiny_model_dir))
    ids = pad([s.tokens for s in to_train_batch(synthetic_batch(), True).sequences])
    upstream = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    results = []
    for chunk in (0, 1, 7, ids.numel()):
        policy.zero_grad()
        logp = token_logprobs(policy, ids, chunk)
        (logp * upstream).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in policy.parameters()]))
    # A gradient element sums one contribution per position; its largest
    # element stands for their size (test_shared_prefixes_leave_the_update_unchanged).
    value_tolerance = logprob_tolerance(policy, ids)
    (expected_logp, expected_grads), *chunked = results
    for logp, grads in chunked:
        torch.testing.assert_close(logp, expected_logp, rtol=0, atol=value_tolerance)
        for a, b in zip(grads, expected_grads, strict=True):
            tolerance = rounding_tolerance(b.abs().max().item(), ids.numel())
            torch.testing.assert_close(a, b, rtol=0, atol=tolerance)


def test_chunked_bf16_output_gradients_are_rounded_once_as_the_whole_pass_rounds_them(
        tiny_model_dir: Path) -> None:
    """In bf16 (the GPU's compute dtype), one position per chunk: the output
    layer's gradient is the whole pass's up to a rounding or two of its
    elements, not one rounding of a running bf16 sum per chunk."""
    policy = load_policy(str(tiny_model_dir), torch.bfloat16)
    ids = pad([s.tokens for s in to_train_batch(synthetic_batch(), True).sequences])
    upstream = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    weight = policy.get_output_embeddings().weight
    grads = []
    for chunk in (0, 1):
        policy.zero_grad()
        (token_logprobs(policy, ids, chunk) * upstream).sum().backward()
        grads.append(weight.grad.float().clone())
    whole, chunked = grads
    # two bf16 roundings of the largest element (8 bits of mantissa)
    tolerance = 2 * 2.0 ** -8 * whole.abs().max().item()
    torch.testing.assert_close(chunked, whole, rtol=0, atol=tolerance)


def test_a_value_head_shares_the_policy_s_pass_and_starts_at_zero(tiny_model_dir: Path
                                                                  ) -> None:
    """One pass gives the policy's log-probabilities and the head's values;
    the head is the policy's only addition, and what the engines receive
    (the parameters without it) is the model they load."""
    policy = load_policy(str(tiny_model_dir), value_head=True)
    plain = load_policy(str(tiny_model_dir))
    ids = pad([s.tokens for s in to_train_batch(synthetic_batch(), True).sequences])
    for chunk in (0, 16):
        logp, values = token_logprobs_and_values(policy, ids, chunk)
        torch.testing.assert_close(logp, token_logprobs(plain, ids), rtol=0,
                                   atol=logprob_tolerance(plain, ids))
        assert values.shape == ids.shape and not values.any()
    names = [name for name, _ in policy.named_parameters()]
    assert [n for n in names if is_value_head(n)] == ["value_head.weight", "value_head.bias"]
    assert [name for name, _ in engine_parameters(policy)] == [
        name for name, _ in plain.named_parameters()]


def test_a_value_head_learns_at_the_critic_learning_rate(tiny_model_dir: Path) -> None:
    ppo = trainer(tiny_model_dir, critic="value_head", critic_lr=1e-2, lr=1e-5)
    body, head = ppo.policy_optimizer.param_groups
    assert (body["lr"], head["lr"]) == (1e-5, 1e-2)
    assert {id(p) for p in head["params"]} == {id(p) for p in ppo.policy.value_head.parameters()}
    assert len(body["params"]) + len(head["params"]) == len(list(ppo.policy.parameters()))
    batch = to_train_batch(synthetic_batch(), train_summary=True)
    losses = [ppo.step(batch)["losses/value_loss"] for _ in range(8)]
    # from values of 0 towards returns in [0, 1]: measured 0.36 -> 0.03
    assert losses[-1] < 0.5 * losses[0], losses


def saved_for_backward(compute: Callable[[], torch.Tensor]) -> list[torch.Size]:
    """Shapes of the tensors autograd keeps for backward while ``compute`` runs
    (under a non-reentrant checkpoint, its own hooks take those inside)."""
    shapes = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compute()
    return shapes


def test_memory_switches_keep_no_logits_and_no_layer_activations_for_backward(
        tiny_model_dir: Path) -> None:
    policy, critic = load_policy(str(tiny_model_dir)), load_critic(str(tiny_model_dir))
    with_head = load_policy(str(tiny_model_dir), value_head=True)
    ids = pad([s.tokens for s in to_train_batch(synthetic_batch(), True).sequences])
    logits = ids[:, 1:].numel() * policy.config.vocab_size
    mlp_width = policy.config.intermediate_size

    def kept(chunk: int = 0) -> list[list[torch.Size]]:
        """Per critic kind, what a pass of the policy and the critic keeps."""
        return [saved_for_backward(lambda: token_logprobs(policy, ids, chunk))
                + saved_for_backward(lambda: token_values(critic, ids)),
                saved_for_backward(lambda: token_logprobs_and_values(with_head, ids, chunk))]

    for whole in kept():
        assert any(shape.numel() >= logits for shape in whole)
        assert any(shape[-1] == mlp_width for shape in whole)
    for chunked in kept(chunk=16):
        assert all(shape.numel() < logits for shape in chunked)
    for module in (policy, critic, with_head):
        checkpoint_layers(module)
    for checkpointed in kept():
        assert all(shape[-1] != mlp_width for shape in checkpointed)


#: (settings, memory switches): an update with the switches on is the update
#: without. Gradient clipping is off: it would scale away a bug that scales
#: the whole gradient (a loss divided by the number of micro-batches).
MEMORY_SWITCHES = [
    ({}, {"logprob_chunk_tokens": 16}),
    ({}, {"activation_checkpointing": "on"}),
    ({}, {"max_tokens_per_microbatch": 56}),
    ({"minibatches": 2, "ppo_epochs": 2}, {"max_tokens_per_microbatch": 56}),
    ({"critic": "value_head"}, {"logprob_chunk_tokens": 16, "activation_checkpointing": "on"}),
    ({"critic": "value_head"}, {"max_tokens_per_microbatch": 56}),
]


@pytest.mark.parametrize("settings, switches", MEMORY_SWITCHES, ids=[
    "chunked-logprobs", "activation-checkpointing", "token-budget", "token-budget-minibatches",
    "value-head-chunked-checkpointed", "value-head-token-budget"])
def test_a_memory_switch_leaves_the_update_unchanged(tiny_model_dir: Path, settings: dict,
                                                     switches: dict) -> None:
    """With a token budget and one minibatch, the old values come from
    passes without gradients before the first update (its advantages need
    all of them), log pi_prox from the update's own passes."""
    wire = synthetic_batch(rollouts=8)
    lengths = [len(s.tokens) for s in to_train_batch(wire, True).sequences]
    if budget := switches.get("max_tokens_per_microbatch"):
        # several sequences in a micro-batch, and one longer than the budget alone
        groups = microbatches(lengths, budget)
        assert max(map(len, groups)) > 1 and max(lengths) > budget
    runs, received = [], []
    for changes in ({**settings, "max_grad_norm": 0.0},
                    {**settings, "max_grad_norm": 0.0, **switches}):
        ppo = plain_sgd(trainer(tiny_model_dir, torch.float64, **changes))
        if ppo.config.activation_checkpointing == "on":  # shard() does this under FSDP2
            for module in trained_modules(ppo):
                checkpoint_layers(module)
        received.append(record_gradients(ppo))
        ppo.step(to_train_batch(wire, True))
        runs.append(ppo)
    # The first update starts from the same weights: its gradients (the
    # policy's, then the critic's) differ by rounding only, in float32 as in
    # test_shared_prefixes_leave_the_update_unchanged. Each SGD update moves
    # a parameter by lr times its gradient, so after all of them the two runs
    # lie within lr times that rounding per update.
    positions = sum(lengths)
    (plain, switched), config = received, runs[0].config
    updates = config.minibatches * config.ppo_epochs
    optimizers = len(runs[0].optimizers)
    assert len(plain) == len(switched) == optimizers * updates
    for got, expected in zip(switched[:optimizers], plain[:optimizers], strict=True):
        for a, b in zip(got, expected, strict=True):
            tolerance = rounding_tolerance(b.abs().max().item(), positions)
            torch.testing.assert_close(a, b, rtol=0, atol=tolerance)
    largest = max(g.abs().max().item() for step in plain for g in step)
    tolerance = (max(config.lr, config.critic_lr) * updates
                 * rounding_tolerance(largest, positions))
    for got, expected in zip(trained_modules(runs[1]), trained_modules(runs[0]), strict=True):
        for a, b in zip(got.parameters(), expected.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=tolerance)


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


def test_micro_batches_hold_each_sequence_once_within_the_token_budget() -> None:
    lengths = [62, 13, 27, 50, 19, 27, 38, 24, 52, 26, 37]
    groups = microbatches(lengths, 56)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:  # padded to its longest; a sequence over the budget alone
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= 56
    assert [[lengths[i] for i in group] for group in groups] == [
        [62], [52], [50], [38], [37], [27, 27], [26, 24], [19, 13]]
    assert microbatches(lengths, 11 * 62) == [sorted(range(11), key=lambda i: -lengths[i])]
    assert microbatches([], 56) == []


def test_minibatches_and_rank_shares_are_the_same_cut_for_any_world_size() -> None:
    batch = to_train_batch(synthetic_batch(rollouts=7), train_summary=True)
    minibatches = batch.minibatches(3)
    assert sorted(r for m in minibatches for r in m) == list(range(7))
    for world in (1, 2, 3):
        shares = batch.assign(minibatches[0], world)
        assert sorted(r for share in shares for r in share) == minibatches[0]


@pytest.mark.parametrize("critic", ["model", "value_head"])
def test_a_critic_warmup_step_moves_the_critic_and_not_the_policy(tiny_model_dir: Path,
                                                                 critic: str) -> None:
    """learner.critic_warmup_steps: value-only updates. With a value head the
    shared body stays put too (it is the policy); only the head learns."""
    ppo = trainer(tiny_model_dir, critic=critic, lam_mode="adaptive")
    policy = [p for n, p in ppo.policy.named_parameters() if not is_value_head(n)]
    value = list(value_modules(ppo).parameters())
    before_policy, before_value = ([p.detach().clone() for p in ps] for ps in (policy, value))
    metrics = ppo.step(to_train_batch(synthetic_batch(), train_summary=True), value_only=True)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert all(torch.equal(a, b) for a, b in zip(before_policy, policy, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(before_value, value, strict=True))


@pytest.mark.parametrize("lam_mode", ["fixed", "adaptive"])
def test_a_step_reports_the_cross_trajectory_factors_of_summary_and_execution_segments(
        tiny_model_dir: Path, lam_mode: str) -> None:
    ppo = trainer(tiny_model_dir, lam_mode=lam_mode, lam=0.9)
    batch = to_train_batch(synthetic_batch(rollouts=8), train_summary=True)
    metrics = ppo.step(batch)
    kinds: dict[str, list[int]] = {"summary": [], "execution": []}
    for sequence in batch.sequences:
        types = ["execution"] * (len(sequence.segment_lengths) - 1) + [sequence.segment_type]
        for kind, n in zip(types, sequence.segment_lengths, strict=True):
            if n:
                kinds[kind].append(n)
    assert metrics["advantages/summary_segments"] == len(kinds["summary"]) > 0
    assert metrics["advantages/execution_segments"] == len(kinds["execution"]) > 0
    # every summary is followed by an execution segment: its factor is < 1;
    # each rollout's last (execution) segment has factor 1
    summary_mean = metrics["advantages/summary_factor_sum"] / len(kinds["summary"])
    assert 0 < summary_mean < 1
    assert metrics["advantages/execution_factor_sum"] >= batch.num_rollouts


@pytest.mark.parametrize("loss_norm", ["token", "segment", "rollout"])
def test_the_loss_weight_by_compaction_count_is_what_the_normalisation_gives(
        tiny_model_dir: Path, loss_norm: str) -> None:
    """Each minibatch's weights sum to 1; of that, rollouts that compacted
    once get their share of the tokens (token), of the segments with
    trainable tokens (segment) or of the rollouts (rollout)."""
    ppo = trainer(tiny_model_dir, loss_norm=loss_norm, minibatches=2)
    batch = to_train_batch(synthetic_batch(rollouts=8), train_summary=True)
    assert set(batch.compactions) == {0, 1}
    shares = ppo.plan(batch).shares
    weights = {name: value for name, value in ppo.step(batch).items()
               if name.startswith("loss_weight/")}
    assert sum(weights.values()) == pytest.approx(len(shares))
    assert weights["loss_weight/2"] == weights["loss_weight/8+"] == 0.0
    expected = 0.0
    for share in shares:
        rollouts = sorted({s.rollout for s in share.sequences})
        units = {r: [n for s in share.sequences if s.rollout == r for n in s.segment_lengths]
                 for r in rollouts}
        size = {"token": lambda lengths: sum(lengths),
                "segment": lambda lengths: sum(n > 0 for n in lengths),
                "rollout": lambda lengths: 1}[loss_norm]
        expected += (sum(size(units[r]) for r in rollouts if batch.compactions[r] == 1)
                     / sum(size(units[r]) for r in rollouts))
    assert weights["loss_weight/1"] == pytest.approx(expected)


def test_the_trainer_s_state_is_built_once_and_never_filled_in_later() -> None:
    """No attribute of the trainer is assigned outside its construction, and
    what a step plans and fixes at its start is frozen: a step's state does
    not depend on the order of calls (learner/ppo.py)."""
    import ast
    import dataclasses
    import inspect

    from learner import ppo

    tree = ast.parse(inspect.getsource(ppo.PPOTrainer))
    assigned_late = [
        f"{method.name}: self.{target.attr}"
        for method in tree.body[0].body if isinstance(method, ast.FunctionDef)
        and method.name != "__init__"
        for node in ast.walk(method) if isinstance(node, (ast.Assign, ast.AugAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
        and target.value.id == "self"]
    assert assigned_late == []
    for planned in (ppo.StepPlan, ppo.Share, ppo.StartValues, ppo.ShareValues, ppo.Rows,
                    ppo.Losses):
        assert dataclasses.fields(planned) and planned.__dataclass_params__.frozen, planned


@pytest.mark.parametrize("minibatches, epochs", [(1, 2), (2, 2)])
def test_a_share_s_advantage_side_is_computed_once_a_step(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, minibatches: int,
        epochs: int) -> None:
    """The segments' layout, their cross-trajectory factors and the
    advantages are computed once per share, where its old values are, and
    read by the loss, the statistics and the sampled rollouts; the step's
    sums take one all-reduce."""
    from learner import advantages, ppo

    calls: dict[str, int] = {}

    def counted(module: object, name: str) -> None:
        original = getattr(module, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for name in ("_segments", "share_values", "cross_trajectory_factors", "all_reduce_floats"):
        counted(ppo, name)
    counted(advantages, "cross_trajectory_factors")  # GAE's own, were it not given them
    trainer_ = trainer(tiny_model_dir, minibatches=minibatches, ppo_epochs=epochs)
    batch = to_train_batch(synthetic_batch(rollouts=8), train_summary=True)
    shares = len(trainer_.plan(batch).shares)
    calls.clear()
    trainer_.step(batch, sample=lambda rollouts: None)
    assert calls["_segments"] == calls["share_values"] == shares
    assert calls["cross_trajectory_factors"] == shares
    # planning's global counts (one per share) and the step's sums (one: the
    # loss weights by compaction count among them); not whitened here
    assert calls["all_reduce_floats"] == shares + 1
