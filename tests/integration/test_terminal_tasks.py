"""A long terminal task played to its reward through the real agent loop by
a scripted policy (the tiny model cannot solve it): its reference solution,
one bash tool call per line, then submit. The window holds a few steps, so
the episode compacts; the task's test script decides the reward; the
sandbox leaves no process and the work folder is removed."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import ClosedSegment, Generation
from actors.envs.sandbox import NOBODY
from actors.envs.shell import BUILTIN_TASKS, Shell
from actors.episode import EpisodeResult, run_episode

WORK_ROOT = str(Path("/var/tmp") / f"crl-terminal-{os.getpid()}")
TASK = "sum-ledgers"


class ScriptedAgent:
    """Acts the task's solution, one line per turn, then submits; answers a
    summary request with a fixed summary."""

    def __init__(self, chat: ChatFormat, commands: list[str]) -> None:
        self.chat = chat
        calls = [{"name": "bash", "arguments": {"command": c}} for c in commands]
        calls.append({"name": "submit", "arguments": {}})
        self.actions = iter(f"<tool_call>\n{json.dumps(call)}\n</tool_call>" for call in calls)
        self.summaries = 0

    async def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                       temperature: float | None = None) -> Generation:
        request = self.chat.summary_request + self.chat.assistant_header
        if prompt[-len(request):] == request:
            self.summaries += 1
            text = "summary : ledgers read so far , keep going"
        else:
            text = next(self.actions)
        ids = self.chat.tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
        ids += self.chat.assistant_end
        return Generation(ids, [-0.3] * len(ids), [0] * len(ids))


# Exclusive: its last check is machine-wide (no process of the sandbox's user
# is left anywhere), which another worker's sandboxed episodes would fail: a
# fresh-clone run found 32 such processes of a concurrent test.
@pytest.mark.exclusive
def test_a_long_terminal_task_compacts_and_its_test_decides_the_reward(
        tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    config = ActorConfig()
    compaction = config.compaction
    compaction.context_tokens, compaction.reserve_tokens = 1000, 500
    compaction.max_summary_tokens, compaction.max_compactions = 40, 20
    config.sampling.max_turn_tokens = 200
    config.environment.observation_max_tokens = 120
    chat = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir), compaction,
                      config.environment)
    commands = (BUILTIN_TASKS / TASK / "solution.sh").read_text().splitlines()
    shell = Shell(work_root=WORK_ROOT)
    seed = [task.name for task in shell.tasks].index(TASK)
    agent = ScriptedAgent(chat, commands)
    segments: list[ClosedSegment] = []

    async def emit(task_id: str, segment: ClosedSegment, result: EpisodeResult | None) -> None:
        segments.append(segment)

    async def play() -> EpisodeResult:
        try:
            return await run_episode(agent, shell, chat, config, seed, emit)
        finally:
            await shell.close()

    result = asyncio.run(play())
    assert result.stats.outcome == "done" and result.reward == 1.0 and result.stats.success
    assert result.stats.steps == len(commands) + 1
    assert result.stats.compactions >= 2 and agent.summaries == result.stats.compactions
    assert result.stats.tags == {"family": "aggregate", "difficulty": "long"}
    assert [s.segment_type for s in segments].count("summary") == result.stats.compactions
    assert os.listdir(WORK_ROOT) == []  # the episode's folder went when it ended
    leftover = [pid for pid in os.listdir("/proc") if pid.isdigit()
                and _owner(pid) == NOBODY]
    assert leftover == [], "sandboxed processes outlived the episode"


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return None
