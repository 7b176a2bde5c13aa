"""A keyvault episode on the real vLLM CPU engine with the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import ClosedSegment
from actors.envs.base import load_environment
from actors.episode import EpisodeResult, run_episode
from deploy.config import load_config
from deploy.model_check import BF16_LOGPROB_TOLERANCE, reference_logprobs

pytestmark = pytest.mark.slow

#: A small window so that the random tiny model compacts several times.
SMALL_WINDOW = ["--actors.compaction.context_tokens", "512", "--actors.compaction.reserve_tokens",
                "200", "--actors.compaction.max_summary_tokens", "64",
                "--actors.sampling.max_turn_tokens", "32", "--actors.environment.max_steps", "40"]


def _config() -> ActorConfig:
    return load_config(None, SMALL_WINDOW).actors


def _episode(engine, loop, seed: int, greedy: bool = False
             ) -> tuple[list[tuple[ClosedSegment, EpisodeResult | None]], EpisodeResult]:
    config = _config()
    chat = ChatFormat(engine.tokenizer, config.compaction, config.environment)
    environment = load_environment(config.environment.factory, config.environment.options)
    emitted: list[tuple[ClosedSegment, EpisodeResult | None]] = []

    async def emit(task_id: str, segment: ClosedSegment, result: EpisodeResult | None
                   ) -> None:
        emitted.append((segment, result))

    result = loop.run(run_episode(engine, environment, chat, config, seed, emit, greedy=greedy))
    return emitted, result


@pytest.fixture(scope="module")
def sampled_episode(actor_engine, engine_loop):
    return _episode(actor_engine, engine_loop, seed=7)


def test_episode_compacts_and_emits_segments_in_order(sampled_episode) -> None:
    emitted, result = sampled_episode
    assert result.stats.compactions >= 2
    kinds = [segment.segment_type for segment, _ in emitted]
    assert kinds == ["execution", "summary"] * result.stats.compactions + ["execution"]
    assert [r is not None for _, r in emitted] == [False] * (len(emitted) - 1) + [True]
    assert all(len(s.tokens) <= 512 for s, _ in emitted)
    assert sum(s.num_trainable for s, _ in emitted) == result.stats.generated_tokens


def test_behaviour_logprobs_match_transformers(sampled_episode, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    emitted, _ = sampled_episode
    worst = 0.0
    for segment, _ in emitted:
        # teacher-forced over the whole segment: each token given all before it
        chosen, _ = reference_logprobs(reference, segment.tokens[:1], segment.tokens[1:],
                                       temperature=1.0)
        mask = torch.tensor(segment.loss_mask[1:], dtype=torch.bool)
        behaviour = torch.tensor(segment.logprobs[1:])
        worst = max(worst, (chosen[mask] - behaviour[mask]).abs().max().item())
    assert worst <= BF16_LOGPROB_TOLERANCE


def test_greedy_episode_is_reproducible_from_its_seed(actor_engine, engine_loop) -> None:
    first, result = _episode(actor_engine, engine_loop, seed=11, greedy=True)
    second, _ = _episode(actor_engine, engine_loop, seed=11, greedy=True)
    assert [s.tokens for s, _ in first] == [s.tokens for s, _ in second]
    assert result.stats.steps > 0


def test_the_engine_s_kv_cache_is_what_its_cpu_space_holds_of_the_model(
        actor_engine, tiny_model_dir: Path) -> None:
    """The tokens the actor checks its episodes against (``Engine.kv_tokens``)
    are the KV space the engine was given over one token's K and V in every
    layer, within a block (vLLM allocates whole blocks)."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = (config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
                 * 2 * 2)  # K and V, bfloat16
    space = actor_engine.config.cpu_kv_cache_gib * 2**30
    block = actor_engine._llm.vllm_config.cache_config.block_size
    assert space // per_token - block <= actor_engine.kv_tokens() <= space // per_token
