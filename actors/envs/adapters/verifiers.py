"""A verifiers taskset (``verifiers==0.4.0``, the environments of prime-rl) as
a CompactionRL environment.

verifiers 0.4.0 (``verifiers.v1``) runs a rollout through a harness program
that calls a model server; here the actor's own loop is the harness. Each
task of the taskset is one episode:

- the task's system prompt and prompt are the episode's system and task
  turns; its toolsets' tools (``@vf.tool`` methods, served in-process on an
  MCP server as verifiers serves them) are the task's tools, by the names the
  model sees (``<toolset>_<tool>``);
- each tool call runs on that server and its result is the observation; a
  turn without a call is the answer, which ends the episode, as the chat
  harness does; the task's ``@vf.stop`` hooks and its turn limit end it too;
- the episode's conversation is recorded in a verifiers ``Trace`` (turns as
  the model took them, before any compaction), and the task's own rubric
  scores it (``Task.score``: its ``@vf.reward`` functions, weighted): that is
  the reward. ``success`` is a reward of at least ``success_reward``.

What does not map (say so before training on it): tasks whose setup, tools
or rewards need a verifiers runtime (a sandbox: ``runtime`` hooks are
skipped by ``Task.score`` and setups that need one fail), harnesses with
their own agent loop (bash-in-sandbox, ACP agents), multi-agent and
user-simulation interactions. docs/environments.md says what to do instead.

Tasks are split into training and evaluation by a hash of their id, as task
rows are (actors/envs/tasks.py), so evaluation seeds score held-out tasks.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from actors.envs.base import EVALUATION_SEEDS_FROM, StepResult, Task, ToolCall
from actors.envs.tasks import Split, split_of


class VerifiersTaskset:
    """One episode at a time of the taskset ``taskset`` (an importable module
    exporting one ``vf.Taskset``, as ``vf-init`` lays it out)."""

    def __init__(self, taskset: str, max_turns: int = 32, success_reward: float = 1.0,
                 eval_fraction: float = 0.1, **config: Any) -> None:
        """``config``: the taskset's own config (its ``vf.TasksetConfig``
        fields, nested tables for nested configs), checked by verifiers."""
        import verifiers.v1 as vf
        from verifiers.v1.utils.loaders import taskset_config_type

        self.name = taskset
        self.max_turns = max_turns
        self.success_reward = success_reward
        loaded = taskset_config_type(taskset)(id=taskset, **config)
        self.tasks: dict[Split, list[Any]] = {"train": [], "eval": []}
        for task in vf.load_taskset(loaded):
            key = str(task.data.id if task.data.id is not None else task.data.idx)
            self.tasks[split_of(key, eval_fraction)].append(task)
        self.eval_fraction = eval_fraction
        if not self.tasks["train"]:
            raise ValueError(f"verifiers taskset {taskset!r}: no training tasks "
                             f"({self._sizes()})")
        self._episode: _Episode | None = None

    def _sizes(self) -> str:
        return (f"{len(self.tasks['train'])} training and {len(self.tasks['eval'])} "
                f"evaluation tasks by the hash split at eval_fraction = {self.eval_fraction}")

    async def reset(self, seed: int) -> Task:
        split: Split = "eval" if seed >= EVALUATION_SEEDS_FROM else "train"
        tasks = self.tasks[split]
        if not tasks:
            raise ValueError(f"verifiers taskset {self.name!r}: no evaluation tasks "
                             f"({self._sizes()}): raise options.eval_fraction")
        task = tasks[seed % len(tasks)]
        self._episode = await _Episode.start(task, self.max_turns)
        data = task.data
        prompt = data.prompt if isinstance(data.prompt, str) else _text(data.prompt)
        return Task(task_id=f"{self.name}-{task.key}", system=data.system_prompt or "",
                    instruction=prompt, tools=self._episode.schemas or None,
                    tags={"taskset": self.name})

    async def call_tool(self, call: ToolCall) -> StepResult:
        assert self._episode is not None, "reset() first"
        observation = await self._episode.call(call)
        return await self._episode.result(observation, self.success_reward)

    async def step(self, action: str) -> StepResult:
        assert self._episode is not None, "reset() first"
        self._episode.answer(action)
        return await self._episode.result("", self.success_reward, answered=True)

    async def close(self) -> None:
        self._episode = None


class _Episode:
    """One task's conversation, recorded in a verifiers ``Trace``."""

    def __init__(self, task: Any, max_turns: int) -> None:
        import verifiers.v1 as vf
        from verifiers.v1.session import RolloutLimits
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, TraceTask

        self.vf = vf
        self.task = task
        self.trace = vf.Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                           hash=task.hash),
            state=state_cls(type(task))(),
            agent=AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig(),
                                                  max_turns=max_turns)))
        self.limits = RolloutLimits(max_turns=max_turns)
        self.messages: list[Any] = []
        if task.data.system_prompt:
            self.messages.append(vf.SystemMessage(content=task.data.system_prompt))
        prompt = task.data.prompt
        self.messages += ([vf.UserMessage(content=prompt)] if isinstance(prompt, str)
                          else list(prompt or []))
        self.tools: list[Any] = []
        self.schemas: list[dict] = []
        self.servers: dict[str, tuple[Any, str]] = {}
        self.call_ids = itertools.count()

    @classmethod
    async def start(cls, task: Any, max_turns: int) -> _Episode:
        from mcp.server.mcpserver import MCPServer

        episode = cls(task, max_turns)
        for toolset in type(task).toolsets(task.config):
            await toolset.setup()
            await toolset.setup_task(task)
            server = MCPServer(toolset.server_name or type(toolset).__name__)
            toolset.register(server)
            for tool in await server.list_tools():
                name = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
                episode.tools.append(episode.vf.Tool(name=name, description=tool.description or "",
                                                     parameters=tool.input_schema))
                episode.schemas.append({"type": "function", "function": {
                    "name": name, "description": tool.description or "",
                    "parameters": tool.input_schema}})
                episode.servers[name] = (server, tool.name)
        return episode

    def _record(self, assistant: Any, finish_reason: str) -> None:
        from verifiers.v1 import graph

        response = self.vf.Response(id=f"turn-{len(self.trace.nodes)}", created=int(time.time()),
                                    model="policy", message=assistant,
                                    finish_reason=finish_reason)
        graph.prepare_turn(self.trace, self.messages, self.tools).commit(response)
        self.messages.append(assistant)

    async def call(self, call: ToolCall) -> str:
        vf = self.vf
        call_id = f"call-{next(self.call_ids)}"
        self._record(vf.AssistantMessage(content=None, tool_calls=[
            vf.ToolCall(id=call_id, name=call.name, arguments=json.dumps(call.arguments))]),
            "tool_calls")
        server, tool = self.servers[call.name]
        try:
            result = await server.call_tool(tool, call.arguments)
            text = "\n".join(block.text for block in result.content if block.type == "text")
        except Exception as exc:  # served tools answer errors as text: so does this
            text = f"error: {exc}"
        self.messages.append(vf.ToolMessage(tool_call_id=call_id, name=call.name, content=text))
        return text

    def answer(self, text: str) -> None:
        self._record(self.vf.AssistantMessage(content=text), "stop")

    async def result(self, observation: str, success_reward: float,
                     answered: bool = False) -> StepResult:
        """The step's result: the observation, or the end of the episode
        scored by the task's rubric."""
        stop = "answered" if answered else await self._stopped()
        if stop is None:
            return StepResult(observation)
        self.trace.stop(stop)
        self.trace.ok = True
        await self.task.score(self.trace)
        reward = float(self.trace.reward or 0.0)
        return StepResult(observation or f"episode over ({stop})", done=True, reward=reward,
                          success=reward >= success_reward,
                          info={"stop": stop, "metrics": dict(self.trace.metrics or {})})

    async def _stopped(self) -> str | None:
        """The turn limit or a ``@vf.stop`` hook of the task, as verifiers'
        rollout session checks them before each model turn."""
        import asyncio

        from verifiers.v1.session import hook_boundary
        from verifiers.v1.utils.decorators import invoke

        if (limit := self.limits.reached(self.trace)) is not None:
            return str(limit)
        for hook in self.task.hooks("stop"):
            if hook_boundary(hook, allow_trace=True) is self.vf.Trace:
                stopped = invoke(hook, {self.vf.Trace: self.trace})
                if asyncio.iscoroutine(stopped):
                    stopped = await stopped
                if stopped:
                    return hook.__name__
        return None


def _text(messages: list[Any]) -> str:
    """A prompt given as messages, as the text of its user turns."""
    return "\n\n".join(str(getattr(m, "content", None) or (m.get("content") if isinstance(
        m, dict) else "")) for m in messages if _role(m) == "user")


def _role(message: Any) -> str:
    return message.get("role", "") if isinstance(message, dict) else getattr(message, "role", "")
