"""The agent loop with a scripted policy: outcomes, cut observations, bad input."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.chat import ChatFormat
from actors.config import ActorConfig, CompactionConfig
from actors.context import ClosedSegment
from actors.engine import Engine
from actors.envs.base import EnvironmentLoadError, StepResult, Task, load_environment
from actors.envs.keyvault import KeyVault
from actors.episode import EpisodeResult, run_episode
from tests.scripted_policy import ScriptedPolicy


class HugeObservations:
    """Answers every action with a wall of text."""

    async def reset(self, seed: int) -> Task:
        return Task("huge", "system", "read everything")

    async def step(self, action: str) -> StepResult:
        return StepResult("word " * 50_000)

    async def close(self) -> None:
        return None


class Broken(HugeObservations):
    async def step(self, action: str) -> StepResult:
        raise RuntimeError("disk on fire")


def play(tokenizer, environment, text: str, config: ActorConfig | None = None
         ) -> tuple[list[tuple[ClosedSegment, EpisodeResult | None]], EpisodeResult]:
    config = config or ActorConfig()
    chat = ChatFormat(tokenizer, config.compaction, config.environment)
    emitted: list[tuple[ClosedSegment, EpisodeResult | None]] = []

    async def emit(task_id: str, segment: ClosedSegment, result: EpisodeResult | None
                   ) -> None:
        emitted.append((segment, result))

    result = asyncio.run(run_episode(ScriptedPolicy(tokenizer, text), environment, chat, config,
                                     seed=1, emit=emit))
    return emitted, result


def test_walking_every_room_compacts_and_ends_at_the_answer_prompt(tokenizer) -> None:
    emitted, result = play(tokenizer, KeyVault(), "next")
    assert result.stats.compactions >= 1
    assert result.stats.outcome in ("step_limit", "compaction_limit")
    assert emitted[-1][1] is result
    versions = {v for s, _ in emitted for v, m in zip(s.versions, s.loss_mask, strict=True) if m}
    assert versions == {3}


def test_an_unparseable_action_is_an_observation(tokenizer) -> None:
    emitted, result = play(tokenizer, KeyVault(), "dance wildly")
    assert result.stats.outcome != "error" and result.stats.steps > 1
    assert "unknown command" in tokenizer.decode(emitted[0][0].tokens)


def test_observation_larger_than_the_context_is_cut(tokenizer) -> None:
    emitted, result = play(tokenizer, HugeObservations(), "next")
    assert result.observations_cut == result.stats.steps
    assert all(len(s.tokens) <= ActorConfig().compaction.context_tokens for s, _ in emitted)
    assert "[observation cut]" in tokenizer.decode(emitted[0][0].tokens)


def test_without_compaction_the_episode_ends_when_the_window_is_full(tokenizer) -> None:
    config = ActorConfig(compaction=CompactionConfig(enabled=False))
    emitted, result = play(tokenizer, HugeObservations(), "next", config)
    assert result.stats.outcome == "context_full" and result.stats.compactions == 0
    assert len(emitted) == 1


def test_an_environment_failure_ends_the_episode_not_the_actor(tokenizer) -> None:
    emitted, result = play(tokenizer, Broken(), "next")
    assert result.stats.outcome == "error" and result.reward == 0.0
    assert emitted[-1][1] is result


def test_environment_import_failures_are_clear() -> None:
    with pytest.raises(EnvironmentLoadError, match="cannot import"):
        load_environment("no.such.module:Env", {})
    with pytest.raises(EnvironmentLoadError, match="has no attribute"):
        load_environment("actors.envs.keyvault:Nope", {})
    with pytest.raises(EnvironmentLoadError, match="failed"):
        load_environment("actors.envs.keyvault:KeyVault", {"colour": "red"})
    with pytest.raises(EnvironmentLoadError, match="expected 'module:Name'"):
        load_environment("keyvault", {})


def test_missing_model_folder_is_a_clear_error(tmp_path: Path) -> None:
    config = ActorConfig()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        asyncio.run(Engine.start(str(tmp_path / "nothing"), config.engine, config.sampling))


@pytest.mark.parametrize("override, message", [
    (["--run.model", "/nonexistent/model"], "no config.json"),
    (["--actors.environment.factory", "no.such:Env"], "cannot import"),
])
def test_actor_command_fails_with_one_clear_line(override: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from deploy.cli import main

    assert main(["actor", "--actors.metrics_port", "0", *override]) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
