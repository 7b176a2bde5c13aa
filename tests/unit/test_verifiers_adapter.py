"""A verifiers 0.4.0 taskset (tests/unit/environments/crl_calc.py, written
against verifiers' public API) run as a CompactionRL environment, with the
real package: its tools, its stop rule, its rubric as the reward, and its
tasks split into training and evaluation."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import Generation, SegmentData
from actors.envs.adapters.verifiers import VerifiersTaskset
from actors.envs.base import EVALUATION_SEEDS_FROM, ToolCall
from actors.episode import EpisodeResult, run_episode

ENVIRONMENTS = Path(__file__).parent / "environments"


@pytest.fixture
def taskset(monkeypatch: pytest.MonkeyPatch) -> VerifiersTaskset:
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    # every task trains: three tasks are too few for a hashed evaluation split
    return VerifiersTaskset("crl_calc", eval_fraction=0.0)


def test_a_task_runs_its_tool_and_its_rubric_scores_the_answer(taskset) -> None:
    async def episode(answer: str):
        task = await taskset.reset(0)
        assert task.system == "You are a calculator agent." and "2+3" in task.instruction
        [schema] = task.tools
        assert schema["function"]["name"] == "calc_add"
        assert schema["function"]["parameters"]["required"] == ["a", "b"]
        observed = await taskset.call_tool(ToolCall("calc_add", {"a": 2, "b": 3}))
        assert (observed.observation, observed.done) == ("5", False)
        return await taskset.step(answer)

    right, wrong = asyncio.run(episode("5")), asyncio.run(episode("6"))
    assert right.done and right.reward == 1.0 and right.success
    assert right.info["metrics"] == {"tool_calls": 1.0}
    assert wrong.done and wrong.reward == 0.0 and not wrong.success


def test_the_turn_limit_ends_an_episode_and_the_rubric_still_scores_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    taskset = VerifiersTaskset("crl_calc", max_turns=2, eval_fraction=0.0)

    async def episode():
        await taskset.reset(1)
        first = await taskset.call_tool(ToolCall("calc_add", {"a": 10, "b": 32}))
        second = await taskset.call_tool(ToolCall("calc_add", {"a": 1, "b": 1}))
        return first, second

    first, second = asyncio.run(episode())
    assert not first.done and second.done and second.reward == 0.0


def test_evaluation_seeds_draw_only_held_out_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    # the ids' hashes fall at 0.61, 0.73 and 0.87 of the range: 0.7 holds out one
    taskset = VerifiersTaskset("crl_calc", eval_fraction=0.7)
    held_out = {task.key for task in taskset.tasks["eval"]}
    trained = {task.key for task in taskset.tasks["train"]}
    assert held_out and trained and not held_out & trained

    async def drawn(seeds: range) -> set[str]:
        return {(await taskset.reset(seed)).task_id.removeprefix("crl_calc-") for seed in seeds}

    assert asyncio.run(drawn(range(EVALUATION_SEEDS_FROM, EVALUATION_SEEDS_FROM + 6))) == {
        str(key) for key in held_out}


class ScriptedPolicy:
    """Says its script's turns in order, then the last one again."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turns = [tokenizer.encode(t, add_special_tokens=False) + [end] for t in texts]
        self.n = 0

    async def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                       temperature: float | None = None) -> Generation:
        ids = self.turns[min(self.n, len(self.turns) - 1)][:max_tokens]
        self.n += 1
        return Generation(ids, [-0.2] * len(ids), [0] * len(ids))


def test_the_agent_loop_plays_a_verifiers_task_to_its_reward(taskset, tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = ActorConfig()
    chat = ChatFormat(tokenizer, config.compaction, config.environment)
    call = json.dumps({"name": "calc_add", "arguments": {"a": 2, "b": 3}})
    policy = ScriptedPolicy(tokenizer, [f"<tool_call>\n{call}\n</tool_call>", "5"])
    segments: list[SegmentData] = []

    async def emit(task_id: str, segment: SegmentData, result: EpisodeResult | None) -> None:
        segments.append(segment)

    result = asyncio.run(run_episode(policy, taskset, chat, config, seed=0, emit=emit))
    assert result.stats.outcome == "done" and result.reward == 1.0 and result.stats.success
    assert result.stats.steps == 2 and result.stats.tags == {"taskset": "crl_calc"}
    assert "5" in tokenizer.decode(segments[-1].tokens)
