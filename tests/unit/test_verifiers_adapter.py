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
from actors.context import ClosedSegment, Generation
from actors.envs.adapters.verifiers import VerifiersTaskset
from actors.envs.base import EVALUATION_SEEDS_FROM, EnvironmentLoadError, ToolCall, load_environment
from actors.episode import EpisodeResult, run_episode
from deploy.cli import main
from deploy.config import load_config
from tests.guides import guide_block

ENVIRONMENTS = Path(__file__).parent / "environments"
GUIDE, SECTION = "docs/environments.md", "### Bring a verifiers environment"


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
    segments: list[ClosedSegment] = []

    async def emit(task_id: str, segment: ClosedSegment, result: EpisodeResult | None) -> None:
        segments.append(segment)

    result = asyncio.run(run_episode(policy, taskset, chat, config, seed=0, emit=emit))
    assert result.stats.outcome == "done" and result.reward == 1.0 and result.stats.success
    assert result.stats.steps == 2 and result.stats.tags == {"taskset": "crl_calc"}
    assert "5" in tokenizer.decode(segments[-1].tokens)


def test_the_guide_shows_the_taskset_module_the_suite_runs() -> None:
    assert guide_block(GUIDE, SECTION, "python") == (ENVIRONMENTS / "crl_calc.py").read_text()


def test_the_guide_s_configuration_reaches_the_taskset_s_nested_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The guide's table, layered over the default by one --config file, as
    the command line reads it: the adapter's own options and the taskset's
    (a field, and a table for its task config) each arrive."""
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    mine = tmp_path / "mine.toml"
    mine.write_text(guide_block(GUIDE, SECTION, "toml"))
    config = load_config([mine])
    assert config.actors.compaction.context_tokens == load_config().actors.compaction.context_tokens
    environment = config.actors.environment
    taskset = load_environment(environment.factory, environment.options)
    assert isinstance(taskset, VerifiersTaskset) and taskset.max_turns == 16
    assert len(taskset.tasks["train"]) + len(taskset.tasks["eval"]) == 6  # repeats = 2
    assert taskset.tasks["eval"] and taskset.tasks["train"]  # eval_fraction = 0.5

    async def lenient_reward() -> float:
        await taskset.reset(0)
        return (await taskset.step("the sum is 5")).reward

    assert asyncio.run(lenient_reward()) == 1.0  # task = { strict = false }
    # what `config show` prints reads back to the same nested options
    assert main(["config", "show", "--config", str(mine)]) == 0
    shown = tmp_path / "shown.toml"
    shown.write_text(capsys.readouterr().out)
    assert load_config([shown]).actors.environment.options == environment.options
    # a nested override on the command line reaches the same table
    strict = load_config([mine], ["--actors.environment.options.task.strict", "true"])
    assert strict.actors.environment.options["task"] == {"strict": True}


def test_a_taskset_config_verifiers_refuses_is_one_line_naming_the_field(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    with pytest.raises(EnvironmentLoadError) as raised:
        load_environment("actors.envs.adapters.verifiers:VerifiersTaskset",
                         {"taskset": "crl_calc", "repeats": "twice"})
    assert "\n" not in str(raised.value) and "repeats" in str(raised.value)


def test_a_taskset_too_small_to_hold_out_a_task_says_its_split_and_the_option(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    taskset = VerifiersTaskset("crl_calc")  # three tasks at the default eval_fraction = 0.1
    with pytest.raises(ValueError, match=r"no evaluation tasks \(3 training and 0 evaluation "
                       r"tasks by the hash split at eval_fraction = 0.1\): raise "
                       r"options.eval_fraction"):
        asyncio.run(taskset.reset(EVALUATION_SEEDS_FROM))


def test_eval_of_a_taskset_with_no_held_out_task_is_refused_before_an_engine(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """As typed: ``compactionrl eval`` on three tasks at the default split
    says the split's sizes and the option to raise, in one line, at once."""
    monkeypatch.syspath_prepend(str(ENVIRONMENTS))
    mine = tmp_path / "mine.toml"
    mine.write_text('[actors.environment]\nfactory = '
                    '"actors.envs.adapters.verifiers:VerifiersTaskset"\n'
                    'options = { taskset = "crl_calc" }\n')
    assert main(["eval", "--model", str(tiny_model_dir), "--episodes", "1",
                 "--config", str(mine)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("compactionrl: ") and "no evaluation tasks (3 training and 0 " \
        "evaluation tasks by the hash split at eval_fraction = 0.1): raise " \
        "options.eval_fraction" in line, line
