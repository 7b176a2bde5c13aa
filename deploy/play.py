"""``compactionrl play``: one episode on the actors' engine, shown segment by
segment, with its reward's parts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import ClosedSegment
from actors.engine import Engine, quiet_vllm_logging
from actors.envs.base import load_environment
from actors.episode import EpisodeResult, run_episode
from actors.preflight import check_episode_setup

#: Characters of each segment's decoded tail shown in the transcript (without --full).
TAIL_CHARS = 400


def segment_entry(chat: ChatFormat, segment: ClosedSegment) -> dict[str, Any]:
    """What ``play`` shows of a segment: its type, sizes, its step rewards
    (shaping, on the actions' last tokens) and its whole text, special
    tokens included (the framing the model sees)."""
    return {"type": segment.segment_type, "tokens": len(segment.tokens),
            "trainable": segment.num_trainable, "step_rewards": sum(segment.rewards),
            "text": chat.decode(segment.tokens, keep_special=True)}


def segment_transcript(index: int, entry: dict[str, Any], full: bool) -> str:
    """A segment as ``play`` prints it: a heading, then its whole text
    (``full``) or its last :data:`TAIL_CHARS` characters."""
    text = entry["text"] if full else entry["text"][-TAIL_CHARS:]
    return (f"--- segment {index}: {entry['type']}, {entry['tokens']} tokens, "
            f"{entry['trainable']} trainable{'' if full else '; ends with'}:\n{text}")


def reward_parts(result: EpisodeResult, segments: list[dict[str, Any]]) -> dict[str, Any]:
    """The episode's reward and what it is made of: the final reward the
    environment gave when the task ended, the step rewards summed over the
    episode, and the final step's ``info`` (the parts where the environment
    gives them)."""
    return {"final": result.reward, "step_rewards": sum(s["step_rewards"] for s in segments),
            "success": result.stats.success, "info": result.info}


async def _play(model: str, config: ActorConfig, seed: int, greedy: bool, as_json: bool,
                full: bool) -> EpisodeResult:
    await check_episode_setup(model, config, seed)  # before the engine's slow start
    engine = await Engine.start(model, config.engine, config.sampling)
    try:
        chat = ChatFormat(engine.tokenizer, config.compaction, config.environment)
        environment = load_environment(config.environment.factory, config.environment.options)
        shown: list[dict[str, Any]] = []

        async def show(task_id: str, segment: ClosedSegment, result: EpisodeResult | None
                       ) -> None:
            shown.append(segment_entry(chat, segment))
            if not as_json:
                print(segment_transcript(len(shown) - 1, shown[-1], full))

        try:
            result = await run_episode(engine, environment, chat, config, seed, show,
                                       greedy=greedy)
        finally:
            await environment.close()
    finally:
        await engine.shutdown()
    stats, parts = result.stats, reward_parts(result, shown)
    if as_json:
        print(json.dumps({"task_id": result.task_id, "reward": result.reward,
                          "reward_parts": parts, **msgspec.structs.asdict(stats),
                          "segments": shown}, default=str))
    else:
        print(f"=== {result.task_id}: {stats.outcome}, reward {result.reward}, {stats.steps} "
              f"steps, {stats.compactions} compactions, {stats.generated_tokens} generated "
              f"tokens ({stats.summary_tokens} in summaries)")
        print(f"=== reward parts: final {parts['final']}, step rewards "
              f"{parts['step_rewards']:g}, success {parts['success']}, "
              f"info {json.dumps(parts['info'], default=str)}")
    return result


def play(model: str, config: ActorConfig, seed: int, greedy: bool, as_json: bool,
         full: bool = False) -> int:
    quiet_vllm_logging()
    asyncio.run(_play(model, config, seed, greedy, as_json, full))
    return 0
