"""A newcomer's environment, template and context-budget mistakes are told
before any engine starts (actors/preflight.py), as one ``compactionrl:``
line and exit code 2, by the commands that would start one: ``play``,
``eval`` and ``up``. Each case is a ``--config`` file layered over the
default, as a user writes it; an engine start would show as vLLM's log and
as a traceback from the first episode instead."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from actors.envs.base import EVALUATION_SEEDS_FROM
from actors.preflight import check_episode_setup
from deploy.cli import main
from deploy.config import load_config
from tests.processes import VENV_BIN, run_command

ROOT = Path(__file__).parents[2]
QWEN3_TEMPLATE = ROOT / "tests" / "unit" / "chat_templates" / "qwen3.jinja"
#: A user's environment module whose tasks cannot be built.
BROKEN_ENVIRONMENT = '''
from actors.envs.base import Task


class NoTasks:
    def __init__(self, rows: str) -> None:
        self.rows = rows

    async def reset(self, seed: int) -> Task:
        raise FileNotFoundError(f"no task file {self.rows}")

    async def step(self, action: str):
        raise NotImplementedError

    async def close(self) -> None:
        pass
'''
#: A template in Gemma's shape: it refuses a system turn.
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _config(folder: Path, text: str) -> str:
    path = folder / "mine.toml"
    path.write_text(text)
    return str(path)


def _model_with_template(tiny_model_dir: Path, folder: Path, template: str) -> Path:
    model = folder / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(template)
    return model


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``argv`` is refused with."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("compactionrl: "), lines
    return lines[0]


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "my_tasks.py").write_text(BROKEN_ENVIRONMENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("command, seed", [
    (["play"], 0),
    (["eval", "--episodes", "1"], EVALUATION_SEEDS_FROM),  # the first held-out task
    (["up"], 0),
])
def test_an_environment_that_cannot_build_a_task_is_refused_before_an_engine(
        command: list[str], seed: int, user_module: Path, tiny_model_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(user_module, f"""
[run]
model = "{tiny_model_dir}"
out_dir = "{user_module / 'runs'}"

[actors.environment]
factory = "my_tasks:NoTasks"
options = {{ rows = "tasks.jsonl" }}
""")
    line = _refused([*command, "--config", config], capsys)
    assert (f"my_tasks:NoTasks: reset({seed}) failed: FileNotFoundError: no task file "
            "tasks.jsonl") in line


def test_options_the_factory_does_not_take_are_refused_before_an_engine(
        user_module: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(user_module, """
[actors.environment]
factory = "my_tasks:NoTasks"
options = { rows = "tasks.jsonl", repeats = 2 }
""")
    line = _refused(["play", "--model", str(tiny_model_dir), "--config", config], capsys)
    assert "unexpected keyword argument 'repeats'" in line


def test_a_template_that_refuses_a_system_turn_is_refused_before_an_engine(
        tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model_with_template(tiny_model_dir, tmp_path, NO_SYSTEM_TEMPLATE)
    line = _refused(["play", "--model", str(model)], capsys)
    assert f"the chat template of {model}: the template refuses a conversation" in line
    assert "System role not supported" in line


def test_a_reserve_too_small_for_the_template_is_refused_from_the_command_line(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """As typed, in a process of its own: Qwen3's framing needs more reserve
    than the default's 80 tokens; the fix is named and no engine starts."""
    model = tmp_path / "qwen3-tiny"
    shutil.copytree(tiny_model_dir, model)
    shutil.copy(QWEN3_TEMPLATE, model / "chat_template.jinja")  # the guide's cp
    played = run_command([str(VENV_BIN / "compactionrl"), "play", "--model", str(model)],
                         timeout=120)
    assert played.returncode == 2, played.stderr[-3000:]
    last = played.stderr.strip().splitlines()[-1]
    assert last.startswith("compactionrl: task ") and "raise it to at least" in last, last
    assert "Traceback" not in played.stderr
    assert "EngineCore" not in played.stderr and "LLM engine" not in played.stderr


#: A user's environment whose tasks declare a tool.
TOOL_ENVIRONMENT = '''
from actors.envs.base import StepResult, Task

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                   "required": ["word"]}}}]


class WithTools:
    async def reset(self, seed: int) -> Task:
        return Task(f"t{seed}", "Answer.", "Look up 'vault'.", tools=TOOLS)

    async def step(self, action: str) -> StepResult:
        return StepResult("ok", done=True)

    async def call_tool(self, call) -> StepResult:
        return StepResult("a safe")

    async def close(self) -> None:
        pass
'''


@pytest.mark.parametrize("template, noted", [(None, True), (QWEN3_TEMPLATE, False)])
def test_a_template_that_ignores_the_task_s_tools_is_noted_before_an_engine(
        template: Path | None, noted: bool, tmp_path: Path, tiny_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny model's ChatML template drops ``tools=``: the check says the
    model never sees the schemas; Qwen3's renders them, and nothing is said."""
    (tmp_path / "tool_tasks.py").write_text(TOOL_ENVIRONMENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = (tiny_model_dir if template is None
             else _model_with_template(tiny_model_dir, tmp_path, template.read_text()))
    # room for the schemas Qwen3 renders
    actors = load_config(None, ["--actors.environment.factory", "tool_tasks:WithTools",
                                "--actors.compaction.reserve_tokens", "120",
                                "--actors.compaction.context_tokens", "500"]).actors
    asyncio.run(check_episode_setup(str(model), actors))
    notes = capsys.readouterr().err.strip().splitlines()
    expected = [f"compactionrl: note: the chat template of {model} ignores the task's tools: "
                "the model never sees their schemas (describe them in the task's system "
                "prompt, or use a template that renders tools=; docs/environments.md, Tools)"]
    assert notes == (expected if noted else [])
