"""What the recording endpoint costs against the actor's own agent loop.

Both paths play KeyVault episodes on one tiny-model engine, with the same
window, turn and summary budgets and concurrency: the actor's own loop
(actors/episode.py, as bench/actor.py runs it), and the harness of
examples/keyvault_agent.py (the ``openai`` client, its own framing and
compaction), run as users run it, in its own process, through the
endpoint's HTTP server on loopback. Each path's
requests (prompt ids, tokens sampled) are recorded and replayed on the raw
``AsyncLLM`` (``ignore_eos``, ``max_tokens`` = the recorded count) in the
same run, so each path is measured against raw generation of exactly its own
requests; the endpoint's ratio over the own loop's is the cost of HTTP, the
client, rendering the messages and the session bookkeeping.

    python bench/endpoint.py [--json] [--quick] [--episodes 16] [--concurrency 8]
                             [--repeats 1]

The ratios move from run to run by more than the endpoint's cost (the raw
replays are noisy on a small machine): ``--repeats N`` measures N times on
the same engine, the two paths in alternating order, and reports the run of
median ``endpoint_vs_own_loop`` with every run's ratio
(``runs_endpoint_vs_own_loop``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from actor import (  # bench/actor.py
    agent_loop,
    episode_arguments,
    raw_replay,
    warm_tiny_engine,
)

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import ClosedSegment
from actors.engine import Engine, quiet_vllm_logging
from actors.episode import EpisodeResult
from actors.metrics import ActorMetrics
from actors.recording_endpoint import RecordingEndpoint
from actors.rollout_writer import Rollout
from protocol import GroupTag


class BenchHost:
    """An actor that always has a credit and keeps, of the segments it is
    sent, each call's request: the tokens before each run of sampled tokens
    (its prompt) and the run's length; and when the first session opened
    and the last one closed. It is its rollouts' replay link too."""

    def __init__(self, engine: Engine, config: ActorConfig) -> None:
        self.config = config
        self.chat = ChatFormat(engine.tokenizer, config.compaction, config.environment)
        self.metrics = ActorMetrics()
        self.policy = engine
        self.replay_link = self
        self.rollouts = 0
        self.requests: dict[str, list[tuple[list[int], int]]] = {}
        self.first_open = self.last_close = 0.0

    async def open_rollout(self) -> Rollout:
        self.rollouts += 1
        self.first_open = self.first_open or time.perf_counter()
        return Rollout(self, self.rollouts, f"bench-{self.rollouts}")

    async def close_rollout(self, rollout: Rollout, abandoned: bool) -> None:
        self.last_close = time.perf_counter()

    async def send_segment(self, rollout_id: str, task_id: str, group: GroupTag | None,
                           index: int, segment: ClosedSegment, result: EpisodeResult | None
                           ) -> None:
        requests = self.requests.setdefault(rollout_id, [])
        mask = segment.loss_mask
        for i, sampled in enumerate(mask):
            if sampled and (i == 0 or not mask[i - 1]):
                length = next((j for j in range(i, len(mask)) if not mask[j]), len(mask)) - i
                requests.append((segment.tokens[:i], length))


async def harness_episodes(engine: Engine, config: ActorConfig, episodes: int,
                           concurrency: int) -> tuple[float, list[list[tuple[list[int], int]]],
                                                      int]:
    """examples/keyvault_agent.py as users run it, in its own process,
    through the endpoint: seconds from the first session's start to the last
    one's end (the harness's own start-up left out), each session's
    requests, summaries."""
    host = BenchHost(engine, config)
    endpoint = RecordingEndpoint(host, "policy")
    port = await endpoint.start(0)
    harness = Path(__file__).resolve().parents[1] / "examples" / "keyvault_agent.py"
    compaction, environment = config.compaction, config.environment
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(harness), "--base-url", f"http://127.0.0.1:{port}/v1",
        "--episodes", str(episodes), "--concurrency", str(concurrency),
        "--environment", environment.factory, "--options", json.dumps(environment.options),
        "--context-tokens", str(compaction.context_tokens),
        "--reserve-tokens", str(compaction.reserve_tokens),
        "--turn-tokens", str(config.sampling.max_turn_tokens),
        "--summary-tokens", str(compaction.max_summary_tokens),
        "--max-summaries", str(compaction.max_compactions),
        "--max-steps", str(environment.max_steps), stdout=asyncio.subprocess.PIPE)
    try:
        output, _ = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await endpoint.close()
    if process.returncode != 0:
        raise RuntimeError(f"the harness exited with {process.returncode}")
    results = [json.loads(line) for line in output.decode().splitlines()]
    summaries = sum(result["summaries"] for result in results)
    return host.last_close - host.first_open, list(host.requests.values()), summaries


async def measure(engine: Engine, config: ActorConfig, args: argparse.Namespace,
                  endpoint_first: bool) -> dict:
    """One run: both paths, each against raw vLLM on its own requests."""
    async def own_loop() -> tuple[float, list, float]:
        seconds, requests, _ = await agent_loop(engine, args.episodes, args.concurrency)
        return seconds, requests, await raw_replay(engine, requests, args.concurrency)

    async def endpoint() -> tuple[float, list, float, int]:
        seconds, requests, summaries = await harness_episodes(engine, config, args.episodes,
                                                              args.concurrency)
        return seconds, requests, await raw_replay(engine, requests, args.concurrency), summaries

    if endpoint_first:
        endpoint_s, endpoint_requests, endpoint_raw_s, summaries = await endpoint()
        own_s, own_requests, own_raw_s = await own_loop()
    else:
        own_s, own_requests, own_raw_s = await own_loop()
        endpoint_s, endpoint_requests, endpoint_raw_s, summaries = await endpoint()
    own_tokens = sum(n for requests in own_requests for _, n in requests)
    endpoint_tokens = sum(n for requests in endpoint_requests for _, n in requests)
    own_ratio, endpoint_ratio = own_raw_s / own_s, endpoint_raw_s / endpoint_s
    return {
        "episodes": args.episodes, "concurrency": args.concurrency,
        "own_loop_tokens": own_tokens, "endpoint_tokens": endpoint_tokens,
        "endpoint_requests": sum(len(r) for r in endpoint_requests),
        "endpoint_summaries": summaries,
        "own_loop_tokens_per_s": round(own_tokens / own_s, 1),
        "endpoint_tokens_per_s": round(endpoint_tokens / endpoint_s, 1),
        "own_loop_vs_raw_vllm": round(own_ratio, 3),
        "endpoint_vs_raw_vllm": round(endpoint_ratio, 3),
        "endpoint_vs_own_loop": round(endpoint_ratio / own_ratio, 3),
    }


async def main(args: argparse.Namespace) -> dict:
    async with warm_tiny_engine(args.concurrency, not args.quick) as (engine, config):
        runs = [await measure(engine, config, args, endpoint_first=bool(n % 2))
                for n in range(max(1, args.repeats))]
    ranked = sorted(runs, key=lambda run: run["endpoint_vs_own_loop"])
    return {**ranked[(len(ranked) - 1) // 2], "repeats": len(runs),
            "runs_endpoint_vs_own_loop": [run["endpoint_vs_own_loop"] for run in runs]}


if __name__ == "__main__":
    arguments = episode_arguments(__doc__.splitlines()[0], repeatable=True)
    quiet_vllm_logging()
    report = asyncio.run(main(arguments))
    print(f"endpoint {report['endpoint_tokens_per_s']} tokens/s ({report['endpoint_vs_raw_vllm']}"
          f" of raw vLLM on its requests), own loop {report['own_loop_tokens_per_s']} tokens/s "
          f"({report['own_loop_vs_raw_vllm']}): endpoint vs own loop "
          f"{report['endpoint_vs_own_loop']} (median of {report['repeats']}: "
          f"{report['runs_endpoint_vs_own_loop']})")
    if arguments.json:
        print(json.dumps(report))
