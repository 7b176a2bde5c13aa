"""``compactionrl play``: one episode on the actors' engine, shown segment by segment."""

from __future__ import annotations

import asyncio
import json

import msgspec

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import SegmentData
from actors.engine import Engine, quiet_vllm_logging
from actors.envs.base import load_environment
from actors.episode import EpisodeResult, run_episode
from actors.preflight import check_episode_setup

#: Characters of each segment's decoded tail shown in the transcript.
TAIL_CHARS = 400


async def _play(model: str, config: ActorConfig, seed: int, greedy: bool, as_json: bool
                ) -> EpisodeResult:
    await check_episode_setup(model, config)  # before the engine's slow start
    engine = await Engine.start(model, config.engine, config.sampling)
    try:
        chat = ChatFormat(engine.tokenizer, config.compaction, config.environment)
        environment = load_environment(config.environment.factory, config.environment.options)
        shown: list[dict] = []

        async def show(task_id: str, segment: SegmentData, result: EpisodeResult | None
                       ) -> None:
            entry = {"type": segment.segment_type, "tokens": len(segment.tokens),
                     "trainable": segment.num_trainable}
            shown.append(entry)
            if not as_json:
                tail = chat.tokenizer.decode(segment.tokens)[-TAIL_CHARS:]
                print(f"--- segment {len(shown) - 1}: {segment.segment_type}, "
                      f"{entry['tokens']} tokens, {entry['trainable']} trainable; ends with:")
                print(tail)

        try:
            result = await run_episode(engine, environment, chat, config, seed, show,
                                       greedy=greedy)
        finally:
            await environment.close()
    finally:
        await engine.shutdown()
    stats = result.stats
    if as_json:
        print(json.dumps({"task_id": result.task_id, "reward": result.reward,
                          **msgspec.structs.asdict(stats), "segments": shown}))
    else:
        print(f"=== {result.task_id}: {stats.outcome}, reward {result.reward}, {stats.steps} "
              f"steps, {stats.compactions} compactions, {stats.generated_tokens} generated "
              f"tokens ({stats.summary_tokens} in summaries)")
    return result


def play(model: str, config: ActorConfig, seed: int, greedy: bool, as_json: bool) -> int:
    quiet_vllm_logging()
    asyncio.run(_play(model, config, seed, greedy, as_json))
    return 0
