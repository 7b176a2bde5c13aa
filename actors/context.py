"""The agent's context window with compaction (docs/design.md §2.1-2.2), in token space.

A pure module: no engine, no tokenizer. The chat format hands it rendered
token pieces (:class:`TurnTokens`); the agent loop asks it for prompts and
budgets, feeds it the policy's generations and the environment's
observations, and collects the segments it closes.

Room rules, with ``C`` = context_tokens, ``T`` = reserve_tokens and
``R`` = the tokens a summary needs (request turn + assistant header +
max_summary_tokens; 0 with compaction off):

- a step (action + observation) only uses ``C - |h| - R``, so that after any
  step the summary prompt and the longest summary still fit;
- after a step, if ``C - |h| < T`` the context compacts (or the episode ends,
  at the compaction limit or with compaction off once no step fits);
- an observation that does not fit is cut, with a visible marker; a step is
  never split and the window never exceeded.

Usage::

    context = CompactionContext(turns, config)
    while not done:
        action = await engine.generate(context.action_prompt(),
                                       context.action_budget(max_turn_tokens))
        context.add_step(action, observation_ids)
        if context.needs_compaction() and context.compaction_allowed():
            summary = await engine.generate(context.summary_prompt(), context.summary_budget())
            # [execution, summary] segments; the summary as the resume turn quotes it
            closed = context.compact(summary, chat.strip_end(summary.token_ids))
    final = context.finish()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from actors.config import CompactionConfig
from protocol import Array, GroupTag, RolloutStats, Segment

#: A step needs at least this many tokens for the action itself beyond its
#: header and footer; fewer means the window is full.
MIN_ACTION_TOKENS = 4


@dataclass
class Generation:
    """What the policy sampled: token ids, the log-probability of each under
    the sampling distribution, and the policy version each was sampled under
    (a turn that spans a weight update carries two)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError("one log-probability and one version per sampled token")

    def extend(self, more: Generation) -> None:
        """Append the tokens sampled after these (a stream's next delta)."""
        self.token_ids += more.token_ids
        self.logprobs += more.logprobs
        self.versions += more.versions


@dataclass
class TurnTokens:
    """Rendered chat-format pieces of one episode, as token ids."""

    system: list[int]
    """The system turn, up to the end of its content (what closes it is
    the start of ``task`` and of the resume turn)."""
    task: list[int]
    """The user turn holding the task (after the system content)."""
    summary_request: list[int]
    """The user turn holding the summarisation instruction q_sum."""
    assistant_header: list[int]
    """Generation prompt before an assistant turn (``<|im_start|>assistant\\n``)."""
    assistant_end: list[int]
    """The end-of-turn token the model samples to stop (``<|im_end|>``); added
    as context when a turn stopped at its length limit instead."""
    assistant_footer: list[int]
    """What the template puts after the end-of-turn token (``\\n``)."""
    observation_open: list[int]
    """Start of an observation (tool) turn, up to its content."""
    observation_close: list[int]
    """End of an observation turn, after its content."""
    truncation_marker: list[int]
    """Content that replaces the cut-off end of an observation."""
    resume: Callable[[list[int]], list[int]]
    """The resume turn for given summary token ids (the policy's tokens,
    spliced in without re-tokenising), after the system content."""


@dataclass
class ClosedSegment:
    """A segment the actor's context closed (docs/design.md §2.2), before it
    is a wire ``Segment``: per-token arrays, equal length."""

    segment_type: Literal["execution", "summary"]
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """Per-step rewards, each on the last token of the action that earned it."""

    def to_message(self, header: dict[str, Any], rollout_id: str, task_id: str,
                   group: GroupTag | None, index: int, reward: float | None = None,
                   stats: RolloutStats | None = None) -> Segment:
        """The wire message; ``reward`` (and ``stats``) make it the rollout's final one."""
        return Segment(
            **header, rollout_id=rollout_id, task_id=task_id, group=group, index=index,
            segment_type=self.segment_type,
            tokens=Array.from_numpy(np.asarray(self.tokens, dtype=np.int32)),
            loss_mask=Array.from_numpy(np.asarray(self.loss_mask, dtype=np.uint8)),
            logprobs=Array.from_numpy(np.asarray(self.logprobs, dtype=np.float32)),
            versions=Array.from_numpy(np.asarray(self.versions, dtype=np.int32)),
            final=reward is not None, reward=reward, stats=stats,
            token_rewards=(Array.from_numpy(np.asarray(self.rewards, dtype=np.float32))
                           if any(self.rewards) else None))

    def append_context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.rewards += [0.0] * len(ids)

    def append_sampled(self, generation: Generation, reward: float = 0.0) -> None:
        """The policy's tokens; ``reward`` (a step's) goes on the last one."""
        self.tokens += generation.token_ids
        self.loss_mask += [1] * len(generation.token_ids)
        self.logprobs += generation.logprobs
        self.versions += generation.versions
        self.rewards += [0.0] * len(generation.token_ids)
        if generation.token_ids:
            self.rewards[-1] = reward

    @property
    def num_trainable(self) -> int:
        return sum(self.loss_mask)


@dataclass
class _Step:
    """An atomic step: its tokens as they entered the context."""

    action: Generation
    observation: list[int]
    """The whole observation turn (open + content + close)."""
    tokens: list[int]


class CompactionFailed(Exception):
    """Even with no kept step, the rebuilt context leaves less than the reserve."""


class CompactionContext:
    """``h_t`` as token ids with step boundaries, and the segments it produced."""

    def __init__(self, turns: TurnTokens, config: CompactionConfig) -> None:
        self.turns = turns
        self.config = config
        self.compactions = 0
        self.summary_tokens = 0
        self._summary_room = (
            len(turns.summary_request) + len(turns.assistant_header) + config.max_summary_tokens
            if config.enabled else 0)
        self._step_overhead = (len(turns.assistant_header) + len(turns.assistant_end)
                               + len(turns.assistant_footer) + len(turns.observation_open)
                               + len(turns.observation_close))
        if config.enabled and config.reserve_tokens < self._summary_room + self._min_step():
            raise ValueError(
                f"actors.compaction.reserve_tokens = {config.reserve_tokens} cannot hold the "
                f"summary request ({len(turns.summary_request)} tokens), the assistant header, "
                f"max_summary_tokens = {config.max_summary_tokens} and one minimal step: raise "
                f"it to at least {self._summary_room + self._min_step()}")
        self._segment = ClosedSegment("execution")
        self._segment.append_context(turns.system + turns.task)
        self._steps: list[_Step] = []
        if self._step_room() < self._min_step():
            raise ValueError("the system prompt and task leave no room for a step in "
                             f"context_tokens = {config.context_tokens}")

    # ------------------------------------------------------------------ sizes

    def __len__(self) -> int:
        """|h_t|: tokens in the current window."""
        return len(self._segment.tokens)

    def _min_step(self) -> int:
        return self._step_overhead + len(self.turns.truncation_marker) + MIN_ACTION_TOKENS

    def _step_room(self) -> int:
        return self.config.context_tokens - len(self) - self._summary_room

    def action_budget(self, max_turn_tokens: int) -> int:
        """max_tokens for the next action: the turn cap, lowered so that the
        action and a minimal observation fit in the step room."""
        room = self._step_room() - self._step_overhead - len(self.turns.truncation_marker)
        return max(0, min(max_turn_tokens, room))

    def is_full(self) -> bool:
        """No further step fits: the episode ends (compaction off or exhausted)."""
        return self._step_room() < self._min_step()

    def needs_compaction(self) -> bool:
        """After a step: fewer than reserve_tokens free (compaction on)."""
        return (self.config.enabled
                and self.config.context_tokens - len(self) < self.config.reserve_tokens)

    def compaction_allowed(self) -> bool:
        return self.config.enabled and self.compactions < self.config.max_compactions

    # ------------------------------------------------------------------ steps

    def action_prompt(self) -> list[int]:
        return self._segment.tokens + self.turns.assistant_header

    def add_step(self, action: Generation, observation: list[int], reward: float = 0.0) -> bool:
        """Append an action and its observation (content token ids);
        ``reward``, the step's own, goes on the action's last token. Returns
        whether the observation was cut to fit the window."""
        if len(action.token_ids) > self.action_budget(len(action.token_ids)):
            raise ValueError(f"action of {len(action.token_ids)} tokens exceeds its budget")
        closing = self._turn_closing(action)
        room = (self._step_room() - len(self.turns.assistant_header) - len(action.token_ids)
                - len(closing) - len(self.turns.observation_open)
                - len(self.turns.observation_close))
        truncated = len(observation) > room
        if truncated:
            keep = room - len(self.turns.truncation_marker)
            observation = observation[:keep] + self.turns.truncation_marker
        observation_turn = (self.turns.observation_open + observation
                            + self.turns.observation_close)
        start = len(self)
        self._segment.append_context(self.turns.assistant_header)
        self._segment.append_sampled(action, reward)
        self._segment.append_context(closing + observation_turn)
        self._steps.append(_Step(action, observation_turn, self._segment.tokens[start:]))
        return truncated

    def _turn_closing(self, action: Generation) -> list[int]:
        """Footer after the action, with the end-of-turn token when the model
        did not sample it (the turn hit its length limit)."""
        end = self.turns.assistant_end
        ended = bool(end) and action.token_ids[-len(end):] == end
        return self.turns.assistant_footer if ended else end + self.turns.assistant_footer

    # ------------------------------------------------------------------ compaction

    def summary_prompt(self) -> list[int]:
        """h_t ⊕ q_sum, ready for the assistant's summary."""
        return self._segment.tokens + self.turns.summary_request + self.turns.assistant_header

    def summary_budget(self) -> int:
        return self.config.max_summary_tokens

    def compact(self, summary: Generation, summary_text_ids: list[int]) -> list[ClosedSegment]:
        """Close the execution segment and the summary segment, and rebuild
        ``s ⊕ resume(u, S) ⊕ last k steps`` with the largest k <= keep_steps
        that leaves reserve_tokens free. ``summary_text_ids`` are the summary's
        tokens as they go into the resume turn (the sampled ids without the
        end-of-turn token). Raises :class:`CompactionFailed` if even k = 0 does
        not fit; the two closed segments are then in ``exc.args[0]``."""
        if len(summary.token_ids) > self.config.max_summary_tokens:
            raise ValueError("summary longer than max_summary_tokens")
        execution = self._segment
        summary_segment = ClosedSegment("summary")
        summary_segment.append_context(self.summary_prompt())
        summary_segment.append_sampled(summary)
        closed = [execution, summary_segment]
        self.compactions += 1
        self.summary_tokens += len(summary.token_ids)

        base = self.turns.system + self.turns.resume(summary_text_ids)
        for k in range(min(self.config.keep_steps, len(self._steps)), -1, -1):
            kept = self._steps[len(self._steps) - k:] if k else []
            rebuilt = base + [t for step in kept for t in step.tokens]
            if self.config.context_tokens - len(rebuilt) >= self.config.reserve_tokens:
                self._segment = ClosedSegment("execution")
                self._segment.append_context(rebuilt)
                self._steps = kept
                return closed
        raise CompactionFailed(closed)

    def finish(self) -> ClosedSegment:
        """Close the current execution segment (the episode's last)."""
        return self._segment
