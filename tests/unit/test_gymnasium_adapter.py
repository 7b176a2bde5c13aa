"""A Gymnasium 1.4 text environment (tests/unit/environments/crl_gym_text.py,
written against Gymnasium's public API) run as a CompactionRL environment
with the real package."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from actors.envs.adapters.gymnasium import GymnasiumText
from actors.envs.base import load_environment
from deploy.config import load_config
from tests.guides import guide_block

ENVIRONMENTS = Path(__file__).parent / "environments"


@pytest.fixture
def environment(monkeypatch: pytest.MonkeyPatch) -> GymnasiumText:
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    return GymnasiumText("crl_gym_text:HigherLower", system="Play the game.",
                         kwargs={"high": 16}, max_episode_steps=8)


def bisect(environment: GymnasiumText, seed: int) -> list:
    """Play by bisection, as a policy would."""
    async def play() -> list:
        task = await environment.reset(seed)
        assert task.system == "Play the game." and "between 1 and 16" in task.instruction
        assert task.tags == {"family": "bisection"}
        low, high, results = 1, 16, []
        while True:
            guess = (low + high) // 2
            result = await environment.step(f"I guess {guess}")
            results.append(result)
            if result.done:
                return results
            low, high = (guess + 1, high) if result.observation == "higher" else (low, guess - 1)
    return asyncio.run(play())


def test_the_return_is_the_reward_and_the_environment_says_success(environment) -> None:
    results = bisect(environment, seed=3)
    final = results[-1]
    assert final.done and final.success and final.observation == "correct"
    assert final.reward == pytest.approx(1.0 - 0.05 * (len(results) - 1))
    assert all(r.reward == 0.0 and not r.done for r in results[:-1])


def test_truncation_ends_the_episode_without_success(environment) -> None:
    async def stubborn() -> list:
        await environment.reset(5)
        return [await environment.step("nothing") for _ in range(8)]

    results = asyncio.run(stubborn())
    assert [r.done for r in results] == [False] * 7 + [True]
    assert not results[-1].success and results[-1].reward == 0.0


def test_an_environment_without_text_spaces_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="observation_space is Box, not Text"):
        GymnasiumText("CartPole-v1")


def test_an_id_the_user_s_module_registers_is_found_by_the_module_s_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a fresh actor process (the module not imported, its id not
    registered): the guide's table, layered over the default by one --config
    file, names the module that registers the id, Gymnasium's own form."""
    import gymnasium

    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    monkeypatch.delitem(sys.modules, "crl_gym_text", raising=False)
    monkeypatch.delitem(gymnasium.registry, "CrlHigherLower-v0", raising=False)
    mine = tmp_path / "mine.toml"
    mine.write_text(guide_block("docs/environments.md", "### Gymnasium text environments",
                                "toml"))
    environment = load_config([mine]).actors.environment
    loaded = load_environment(environment.factory, environment.options)
    assert isinstance(loaded, GymnasiumText)
    assert bisect(loaded, seed=3)[-1].success


def test_an_id_registered_nowhere_names_the_form_that_imports_its_module(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gymnasium

    monkeypatch.delitem(gymnasium.registry, "CrlHigherLower-v0", raising=False)
    with pytest.raises(ValueError, match="name the module that registers it, as "
                       "'module:CrlHigherLower-v0'"):
        GymnasiumText("CrlHigherLower-v0")
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    with pytest.raises(ValueError, match="neither registers the id 'Nothing-v0' nor has"):
        GymnasiumText("crl_gym_text:Nothing-v0")
