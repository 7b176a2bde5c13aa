"""``compactionrl eval``: success of a policy on held-out episodes.

Episodes run on the actors' engine and agent loop, at the actors' sampling
temperature (the policy as it trains, not greedy: greedy decoding hides most
of a base policy's flaws), with seeds from
:data:`actors.envs.base.EVALUATION_SEEDS_FROM` up, which no training or
demonstration episode uses. The report: success rate with a 95 % Wilson
interval, mean reward, compactions per episode, success by number of
compactions, and summary length. The first :data:`SHOWN_EPISODES` episodes
are kept whole (:class:`ShownEpisodes`): evaluated into a run folder, they are
the rollout viewer's same held-out tasks before and after training.

Usage::

    evaluation = evaluate("runs/local-cpu/export", config.actors, episodes=200)
    print(format_report(evaluation.report))
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import ClosedSegment
from actors.engine import Engine, quiet_vllm_logging, require_model_folder
from actors.envs.base import EVALUATION_SEEDS_FROM, load_environment
from actors.episode import EpisodeResult, run_episode
from actors.preflight import check_episode_setup

#: Episodes in flight on the engine at once: enough to batch the tiny
#: model's short turns, few enough that the progress bar moves steadily.
CONCURRENT_EPISODES = 32
#: Held-out episodes kept whole for the rollout viewer (the first ones: the
#: same tasks for every policy evaluated on them).
SHOWN_EPISODES = 3
#: z for a two-sided 95 % interval.
Z_95 = 1.959964


def require_model_folders(models: list[str], alternative: str) -> None:
    """Stop with one line unless every one of ``models`` is a model folder
    (:func:`actors.engine.require_model_folder`): the evaluation benchmarks
    compare the demo's policies, which ``make demo`` makes (``alternative``:
    how to name other ones)."""
    for model in models:
        try:
            require_model_folder(model)
        except FileNotFoundError:
            raise SystemExit(f"{model} is not a model folder: run `make demo` first "
                             f"(or {alternative})") from None


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (sound at 0 and 1,
    unlike the normal approximation)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class EvalReport:
    """What ``compactionrl eval`` reports (JSON: :func:`dataclasses.asdict`)."""

    model: str
    episodes: int
    compaction: bool
    max_compactions: int
    temperature: float
    success: float
    success_ci95: tuple[float, float]
    mean_reward: float
    compactions_per_episode: float
    summary_tokens_per_compaction: float
    success_by_compactions: dict[int, dict[str, float]] = field(default_factory=dict)
    """Number of compactions -> {"episodes": n, "success": rate}."""
    outcomes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    success_by_tag: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """Task tag -> its value -> {"episodes": n, "success": rate} (``Task.tags``)."""
    group_size: int = 1
    """Episodes played on each held-out task (consecutive episodes, other samples)."""
    compaction_spread: dict[int, int] = field(default_factory=dict)
    """With groups: the most minus the fewest compactions within a group ->
    groups with that spread (how unequally one task's rollouts compacted)."""
    successes_by_task: list[int] = field(default_factory=list)
    """Successes on each held-out task, in task order (task n is played by
    episodes n*g to n*g + g - 1): what intervals clustered by task resample."""


def summarise(model: str, actors: ActorConfig, results: list[EpisodeResult],
              seconds: float, group_size: int = 1) -> EvalReport:
    n = len(results)
    successes = sum(r.stats.success for r in results)
    compactions = sum(r.stats.compactions for r in results)
    by_count: dict[int, list[bool]] = defaultdict(list)
    by_tag: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    outcomes: dict[str, int] = defaultdict(int)
    for r in results:
        by_count[r.stats.compactions].append(r.stats.success)
        for tag, value in r.stats.tags.items():
            by_tag[tag][value].append(r.stats.success)
        outcomes[r.stats.outcome] += 1
    return EvalReport(
        model=model, episodes=n, compaction=actors.compaction.enabled,
        max_compactions=actors.compaction.max_compactions,
        temperature=actors.sampling.temperature,
        success=successes / n if n else 0.0, success_ci95=wilson_interval(successes, n),
        mean_reward=sum(r.reward for r in results) / n if n else 0.0,
        compactions_per_episode=compactions / n if n else 0.0,
        summary_tokens_per_compaction=(sum(r.stats.summary_tokens for r in results)
                                       / compactions if compactions else 0.0),
        success_by_compactions={k: {"episodes": len(v), "success": sum(v) / len(v)}
                                for k, v in sorted(by_count.items())},
        outcomes=dict(sorted(outcomes.items())), seconds=seconds,
        success_by_tag={tag: {value: {"episodes": len(v), "success": sum(v) / len(v)}
                              for value, v in sorted(values.items())}
                        for tag, values in sorted(by_tag.items())},
        group_size=group_size, compaction_spread=compaction_spread(results, group_size),
        successes_by_task=[sum(r.stats.success for r in results[start:start + group_size])
                           for start in range(0, n, group_size)])


def compaction_spread(results: list[EpisodeResult], group_size: int) -> dict[int, int]:
    """Spread of compactions (most minus fewest) -> groups, over the whole
    groups of ``group_size`` consecutive results; empty without groups."""
    if group_size < 2:
        return {}
    spreads: Counter[int] = Counter()
    for start in range(0, len(results) - group_size + 1, group_size):
        counts = [r.stats.compactions for r in results[start:start + group_size]]
        spreads[max(counts) - min(counts)] += 1
    return dict(sorted(spreads.items()))


class ShownEpisodes:
    """The segments of the first :data:`SHOWN_EPISODES` held-out episodes, as
    ``play_held_out``'s ``keep`` is told them, and then those episodes whole."""

    def __init__(self) -> None:
        self.segments: dict[int, list[ClosedSegment]] = defaultdict(list)

    def keep(self, n: int, segment: ClosedSegment) -> None:
        if n < SHOWN_EPISODES:
            self.segments[n].append(segment)

    def episodes(self, results: list[EpisodeResult]) -> list[dict[str, Any]]:
        """Each kept episode: its task, outcome and segments in order (JSON)."""
        return [{"episode": n, "task_id": result.task_id, "reward": result.reward,
                 "success": result.stats.success, "compactions": result.stats.compactions,
                 "tags": dict(result.stats.tags), "info": dict(result.stats.info),
                 "segments": [{"type": s.segment_type, "tokens": s.tokens,
                               "loss_mask": s.loss_mask, "logprobs": s.logprobs}
                              for s in self.segments[n]]}
                for n, result in enumerate(results[:SHOWN_EPISODES])]


@dataclass
class Evaluation:
    """A policy's held-out report, and the episodes kept whole."""

    report: EvalReport
    shown: list[dict[str, Any]]


async def run_evaluation(model: str, actors: ActorConfig, episodes: int,
                         show_progress: bool = True, group_size: int = 1) -> Evaluation:
    began = time.perf_counter()
    # before the engine's slow start: the first held-out task can be played
    await check_episode_setup(model, actors, seed=EVALUATION_SEEDS_FROM)
    engine = await Engine.start(model, actors.engine, actors.sampling)
    shown = ShownEpisodes()
    try:
        results = await play_held_out(engine, actors, episodes, show_progress,
                                      keep=shown.keep, group_size=group_size)
    finally:
        await engine.shutdown()
    return Evaluation(summarise(model, actors, results, time.perf_counter() - began, group_size),
                      shown.episodes(results))


async def play_held_out(engine: Engine, actors: ActorConfig, episodes: int,
                        show_progress: bool = True, summariser: Engine | None = None,
                        keep: Callable[[int, ClosedSegment], None] | None = None,
                        group_size: int = 1) -> list[EpisodeResult]:
    """The held-out episodes 0 .. ``episodes`` - 1 on ``engine``,
    :data:`CONCURRENT_EPISODES` at a time; ``summariser`` writes the
    summaries (default: the same engine); ``keep(n, segment)`` is told each
    segment of episode ``n``. With ``group_size`` g, episode n plays held-out
    task n // g, sampled with a seed of its own (n), as GRPO's groups do."""
    from rich.progress import Progress

    chat = ChatFormat(engine.tokenizer, actors.compaction, actors.environment)
    slots = asyncio.Semaphore(CONCURRENT_EPISODES)
    with Progress(disable=not show_progress, transient=True) as progress:
        bar = progress.add_task("evaluating", total=episodes)

        async def one(n: int) -> EpisodeResult:
            async def emit(task_id: str, segment: ClosedSegment,
                           result: EpisodeResult | None) -> None:
                if keep is not None:
                    keep(n, segment)

            async with slots:
                environment = load_environment(actors.environment.factory,
                                               actors.environment.options)
                try:
                    return await run_episode(engine, environment, chat, actors,
                                             EVALUATION_SEEDS_FROM + n // group_size, emit,
                                             summariser=summariser,
                                             sampling_seed=EVALUATION_SEEDS_FROM + n)
                finally:
                    await environment.close()
                    progress.advance(bar)

        return list(await asyncio.gather(*(one(n) for n in range(episodes))))


def evaluate(model: str, actors: ActorConfig, episodes: int,
             show_progress: bool = True, group_size: int = 1) -> Evaluation:
    quiet_vllm_logging()
    return asyncio.run(run_evaluation(model, actors, episodes, show_progress, group_size))


def format_report(report: EvalReport) -> str:
    low, high = report.success_ci95
    lines = [
        f"model {report.model}: {report.episodes} held-out episodes, compaction "
        f"{'on' if report.compaction else 'off'} (at most {report.max_compactions}), "
        f"temperature {report.temperature:g}, {report.seconds:.0f} s",
        f"  success               {report.success:6.1%}  (95% CI {low:.1%} - {high:.1%})",
        f"  mean reward           {report.mean_reward:6.3f}",
        f"  compactions/episode   {report.compactions_per_episode:6.2f}",
        f"  summary tokens        {report.summary_tokens_per_compaction:6.1f} per compaction",
        "  success by compactions: " + ", ".join(
            f"{k}: {v['success']:.1%} of {v['episodes']:.0f}"
            for k, v in report.success_by_compactions.items()),
        "  outcomes: " + ", ".join(f"{k} {v}" for k, v in report.outcomes.items()),
    ]
    if report.compaction_spread:
        lines.append(f"  compaction spread within groups of {report.group_size} "
                     "(most - fewest: groups): " + ", ".join(
                         f"{k}: {v}" for k, v in report.compaction_spread.items()))
    lines += [f"  success by {tag}: " + ", ".join(
        f"{value}: {v['success']:.1%} of {v['episodes']:.0f}" for value, v in values.items())
        for tag, values in report.success_by_tag.items()]
    return "\n".join(lines)

