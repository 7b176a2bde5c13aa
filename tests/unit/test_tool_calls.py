"""Tool calls (actors/tools.py) parsed by vLLM's real tool parsers, and the
agent loop with a task that declares tools: calls reach the environment,
bad calls become observations counted by reason, summaries are never parsed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import ClosedSegment, Generation
from actors.envs.base import StepResult, Task, ToolCall
from actors.envs.shell import TOOLS
from actors.episode import EpisodeResult, run_episode
from actors.metrics import ActorMetrics
from actors.tools import ToolCallParser


@pytest.fixture(scope="module")
def llama_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})
    return tokenizer


def hermes(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.mark.parametrize("text, calls, reason", [
    (hermes("bash", {"command": "ls -la"}), [ToolCall("bash", {"command": "ls -la"})], None),
    ("let me look\n" + hermes("bash", {"command": "pwd"}) + hermes("submit", {}),
     [ToolCall("bash", {"command": "pwd"}), ToolCall("submit", {})], None),
    ("I am still thinking", [], None),
    ("<tool_call>{not json}</tool_call>", [], "malformed"),
    ("<tool_call>\n{\"name\": \"bash\"", [], "malformed"),
    (hermes("rm_everything", {}), [], "unknown_tool"),
    (hermes("bash", {}), [], "invalid_arguments"),
    (hermes("bash", {"command": 7}), [], "invalid_arguments"),
    (hermes("submit", {"now": True}), [], "invalid_arguments"),
], ids=["one", "two", "text", "not-json", "unclosed", "unknown", "missing", "wrong-type",
        "extra"])
def test_hermes_calls_are_taken_or_refused_with_a_reason(
        tokenizer, text: str, calls: list[ToolCall], reason: str | None) -> None:
    parsed = ToolCallParser("hermes", tokenizer).parse(text, TOOLS)
    assert (parsed.calls, parsed.reason) == (calls, reason)
    assert (parsed.error is None) == (reason is None)


def test_llama3_json_calls_parse_with_their_own_parser(llama_tokenizer) -> None:
    parser = ToolCallParser("llama3_json", llama_tokenizer)
    call = '<|python_tag|>{"name": "bash", "parameters": {"command": "ls"}}'
    assert parser.parse(call, TOOLS).calls == [ToolCall("bash", {"command": "ls"})]
    assert parser.parse('<|python_tag|>{"name": "bash", ', TOOLS).reason == "malformed"
    assert parser.parse("no call here", TOOLS).calls == []


def test_an_unknown_parser_or_a_tokenizer_it_cannot_use_is_refused(tokenizer) -> None:
    with pytest.raises(ValueError, match="not a vLLM tool parser.*hermes"):
        ToolCallParser("no-such-parser", tokenizer).check()
    with pytest.raises(RuntimeError, match="python_tag"):
        ToolCallParser("llama3_json", tokenizer).check()


class ScriptedPolicy:
    """Says the next text of its script every turn (summaries included)."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turns = [tokenizer.encode(text, add_special_tokens=False) + [end]
                      for text in texts]
        self.n = 0

    async def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                       temperature: float | None = None) -> Generation:
        ids = self.turns[self.n % len(self.turns)][:max_tokens]
        self.n += 1
        return Generation(ids, [-0.1] * len(ids), [3] * len(ids))


class ToolUser:
    """A task with the shell's tools; records what reaches it."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.texts: list[str] = []

    async def reset(self, seed: int) -> Task:
        return Task("tools", "Use the tools.", "list the files", tools=TOOLS)

    async def step(self, action: str) -> StepResult:
        self.texts.append(action)
        return StepResult("no tool call")

    async def call_tool(self, call: ToolCall) -> StepResult:
        self.calls.append(call)
        if call.name == "submit":
            return StepResult("submitted", done=True, reward=1.0, success=True)
        return StepResult(f"ran {call.arguments['command']}")

    async def close(self) -> None:
        return None


def play(tokenizer, environment: ToolUser, texts: list[str], **compaction: int
         ) -> tuple[list[ClosedSegment], EpisodeResult]:
    config = ActorConfig()
    for name, value in compaction.items():
        setattr(config.compaction, name, value)
    chat = ChatFormat(tokenizer, config.compaction, config.environment)
    emitted: list[ClosedSegment] = []

    async def emit(task_id: str, segment: ClosedSegment, result: EpisodeResult | None) -> None:
        emitted.append(segment)

    result = asyncio.run(run_episode(ScriptedPolicy(tokenizer, texts), environment, chat, config,
                                     seed=1, emit=emit))
    return emitted, result


def test_calls_reach_the_environment_and_bad_ones_are_answered_and_counted(tokenizer) -> None:
    environment = ToolUser()
    texts = [hermes("bash", {"command": "ls"}), "<tool_call>{oops</tool_call>",
             hermes("cat", {"file": "x"}), "thinking aloud", hermes("submit", {})]
    emitted, result = play(tokenizer, environment, texts)
    assert environment.calls == [ToolCall("bash", {"command": "ls"}), ToolCall("submit", {})]
    assert environment.texts == ["thinking aloud"]
    assert result.stats.outcome == "done" and result.reward == 1.0
    assert result.tool_call_errors == {"malformed": 1, "unknown_tool": 1}
    context = tokenizer.decode(emitted[-1].tokens)
    assert "tool call error: the tool call could not be parsed" in context
    assert "there is no tool 'cat'" in context
    metrics = ActorMetrics()
    metrics.episode_finished(result.reward, result.stats, result.observations_cut,
                             result.tool_call_errors)
    assert metrics.registry.get_sample_value("crl_actor_tool_call_errors_total",
                                             {"reason": "malformed"}) == 1


def test_a_summary_is_never_parsed_as_a_tool_call(tokenizer) -> None:
    """Every turn, summaries included, is a bash call: only the actions run."""
    environment = ToolUser()
    emitted, result = play(tokenizer, environment, [hermes("bash", {"command": "ls"})],
                           context_tokens=700, reserve_tokens=300, max_summary_tokens=60)
    assert result.stats.compactions >= 1
    assert len(environment.calls) == result.stats.steps
    summaries = [segment for segment in emitted if segment.segment_type == "summary"]
    assert len(summaries) == result.stats.compactions
