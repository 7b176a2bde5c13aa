"""What compaction costs, and what learning to compact changes it to.

The seed documents leave open what compaction costs (its latency, per-step
cost and summary-token overhead are not reported) and whether a learned
compaction stalls less than a frozen summariser. For the base policy and the
trained one, on the same held-out keyvault episodes of the local default
(compaction on, 32 episodes at a time on one engine, as ``compactionrl
eval`` runs them), in one run:

- **stall**: the wall seconds an episode waits for each of its summaries
  (``stall_s_per_compaction``) and in all (``stall_s_per_episode``);
- **summary tokens** per compaction and their share of the tokens generated;
- **learner time on summaries**: a PPO step over the policy's own rollouts
  (the first 64), timed with and without their summary segments (same
  rollouts, same trainer, interleaved), ``learner_summary_time_share`` =
  1 - without/with;
- **a frozen summariser**: the trained policy acts and the base policy writes
  the summaries (``trained_frozen_summariser``), success and stall beside the
  trained policy compacting for itself.

    python bench/compaction_cost.py [--json] [--quick] [--episodes 200]
        [--base runs/base-model] [--trained runs/local-cpu/export] [--learner-repeats 3]
        [--docs DIR]

``--docs DIR``: also write ``DIR/compaction_cost.json`` and the table's
section of ``DIR/results.md``.

``--quick``: 8 episodes and one learner repeat, with a fresh tiny model as
both policies (a smoke test of the same code; it needs no trained run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _options import BenchmarkParser  # bench/_options.py

from actors.config import ActorConfig
from actors.context import ClosedSegment
from actors.engine import Engine, quiet_vllm_logging
from actors.episode import EpisodeResult
from deploy.config import load_config
from deploy.evaluate import play_held_out, require_model_folders
from ops.files import write_section
from protocol import Batch, Rollout, StalenessStats, Stamp
from starting_points.tiny_model import temporary_tiny_model

#: Rollouts of the timed learner step (a step of the local default trains 16).
LEARNER_ROLLOUTS = 64


def figures(results: list[EpisodeResult], seconds: float) -> dict[str, float]:
    n = len(results)
    compactions = sum(r.stats.compactions for r in results)
    generated = sum(r.stats.generated_tokens for r in results)
    summary_tokens = sum(r.stats.summary_tokens for r in results)
    stall = sum(r.summary_seconds for r in results)
    return {"episodes": n, "success": sum(r.stats.success for r in results) / n,
            "compactions_per_episode": compactions / n,
            "stall_s_per_compaction": stall / compactions if compactions else 0.0,
            "stall_s_per_episode": stall / n,
            "episode_s": sum(r.stats.duration_s for r in results) / n,
            "summary_tokens_per_compaction": summary_tokens / compactions if compactions else 0.0,
            "summary_token_share": summary_tokens / generated if generated else 0.0,
            "wall_s": seconds}


def as_batch(segments: dict[int, list[ClosedSegment]], results: list[EpisodeResult],
             keep_summaries: bool) -> Batch:
    """The episodes as the learner gets them; without their summary segments
    when not ``keep_summaries``."""
    stamp = Stamp("bench", 1)
    rollouts = []
    for n, result in enumerate(results):
        kept = [s for s in segments[n] if keep_summaries or s.segment_type != "summary"]
        messages = [s.to_message(stamp.next(), f"episode-{n}", result.task_id, None, i)
                    for i, s in enumerate(kept[:-1])]
        messages.append(kept[-1].to_message(stamp.next(), f"episode-{n}", result.task_id, None,
                                            len(kept) - 1, result.reward, result.stats))
        rollouts.append(Rollout(rollout_id=f"episode-{n}", staleness=0, segments=messages))
    return Batch(**stamp.next(), policy_version=0, rollouts=rollouts,
                 staleness=StalenessStats(min=0, max=0, mean=0.0, p50=0.0, p95=0.0))


def learner_summary_share(model: str, segments: dict[int, list[ClosedSegment]],
                          results: list[EpisodeResult], repeats: int) -> dict[str, float]:
    """Seconds of a PPO step over the rollouts with and without their summaries."""
    import torch

    from learner.batch import to_train_batch
    from learner.config import LearnerConfig
    from learner.models import load_critic, load_policy
    from learner.ppo import PPOTrainer

    config = LearnerConfig()
    torch.manual_seed(0)
    trainer = PPOTrainer(load_policy(model), load_critic(model), config)
    batches = {keep: to_train_batch(as_batch(segments, results, keep), config.train_summary,
                                    config.share_prefixes) for keep in (True, False)}
    trainer.step(batches[True])  # warm-up
    seconds: dict[bool, float] = defaultdict(float)
    for _ in range(repeats):
        for keep, batch in batches.items():  # interleaved: both see the same machine state
            began = time.perf_counter()
            trainer.step(batch)
            seconds[keep] += time.perf_counter() - began
    return {"learner_step_s": seconds[True] / repeats,
            "learner_step_s_without_summaries": seconds[False] / repeats,
            "learner_summary_time_share": 1 - seconds[False] / seconds[True]}


async def play(engine: Engine, actors: ActorConfig, episodes: int,
               summariser: Engine | None = None
               ) -> tuple[list[EpisodeResult], dict[int, list[ClosedSegment]], float]:
    """The held-out episodes on ``engine`` (``summariser`` writing the
    summaries, if given), from an empty prefix cache."""
    for used in {engine, summariser} - {None}:
        await used.reset_prefix_cache()
    segments: dict[int, list[ClosedSegment]] = defaultdict(list)
    began = time.perf_counter()
    results = await play_held_out(engine, actors, episodes, show_progress=False,
                                  summariser=summariser,
                                  keep=lambda n, s: segments[n].append(s))
    return results, segments, time.perf_counter() - began


async def measure(base: str, trained: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every policy's figures, with one engine per distinct model (the same
    engine for both policies where they are one model, as with ``--quick``)."""
    actors = load_config(None, []).actors
    report: dict[str, Any] = {"episodes": args.episodes, "base_model": base,
                              "trained_model": trained}
    engines: dict[str, Engine] = {}
    try:
        for model in dict.fromkeys((base, trained)):
            engines[model] = await Engine.start(model, actors.engine, actors.sampling)
        for name, model, summariser in (("base", base, None), ("trained", trained, None),
                                        ("trained_frozen_summariser", trained, base)):
            results, segments, seconds = await play(
                engines[model], actors, args.episodes,
                engines[summariser] if summariser else None)
            report[name] = figures(results, seconds)
            if summariser is None:
                report[name] |= learner_summary_share(
                    model, segments, results[:LEARNER_ROLLOUTS], args.learner_repeats)
            print(f"{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in report[name].items()),
                  flush=True)
    finally:
        for engine in engines.values():
            await engine.shutdown()
    trained_stall = report["trained"]["stall_s_per_compaction"]
    report["frozen_vs_trained_stall"] = (report["trained_frozen_summariser"]
                                         ["stall_s_per_compaction"] / trained_stall
                                         if trained_stall else None)
    return report


ROWS = (("base", "base"), ("trained", "trained"),
        ("trained_frozen_summariser", "trained, base writes the summaries"))


def write_docs(report: dict[str, Any], docs: Path) -> None:
    (docs / "compaction_cost.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "## What compaction costs",
        "",
        f"Generated by `python bench/compaction_cost.py --json --docs docs --base "
        f"{report['base_model']} --trained {report['trained_model']}` (raw numbers: "
        "[compaction_cost.json](compaction_cost.json)). The same "
        f"{report['episodes']} held-out episodes of the local default for each policy, 32 at "
        "a time on one engine; stall is the wall time an episode waits while its summary is "
        "generated; learner time is a PPO step over the policy's first "
        f"{LEARNER_ROLLOUTS} rollouts with and without their summary segments.",
        "",
        "| policy | success | compactions / episode | stall per compaction | stall per episode "
        "(of its wall time) | summary tokens / compaction | summary share of generated "
        "tokens | learner time on summaries |",
        "|---|---|---|---|---|---|---|---|"]
    for key, label in ROWS:
        row = report[key]
        share = row.get("learner_summary_time_share")
        lines.append(
            f"| {label} | {100 * row['success']:.1f} % | {row['compactions_per_episode']:.2f} | "
            f"{row['stall_s_per_compaction']:.3f} s | {row['stall_s_per_episode']:.2f} s "
            f"({100 * row['stall_s_per_episode'] / row['episode_s']:.0f} %) | "
            f"{row['summary_tokens_per_compaction']:.1f} | "
            f"{100 * row['summary_token_share']:.1f} % | "
            + (f"{100 * share:.1f} %" if share is not None else "-") + " |")
    write_section(docs / "results.md", "compaction_cost", "\n".join(lines) + "\n")


def main() -> None:
    parser = BenchmarkParser(__doc__.splitlines()[0], quick="8 episodes, 1 learner repeat, a "
                             "tiny model as both policies")
    parser.add_size("--episodes", 200, 8, "episodes", type=int)
    parser.add_size("--learner-repeats", 3, 1, "timed learner steps", type=int)
    parser.add_argument("--base", default="runs/base-model", help="the policy before training")
    parser.add_argument("--trained", default="runs/local-cpu/export", help="the trained policy")
    parser.add_argument("--docs", default=None,
                        help="also write DIR/compaction_cost.json and its part of results.md")
    args = parser.parse_args()
    quiet_vllm_logging()
    if args.quick:
        with temporary_tiny_model() as tiny:
            report = asyncio.run(measure(tiny, tiny, args))
    else:
        require_model_folders([args.base, args.trained], "give --base and --trained")
        report = asyncio.run(measure(args.base, args.trained, args))
    if args.docs:
        write_docs(report, Path(args.docs))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
