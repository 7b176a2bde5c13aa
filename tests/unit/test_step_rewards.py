"""Per-step rewards, from the environment to GAE: on the action's last token
in the actor's segment, checked by the replay, carried by the learner's
batch (through a shared summary prefix too), and added to GAE's per-token
rewards beside the final reward."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from actors.config import CompactionConfig
from actors.context import CompactionContext, Generation, TurnTokens
from learner.batch import to_train_batch
from learner.config import LearnerConfig
from learner.ppo import share_values
from protocol import Array, ErrorCode, ProtocolError
from protocol.synthetic import synthetic_batch
from protocol.validation import check_segment_content
from tests.small_segment import small_segment


def turns() -> TurnTokens:
    return TurnTokens(system=[1], task=[2], summary_request=[3], assistant_header=[4],
                      assistant_end=[5], assistant_footer=[], observation_open=[6],
                      observation_close=[7], truncation_marker=[8],
                      resume=lambda summary: [9, *summary])


def test_a_step_reward_sits_on_the_last_token_of_its_action_only() -> None:
    config = CompactionConfig(context_tokens=64, reserve_tokens=40, max_summary_tokens=4,
                              keep_steps=1)
    context = CompactionContext(turns(), config)
    action = Generation([20, 21, 5], [-1.0] * 3, [0] * 3)
    context.add_step(action, [30, 31], reward=0.25)
    context.add_step(Generation([22, 5], [-1.0] * 2, [0] * 2), [32], reward=0.0)
    execution, summary = context.compact(Generation([40, 5], [-1.0] * 2, [0] * 2), [40])
    rewards = dict(zip(range(len(execution.tokens)), execution.rewards, strict=True))
    assert [i for i, r in rewards.items() if r] == [execution.tokens.index(5)]
    assert rewards[execution.tokens.index(5)] == 0.25
    assert not any(summary.rewards)
    # the kept step comes back as context: its reward is not counted twice
    assert not any(context.finish().rewards)


def segment_with(rewards: list[float], mask: tuple = (0, 0, 1, 1)):
    segment = small_segment(mask=mask)
    return msgspec.structs.replace(segment, token_rewards=Array.from_numpy(
        np.array(rewards, dtype=np.float32)))


@pytest.mark.parametrize("rewards, code", [
    ([0, 0.5, 0, 0], ErrorCode.INVALID),          # on a context token
    ([0, 0, float("nan"), 0], ErrorCode.INVALID),
    ([0, 0, 1], ErrorCode.LENGTH_MISMATCH),
], ids=["on-context", "nan", "short"])
def test_the_replay_refuses_step_rewards_that_cannot_be_trained(rewards: list, code) -> None:
    with pytest.raises(ProtocolError) as refused:
        segment = segment_with(rewards)
        segment.validate()
        check_segment_content(segment, vocab_size=10, oldest_version=2, newest_version=5)
    assert refused.value.code == code


def with_step_reward(batch, rollout: int, reward: float):
    """``batch`` with ``reward`` on the last trainable token of the rollout's
    first segment; returns the batch and that token's position."""
    segment = batch.rollouts[rollout].segments[0]
    mask = segment.loss_mask.numpy()
    position = int(np.flatnonzero(mask)[-1])
    rewards = np.zeros(len(mask), dtype=np.float32)
    rewards[position] = reward
    batch.rollouts[rollout].segments[0] = msgspec.structs.replace(
        segment, token_rewards=Array.from_numpy(rewards))
    return batch, position


def test_a_shared_summary_prefix_keeps_the_execution_segment_s_step_rewards() -> None:
    batch, position = with_step_reward(synthetic_batch(rollouts=8, seed=3), 0, 0.5)
    train = to_train_batch(batch, train_summary=True)
    [first] = [s for s in train.sequences if s.rollout == 0][:1]
    assert first.token_rewards is not None and first.token_rewards[position] == 0.5
    assert float(first.token_rewards.sum()) == 0.5
    assert all(s.token_rewards is None for s in train.sequences if s.rollout != 0)


def test_gae_adds_a_step_reward_to_the_advantages_up_to_its_token() -> None:
    """gamma = lambda = 1: a step reward r adds exactly r to the advantage of
    every trainable token of its segment up to its own, and nothing elsewhere."""
    config = LearnerConfig(gamma=1.0, lam=1.0, whiten_advantages=False)
    plain = to_train_batch(synthetic_batch(rollouts=4, seed=5), train_summary=True)
    shaped_batch, position = with_step_reward(synthetic_batch(rollouts=4, seed=5), 1, 0.75)
    shaped = to_train_batch(shaped_batch, train_summary=True)
    values = [torch.linspace(-0.5, 0.5, len(s.tokens), dtype=torch.float64)
              for s in plain.sequences]
    before = share_values(config, plain, plain.sequences, values).advantages
    after = share_values(config, shaped, shaped.sequences, values).advantages
    for index, (sequence, old, new) in enumerate(zip(plain.sequences, before, after,
                                                     strict=True)):
        difference = (new - old).double()
        expected = torch.zeros(len(sequence.tokens), dtype=torch.float64)
        if sequence.rollout == 1 and index == next(i for i, s in enumerate(plain.sequences)
                                                   if s.rollout == 1):
            first_segment = torch.zeros_like(sequence.trainable)
            first_segment[: position + 1] = True
            expected[sequence.trainable & first_segment] = 0.75
        # float32 advantages: tolerance from their own scale
        scale = float(old.abs().max()) + 1.0
        torch.testing.assert_close(difference, expected, rtol=0.0, atol=4 * scale * 2**-23)


class Shaped:
    """Pays 0.1 for each step, 1 at the end of the third."""

    def __init__(self) -> None:
        self.steps = 0

    async def reset(self, seed: int):
        from actors.envs.base import Task
        return Task("shaped", "system", "walk")

    async def step(self, action: str):
        from actors.envs.base import StepResult
        self.steps += 1
        return StepResult("ok", done=self.steps == 3, reward=1.0, step_reward=0.1)

    async def close(self) -> None:
        return None


def test_the_agent_loop_puts_each_step_reward_in_its_segment(tiny_model_dir: Path) -> None:
    import asyncio

    from transformers import AutoTokenizer

    from actors.chat import ChatFormat
    from actors.config import ActorConfig
    from actors.episode import run_episode

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = ActorConfig()
    chat = ChatFormat(tokenizer, config.compaction, config.environment)
    end = chat.assistant_end

    class Policy:
        async def generate(self, prompt, max_tokens, seed=None, temperature=None):
            ids = tokenizer.encode("next", add_special_tokens=False) + end
            return Generation(ids, [-0.1] * len(ids), [0] * len(ids))

    segments = []

    async def emit(task_id, segment, result) -> None:
        segments.append(segment)

    result = asyncio.run(run_episode(Policy(), Shaped(), chat, config, seed=0, emit=emit))
    [segment] = segments
    assert result.reward == 1.0
    assert sorted(r for r in segment.rewards if r) == pytest.approx([0.1] * 3)
    ends = [i for i, r in enumerate(segment.rewards) if r]
    assert all(segment.loss_mask[i] == 1 and segment.tokens[i] == end[-1] for i in ends)
