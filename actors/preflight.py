"""What an episode needs, checked before any engine starts.

An engine takes most of a minute to start on CPU. A mistake in the
environment (its factory, its options, a task it cannot build), in the chat
template (a role it refuses, a system prompt it drops) or in the context
budget (a reserve that cannot hold a summary) would otherwise surface only
after that start, as a traceback from the first episode. Here the factory
is imported and called, one task is built (the first training seed's, or
for an evaluation the first held-out one's), the template is rendered and
verified with the task's tools through the tokenizer the engine will load,
and the task's context is laid out: any problem is one :class:`SetupError`
whose text names the field to change.
"""

from __future__ import annotations

import sys
from typing import Any

from actors.chat import ChatFormat
from actors.config import ActorConfig
from actors.context import CompactionContext
from actors.engine import require_model_folder
from actors.envs.base import load_environment, one_line

#: The task built for the check: a training seed (training seeds start at 0).
PREFLIGHT_SEED = 0


class SetupError(Exception):
    """The environment, template or context budget cannot run an episode."""


def load_tokenizer(model: str, trust_remote_code: bool) -> object:
    """The tokenizer the engine loads for ``model`` (vLLM's own loader)."""
    from vllm.tokenizers import get_tokenizer

    require_model_folder(model)

    return get_tokenizer(model, trust_remote_code=trust_remote_code)


async def check_episode_setup(model: str, config: ActorConfig,
                              seed: int = PREFLIGHT_SEED) -> None:
    """Raise :class:`SetupError` unless the episode ``seed`` of ``config``'s
    environment can be framed by ``model``'s template within its context."""
    factory = config.environment.factory
    environment = load_environment(factory, config.environment.options)
    try:
        try:
            task = await environment.reset(seed)
        except Exception as exc:  # the user's code: any failure is theirs to see
            raise SetupError(f"{factory}: reset({seed}) failed: "
                             f"{one_line(exc)}") from exc
    finally:
        await environment.close()
    try:
        chat = ChatFormat(load_tokenizer(model, config.engine.trust_remote_code),
                          config.compaction, config.environment).with_tools(task.tools)
    except ValueError as exc:  # TemplateError, or a tool parser vLLM does not have
        raise SetupError(f"the chat template of {model}: {exc}") from exc
    try:
        CompactionContext(chat.turns(task), config.compaction)
    except ValueError as exc:  # the context budget (actors/context.py names the field)
        raise SetupError(f"task {task.task_id!r} of {factory}: {exc}") from exc
    if task.tools and template_ignores_tools(chat.tokenizer, task.tools):
        # not a mistake (the tools still work when the model calls them), but
        # a newcomer cannot tell from a transcript why the model never does
        print(f"compactionrl: note: the chat template of {model} ignores the task's tools: "
              "the model never sees their schemas (describe them in the task's system "
              "prompt, or use a template that renders tools=; docs/environments.md, Tools)",
              file=sys.stderr)


def template_ignores_tools(tokenizer: Any, tools: list[dict]) -> bool:
    """Whether the template renders a conversation the same with and without
    ``tools`` (as the tiny CPU model's ChatML template, and many base
    models', does): then no schema reaches the model."""
    turn = [{"role": "user", "content": "u"}]
    return (tokenizer.apply_chat_template(turn, tools=tools, tokenize=False)
            == tokenizer.apply_chat_template(turn, tokenize=False))
