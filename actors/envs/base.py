"""The environment interface, and loading an environment by import path.

An environment runs one episode at a time: :meth:`Environment.reset` starts
it from a seed and returns the task; :meth:`Environment.step` takes the
assistant's text and returns the observation. Users plug in their own by
naming a class in the configuration::

    [actors.environment]
    factory = "mypackage.envs:MyEnvironment"   # called with **options
    options = { difficulty = 3 }
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

#: Held-out episode seeds start here; training seeds are below, so an
#: evaluation never replays a training episode (an environment with task
#: rows draws evaluation rows from here: actors/envs/tasks.py).
EVALUATION_SEEDS_FROM = 2**31


@dataclass
class Task:
    """What the agent is asked to do."""

    task_id: str
    """Stable id (the same seed gives the same task id)."""
    system: str
    """System prompt."""
    instruction: str
    """The user's task, repeated in the resume message after every compaction."""
    tools: list[dict] | None = None
    """The tools the agent may call, as JSON schemas in the OpenAI function
    format (``{"type": "function", "function": {"name", "description",
    "parameters"}}``). They reach the chat template, and each action is parsed
    for calls (actors/tools.py), which go to :meth:`Environment.call_tool`."""
    tags: dict[str, str] = field(default_factory=dict)
    """Labels of the task (``{"family": "arith", "difficulty": "3"}``) that
    travel with the rollout: the learner's success rate and evaluation
    reports are given by each label's value. Keep values few (they label
    metrics)."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made, checked against the tool's schema."""

    name: str
    arguments: dict[str, Any]


@dataclass
class StepResult:
    """The environment's answer to one action."""

    observation: str
    done: bool = False
    reward: float = 0.0
    """Final task reward; read when ``done``."""
    step_reward: float = 0.0
    """This step's own reward (optional shaping): it goes on the action's last
    token and reaches GAE as a token reward beside the final reward
    (docs/environments.md)."""
    success: bool = False
    """Whether the task was solved; read when ``done``."""
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode at a time; an actor makes one instance per concurrent episode."""

    async def reset(self, seed: int) -> Task:
        """Start a new episode, deterministic in ``seed``."""
        ...

    async def step(self, action: str) -> StepResult:
        """Apply the assistant's text; an action the environment cannot parse
        is an observation saying so, never an exception. For a task with
        tools, only a turn without a tool call comes here (an answer)."""
        ...

    # A task with ``tools`` needs one more method, ``async def call_tool(self,
    # call: ToolCall) -> StepResult``: each call of a turn, in order, its
    # arguments already valid against the tool's schema.

    async def close(self) -> None:
        """Release what the episode holds (processes, folders)."""
        ...


class EnvironmentLoadError(Exception):
    """The configured factory cannot be imported or called."""


def one_line(exc: BaseException) -> str:
    """An exception as one line (a pydantic error spans several)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def load_environment(factory: str, options: dict[str, Any]) -> Environment:
    """Import ``module:attribute`` and call it with ``options``."""
    module_name, _, attribute = factory.partition(":")
    if not module_name or not attribute:
        raise EnvironmentLoadError(f"environment factory {factory!r}: expected 'module:Name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's configuration problem
        raise EnvironmentLoadError(f"cannot import {module_name!r}: {exc}") from exc
    try:
        make = getattr(module, attribute)
    except AttributeError:
        raise EnvironmentLoadError(f"{module_name!r} has no attribute {attribute!r}") from None
    try:
        environment = make(**options)
    except Exception as exc:  # the user's code and options: any failure is theirs to see
        raise EnvironmentLoadError(
            f"{factory}(**{options}) failed: {one_line(exc)}") from exc
    if not isinstance(environment, Environment):
        raise EnvironmentLoadError(f"{factory} did not return an Environment "
                                   "(async reset, step, close)")
    return environment
