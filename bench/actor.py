"""Rollout throughput of the full agent loop against raw vLLM generation.

Runs keyvault episodes with compaction (zero-latency environment) on the
tiny model, recording every request the loop makes (prompt ids, tokens
generated). Then replays exactly those requests on the same ``AsyncLLM`` with
the same concurrency and the same per-episode ordering, with ``ignore_eos``
and ``max_tokens`` = the recorded count, so both generate the same tokens for
the same prompts. The ratio is what the agent machinery (chat format,
compaction bookkeeping, environment, asyncio) costs on top of generation.

    python bench/actor.py [--json] [--quick] [--episodes 16] [--concurrency 8]

``--quick``: 2 episodes, both at once, without the warm-up (a smoke test of the
same code).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator

from _options import BenchmarkParser  # bench/_options.py

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import Generation
from actors.engine import Engine, quiet_vllm_logging
from actors.envs.base import load_environment
from actors.episode import run_episode
from deploy.config import load_config

#: A window small enough that the tiny model compacts several times per episode.
SMALL_WINDOW = ["--actors.compaction.context_tokens", "512",
                "--actors.compaction.reserve_tokens", "200",
                "--actors.compaction.max_summary_tokens", "64",
                "--actors.sampling.max_turn_tokens", "32", "--actors.environment.max_steps", "24"]


class Recorder:
    """The engine, recording each request of one episode."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.requests: list[tuple[list[int], int]] = []

    async def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                       temperature: float | None = None) -> Generation:
        generation = await self.engine.generate(prompt, max_tokens, seed, temperature)
        self.requests.append((list(prompt), len(generation.token_ids)))
        return generation


async def agent_loop(engine: Engine, episodes: int, concurrency: int
                     ) -> tuple[float, list[list[tuple[list[int], int]]], dict]:
    config = load_config(None, SMALL_WINDOW).actors
    chat = ChatFormat(engine.tokenizer, config.compaction, config.environment)
    seeds = iter(range(episodes))
    recorders: list[Recorder] = []
    totals = {"summary_tokens": 0, "generated_tokens": 0, "compactions": 0, "summary_s": 0.0}

    async def ignore(task_id, segment, result) -> None:
        return None

    async def worker() -> None:
        environment = load_environment(config.environment.factory, config.environment.options)
        for seed in seeds:
            recorder = Recorder(engine)
            recorders.append(recorder)
            result = await run_episode(recorder, environment, chat, config, seed, ignore)
            totals["summary_tokens"] += result.stats.summary_tokens
            totals["generated_tokens"] += result.stats.generated_tokens
            totals["compactions"] += result.stats.compactions
            totals["summary_s"] += result.summary_seconds

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, [r.requests for r in recorders], totals


async def raw_replay(engine: Engine, episodes: list[list[tuple[list[int], int]]],
                     concurrency: int) -> float:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    queue = iter(episodes)
    ids = itertools.count()

    async def worker() -> None:
        for requests in queue:
            for prompt, n in requests:
                if n == 0:
                    continue
                params = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0,
                                        output_kind=RequestOutputKind.FINAL_ONLY)
                async for _ in engine.llm.generate({"prompt_token_ids": prompt}, params,
                                                   request_id=f"raw-{next(ids)}"):
                    pass

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start


@contextlib.asynccontextmanager
async def warm_tiny_engine(concurrency: int, warm: bool
                           ) -> AsyncIterator[tuple[Engine, ActorConfig]]:
    """An engine on a fresh tiny model with the small-window actor
    configuration, warmed up by ``concurrency`` episodes where ``warm`` (not
    under ``--quick``: a smoke test's ratios are not read, and the warm-up was
    a third of its generated tokens); shut down on exit."""
    from starting_points.tiny_model import temporary_tiny_model

    config = load_config(None, SMALL_WINDOW).actors
    with temporary_tiny_model() as model:
        engine = await Engine.start(model, config.engine, config.sampling)
        try:
            if warm:
                await agent_loop(engine, concurrency, concurrency)
            yield engine, config
        finally:
            await engine.shutdown()


async def main(args: argparse.Namespace) -> dict:
    async with warm_tiny_engine(args.concurrency, not args.quick) as (engine, _):
        agent_s, episodes, totals = await agent_loop(engine, args.episodes, args.concurrency)
        raw_s = await raw_replay(engine, episodes, args.concurrency)
    tokens = totals["generated_tokens"]
    result = {
        "episodes": args.episodes, "concurrency": args.concurrency, "generated_tokens": tokens,
        "agent_tokens_per_s": round(tokens / agent_s, 1),
        "raw_tokens_per_s": round(tokens / raw_s, 1),
        "vs_raw_vllm": round(raw_s / agent_s, 3),
        "summary_token_share": round(totals["summary_tokens"] / tokens, 3),
        "compactions": totals["compactions"],
        "compaction_stall_seconds": round(totals["summary_s"], 3),
        "compaction_stall_seconds_per_compaction": round(
            totals["summary_s"] / max(1, totals["compactions"]), 4),
    }
    return result


def episode_arguments(description: str, repeatable: bool = False) -> argparse.Namespace:
    """The command line of a benchmark of episodes (this one, bench/endpoint.py);
    ``repeatable``: with ``--repeats``."""
    parser = BenchmarkParser(description, quick="2 episodes, both at once, unless given, "
                             "and no warm-up (smoke test)")
    if repeatable:
        parser.add_argument("--repeats", type=int, default=1,
                            help="measure this many times on the same engine (the paths in "
                                 "alternating order); report the median run and every ratio")
    parser.add_size("--episodes", 16, 2, "episodes", type=int)
    parser.add_size("--concurrency", 8, 2, "episodes at once", type=int)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = episode_arguments(__doc__.splitlines()[0])
    quiet_vllm_logging()
    report = asyncio.run(main(arguments))
    print(f"agent loop {report['agent_tokens_per_s']} tokens/s, raw vLLM "
          f"{report['raw_tokens_per_s']} tokens/s: ratio {report['vs_raw_vllm']} "
          f"({report['generated_tokens']} tokens, {report['compactions']} compactions, "
          f"summary share {report['summary_token_share']}, "
          f"{report['compaction_stall_seconds_per_compaction']} s stall per compaction)")
    if arguments.json:
        print(json.dumps(report))
