"""One compaction-enabled episode: the agent loop of docs/design.md §2.1.

The loop asks the context for a prompt and a budget, samples the action,
steps the environment, appends the step, and compacts when the reserve is
reached: the summary is sampled by the same engine, the execution and summary
segments are handed to ``emit`` at once, and the episode continues in the
rebuilt window. The last segment carries the reward and the episode's stats.

A task with tools has each action parsed for calls (actors/tools.py): the
calls go to the environment's ``call_tool`` in order (their observations
joined in one observation turn), a turn without a call to ``step`` (an
answer), and a call that cannot be taken is answered with an observation
saying what was wrong, counted by reason. Summaries are never parsed.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import ClosedSegment, CompactionContext, CompactionFailed, Generation
from actors.envs.base import Environment, StepResult, Task
from ops.timeline import add_span
from protocol import RolloutStats, wire_info

#: Per-turn sampling seeds are episode_seed * SEED_STRIDE + turn: reproducible
#: per episode, distinct across episodes.
SEED_STRIDE = 100_003


class GeneratingPolicy(Protocol):
    """What the loop needs from the engine (:class:`actors.engine.Engine`)."""

    async def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                       temperature: float | None = None) -> Generation: ...


@dataclass
class EpisodeResult:
    """How an episode ended; ``reward`` and ``stats`` travel with its final segment."""

    task_id: str
    reward: float
    stats: RolloutStats
    summary_seconds: float
    """Time spent generating summaries (stall for the episode)."""
    observations_cut: int
    tool_call_errors: Counter[str] = field(default_factory=Counter)
    """Calls answered with an error observation, by reason."""
    info: dict[str, Any] = field(default_factory=dict)
    """The environment's ``info`` of the step that ended the episode: where
    it gives them, the parts of its reward (KeyVault's digits right, a
    verifiers rubric's metrics)."""

    @classmethod
    def of(cls, task_id: str, outcome: str, reward: float, success: bool, *, steps: int,
           compactions: int, generated_tokens: int, summary_tokens: int, duration_s: float,
           tags: dict[str, str], summary_seconds: float, observations_cut: int = 0,
           tool_call_errors: Counter[str] | None = None,
           info: dict[str, Any] | None = None) -> EpisodeResult:
        """The result and its :class:`RolloutStats` (what the final segment
        carries), as an episode and a harness session both end."""
        stats = RolloutStats(outcome=outcome, success=success, steps=steps,
                             compactions=compactions, generated_tokens=generated_tokens,
                             summary_tokens=summary_tokens, duration_s=duration_s, tags=tags,
                             info=wire_info(info or {}))
        return cls(task_id, reward, stats, summary_seconds, observations_cut,
                   tool_call_errors or Counter(), info or {})


Emit = Callable[[str, ClosedSegment, "EpisodeResult | None"], Awaitable[None]]
"""Called with the task id and each closed segment, in order; the result
only with the last segment."""


@dataclass
class _Tally:
    """What an episode counts as it goes, for its :class:`EpisodeResult`."""

    steps: int = 0
    generated: int = 0
    observations_cut: int = 0
    summary_seconds: float = 0.0
    outcome: str = "step_limit"
    reward: float = 0.0
    success: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    tool_call_errors: Counter[str] = field(default_factory=Counter)

    def result(self, task: Task, context: CompactionContext, duration_s: float
               ) -> EpisodeResult:
        return EpisodeResult.of(
            task.task_id, self.outcome, self.reward, self.success, steps=self.steps,
            compactions=context.compactions, generated_tokens=self.generated,
            summary_tokens=context.summary_tokens, duration_s=duration_s, tags=task.tags,
            summary_seconds=self.summary_seconds, observations_cut=self.observations_cut,
            tool_call_errors=self.tool_call_errors, info=self.info)


async def run_episode(policy: GeneratingPolicy, environment: Environment, chat: ChatFormat,
                      config: ActorConfig, seed: int, emit: Emit,
                      greedy: bool = False, sampling_seed: int | None = None,
                      summariser: GeneratingPolicy | None = None) -> EpisodeResult:
    """Play one episode of the task ``seed``; turns are sampled with seeds
    derived from ``sampling_seed`` (default: ``seed``). ``summariser`` writes
    the summaries (default: ``policy``; another: a frozen summariser, to
    tell what learning to compact adds)."""
    start = time.monotonic()
    task = await environment.reset(seed)
    chat = chat.with_tools(task.tools)
    context = CompactionContext(chat.turns(task), config.compaction)
    tally = _Tally()
    temperature = 0.0 if greedy else None
    base = seed if sampling_seed is None else sampling_seed
    turn_seeds = iter(range(base * SEED_STRIDE, (base + 1) * SEED_STRIDE))
    last: ClosedSegment | None = None
    while tally.steps < config.environment.max_steps:
        if context.is_full():
            tally.outcome = "context_full"
            break
        action = await policy.generate(context.action_prompt(),
                                       context.action_budget(config.sampling.max_turn_tokens),
                                       seed=next(turn_seeds), temperature=temperature)
        tally.generated += len(action.token_ids)
        try:
            result = await _act(environment, chat, task, chat.strip_end(action.token_ids),
                                tally.tool_call_errors)
        except Exception as exc:  # a broken environment ends this episode, not the actor
            context.add_step(action, chat.content(f"environment error: {exc}", 64)[0])
            tally.outcome = "error"
            break
        tally.steps += 1
        observation, cut = chat.content(result.observation,
                                        config.environment.observation_max_tokens)
        tally.observations_cut += context.add_step(action, observation, result.step_reward) or cut
        if result.done:
            tally.outcome, tally.reward = "done", result.reward
            tally.success, tally.info = result.success, result.info
            break
        if not context.needs_compaction():
            continue
        if not context.compaction_allowed():
            tally.outcome = "compaction_limit"
            break
        summary = await _summarise(summariser or policy, context, next(turn_seeds), temperature,
                                   tally)
        try:
            closed = context.compact(summary, chat.strip_end(summary.token_ids))
        except CompactionFailed as failed:
            execution, last = failed.args[0]
            await emit(task.task_id, execution, None)
            tally.outcome = "compaction_failed"
            break
        for segment in closed:
            await emit(task.task_id, segment, None)
    episode = tally.result(task, context, time.monotonic() - start)
    await emit(task.task_id, last if last is not None else context.finish(), episode)
    return episode


async def _summarise(summariser: GeneratingPolicy, context: CompactionContext, seed: int,
                     temperature: float | None, tally: _Tally) -> Generation:
    """The summary of the context so far, its time and tokens counted."""
    began = time.monotonic()
    summary = await summariser.generate(context.summary_prompt(), context.summary_budget(),
                                        seed=seed, temperature=temperature)
    ended = time.monotonic()
    tally.summary_seconds += ended - began
    add_span("summary", began, ended, tokens=len(summary.token_ids))
    tally.generated += len(summary.token_ids)
    return summary


async def _act(environment: Environment, chat: ChatFormat, task: Task, action: list[int],
               tool_call_errors: Counter[str]) -> StepResult:
    """The environment's answer to one action (its tokens without the end of turn)."""
    if not task.tools:
        return await environment.step(chat.decode(action))
    parsed = chat.tool_calls.parse(chat.decode(action, keep_special=True), task.tools)
    if parsed.reason is not None:
        tool_call_errors[parsed.reason] += 1
        return StepResult(f"tool call error: {parsed.error}")
    if not parsed.calls:
        return await environment.step(chat.decode(action))
    observations, step_reward = [], 0.0
    for call in parsed.calls:
        result = await environment.call_tool(call)
        observations.append(result.observation)
        step_reward += result.step_reward
        if result.done:
            break
    return dataclasses.replace(result, observation="\n".join(observations),
                               step_reward=step_reward)
