"""Learner speed: (a) cross-trajectory GAE against a plain loop, (b) one PPO
step against the same forward and backward passes done bare, (c) shared
prefixes against separate sequences.

(a) 1M trainable tokens in 10k segments of 1k rollouts: the vectorised
    ``cross_trajectory_gae`` against the token-by-token loop reference over
    tensors (``gae_vs_loop``), and against the same loop over Python floats
    (``gae_vs_python_float_loop``, the hardest baseline in CPython).
(b) The tiny model, one process: a full PPO step (log pi_prox and values,
    advantages, minibatches, losses, optimizer steps) against the same
    padded forward and backward passes of the same models over the same
    tokens with a trivial loss, plus the same optimizer steps. The ratio is
    what the RL machinery costs. Twice: 2 minibatches x 2 epochs, and the
    default one minibatch, whose step runs no separate step-start passes.
(c) The same rollouts stepped with shared prefixes (a summary segment in the
    sequence of the window it summarises) and with separate sequences
    (``shared_vs_separate``, and the fraction of tokens left).

    python bench/ppo_step.py [--json] [--quick]
"""

from __future__ import annotations

import json
import time

import torch
from _options import BenchmarkParser  # bench/_options.py

from learner.advantages import cross_trajectory_gae
from learner.batch import TrainBatch, to_train_batch
from learner.config import LearnerConfig
from learner.models import load_critic, load_policy, pad, token_logprobs, token_values
from learner.ppo import PPOTrainer
from protocol.synthetic import synthetic_batch


def gae_loop(values, lengths, rollout_of, rewards, gamma: float, lam: float) -> list[float]:
    """The reference: docs/design.md §2.3 token by token, as RL codebases usually
    write GAE (over tensors, or over Python floats when given lists)."""
    later = [0] * len(lengths)
    running_after = 0
    for s in reversed(range(len(lengths))):
        if s + 1 < len(lengths) and rollout_of[s + 1] != rollout_of[s]:
            running_after = 0
        later[s] = running_after
        running_after += lengths[s]
    out = [0.0] * len(values)
    start = 0
    for s, n in enumerate(lengths):
        factor = (gamma * lam) ** later[s]
        acc = 0.0
        for i in reversed(range(n)):
            t = start + i
            reward = rewards[rollout_of[s]] if i == n - 1 else 0.0
            next_value = values[t + 1] if i < n - 1 else 0.0
            acc = reward + gamma * next_value - values[t] + gamma * lam * acc
            out[t] = factor * acc
        start += n
    return out


def bench_gae(tokens: int, segments: int, rollouts: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(tokens - 1, generator=generator)[: segments - 1] + 1).values
    edges = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])])
    lengths = edges[1:] - edges[:-1]
    rollout_of = torch.sort(torch.randint(0, rollouts, (segments,), generator=generator)).values
    values = torch.randn(tokens, generator=generator, dtype=torch.float64)
    rewards = torch.rand(rollouts, generator=generator, dtype=torch.float64)
    cross_trajectory_gae(values, lengths, rollout_of, rewards, 1.0, 0.999)  # warm-up
    began = time.perf_counter()
    fast, _ = cross_trajectory_gae(values, lengths, rollout_of, rewards, 1.0, 0.999)
    fast_s = time.perf_counter() - began
    began = time.perf_counter()
    slow = gae_loop(values, lengths.tolist(), rollout_of.tolist(), rewards, 1.0, 0.999)
    loop_s = time.perf_counter() - began
    began = time.perf_counter()
    floats = gae_loop(values.tolist(), lengths.tolist(), rollout_of.tolist(), rewards.tolist(),
                      1.0, 0.999)
    float_loop_s = time.perf_counter() - began
    torch.testing.assert_close(fast, torch.tensor([float(x) for x in slow], dtype=torch.float64))
    torch.testing.assert_close(fast, torch.tensor(floats, dtype=torch.float64))
    return {"gae_seconds": round(fast_s, 4), "gae_loop_seconds": round(loop_s, 3),
            "gae_vs_loop": round(loop_s / fast_s, 1),
            "gae_python_float_loop_seconds": round(float_loop_s, 3),
            "gae_vs_python_float_loop": round(float_loop_s / fast_s, 1)}


def bare_step(policy, critic, optimizers, batch: TrainBatch, config: LearnerConfig) -> None:
    """The same passes as a PPO step, with a trivial loss and no RL code."""
    parts = [[s.tokens for s in batch.sequences if s.rollout in chosen]
             for chosen in map(set, batch.minibatches(config.minibatches))]
    padded = [pad(part) for part in parts]
    if len(padded) > 1:  # with one minibatch the step takes these from its first update
        with torch.no_grad():
            for ids in padded:
                token_logprobs(policy, ids)
                token_values(critic, ids)
    for _ in range(config.ppo_epochs):
        for ids in padded:
            token_logprobs(policy, ids).sum().backward()
            token_values(critic, ids).sum().backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)


def tiny_models(config: LearnerConfig) -> tuple[PPOTrainer, torch.nn.Module, torch.nn.Module]:
    """A trainer on a fresh tiny model, and a bare policy and critic of the same weights."""
    from starting_points.tiny_model import temporary_tiny_model

    with temporary_tiny_model() as model:
        torch.manual_seed(0)
        trainer = PPOTrainer(load_policy(model), load_critic(model), config)
        return trainer, load_policy(model), load_critic(model)


def bench_ppo(repeats: int, config: LearnerConfig) -> dict[str, float]:
    trainer, policy, critic = tiny_models(config)
    optimizers = [torch.optim.AdamW(policy.parameters(), lr=config.lr),
                  torch.optim.AdamW(critic.parameters(), lr=config.critic_lr)]
    batches = [to_train_batch(synthetic_batch(rollouts=32, seed=s), True)
               for s in range(repeats + 1)]
    tokens = sum(len(s.tokens) for b in batches[1:] for s in b.sequences)
    trainer.step(batches[0])  # warm-up
    bare_step(policy, critic, optimizers, batches[0], config)
    ppo_s = bare_s = 0.0
    for batch in batches[1:]:  # interleaved, so both see the same machine state
        began = time.perf_counter()
        trainer.step(batch)
        ppo_s += time.perf_counter() - began
        began = time.perf_counter()
        bare_step(policy, critic, optimizers, batch, config)
        bare_s += time.perf_counter() - began
    return {"ppo_tokens_per_s": round(tokens / ppo_s, 1),
            "bare_tokens_per_s": round(tokens / bare_s, 1),
            "ppo_vs_bare": round(bare_s / ppo_s, 3)}


def bench_shared_prefixes(repeats: int) -> dict[str, float]:
    """The same rollouts stepped with each summary sharing the sequence of
    the window it summarises, and with every segment its own sequence."""
    trainer, _, _ = tiny_models(LearnerConfig())
    wires = [synthetic_batch(rollouts=32, seed=s) for s in range(repeats + 1)]
    seconds = {True: 0.0, False: 0.0}
    tokens = {True: 0, False: 0}
    for n, wire in enumerate(wires):
        for share in (True, False):  # interleaved, so both see the same machine state
            batch = to_train_batch(wire, True, share)
            began = time.perf_counter()
            trainer.step(batch)
            if n:  # the first batch warms up
                seconds[share] += time.perf_counter() - began
                tokens[share] += sum(len(s.tokens) for s in batch.sequences)
    return {"shared_vs_separate": round(seconds[False] / seconds[True], 3),
            "shared_token_fraction": round(tokens[True] / tokens[False], 3)}


def main() -> None:
    args = BenchmarkParser(__doc__.splitlines()[0], quick="smaller sizes (smoke test)").parse_args()
    gae = bench_gae(*((20_000, 200, 20) if args.quick else (1_000_000, 10_000, 1_000)))
    repeats = 1 if args.quick else 5
    ppo = bench_ppo(repeats, LearnerConfig(minibatches=2, ppo_epochs=2))
    # the default: one minibatch, one epoch (log pi_prox and values from the update)
    single = bench_ppo(repeats, LearnerConfig())
    shared = bench_shared_prefixes(repeats)
    result = {**gae, **ppo, **{f"{key}_one_minibatch": value for key, value in single.items()},
              **shared}
    print(f"GAE: {gae['gae_seconds']} s vectorised vs {gae['gae_loop_seconds']} s tensor loop "
          f"({gae['gae_vs_loop']}x), {gae['gae_python_float_loop_seconds']} s Python-float loop "
          f"({gae['gae_vs_python_float_loop']}x); PPO step {ppo['ppo_tokens_per_s']} tokens/s "
          f"vs bare {ppo['bare_tokens_per_s']} tokens/s (ratio {ppo['ppo_vs_bare']}) with 2 "
          f"minibatches x 2 epochs; {single['ppo_tokens_per_s']} vs "
          f"{single['bare_tokens_per_s']} tokens/s (ratio {single['ppo_vs_bare']}) with one; "
          f"shared prefixes {shared['shared_vs_separate']}x faster than separate sequences "
          f"({shared['shared_token_fraction']} of the tokens)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
