"""Chat templates by family (actors/chat.py): the framing derived from each
template shape users bring, checked against the template's own rendering
through whole episodes with compactions; templates the method cannot frame
are refused with the feature named.

The templates (`chat_templates/`) are written for these tests in the shape
of each family (ChatML; Qwen2.5 with its default system prompt and tools; Qwen3 with its
history ``<think>`` stripping; Llama 3 headers with the tools in the first
user turn); none is a copy of a model's file. They run on the tiny model's
byte-level tokenizer with each family's special tokens added.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from actors.chat import ChatFormat, TemplateError
from actors.config import ActorConfig
from actors.context import CompactionContext, Generation
from actors.envs.base import Task
from tests.chat_families import FAMILIES, TOOLS, chat_format, template_ids, tokenizer_for


@pytest.fixture(scope="module")
def base_tokenizer_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


def sampled(chat: ChatFormat, text: str) -> Generation:
    ids = chat.tokenizer.encode(text, add_special_tokens=False) + chat.assistant_end
    return Generation(ids, [-0.5] * len(ids), [3] * len(ids))


def play(chat: ChatFormat, steps: int, keep_steps: int) -> None:
    """An episode of ``steps`` steps that compacts after every third; after
    every step and compaction the context's ids equal the template's ids of
    the conversation it stands for."""
    task = Task(task_id="t", system="Open the vault.", instruction="Find code 42 and open it.")
    config = dataclasses.replace(chat.compaction, context_tokens=1 << 16,
                                 reserve_tokens=1 << 12, keep_steps=keep_steps)
    context = CompactionContext(chat.turns(task), config)
    system = {"role": "system", "content": task.system}
    conversation = [system, {"role": "user", "content": task.instruction}]
    kept: list[dict] = []
    for step in range(steps):
        action, observation = f"go to room {step}", f"room {step} holds a note"
        context.add_step(sampled(chat, action), chat.content(observation, 10_000)[0])
        turn = [{"role": "assistant", "content": action}, {"role": "tool", "content": observation}]
        conversation += turn
        kept = (kept + [turn])[-keep_steps:] if keep_steps else []
        assert context.action_prompt() == template_ids(chat, conversation), f"step {step}"
        if step % 3 == 2:
            request = {"role": "user", "content": chat.compaction.summary_instruction}
            assert context.summary_prompt() == template_ids(chat, conversation + [request])
            summary = f"I have seen rooms up to {step}"
            generation = sampled(chat, summary)
            closed = context.compact(generation, chat.strip_end(generation.token_ids))
            assert [segment.segment_type for segment in closed] == ["execution", "summary"]
            resume = chat.compaction.resume_template.format(task=task.instruction,
                                                            summary=summary)
            conversation = [system, {"role": "user", "content": resume}]
            conversation += [message for pair in kept for message in pair]
            assert context.action_prompt() == template_ids(chat, conversation), "rebuilt"


@pytest.mark.parametrize("family, tools", [
    *((family, None) for family in sorted(FAMILIES)),
    *((family, TOOLS) for family in sorted(FAMILIES) if family != "chatml"),  # ChatML has none
], ids=lambda value: value if isinstance(value, str) else "tools" if value else "no-tools")
def test_every_piece_round_trips_through_steps_and_compactions(
        base_tokenizer_dir: Path, family: str, tools: list[dict] | None) -> None:
    chat = chat_format(base_tokenizer_dir, family, tools)
    play(chat, steps=7, keep_steps=2)
    play(chat, steps=4, keep_steps=0)


def test_qwen3_frames_observations_whole_where_prefix_differences_cut_them(
        base_tokenizer_dir: Path) -> None:
    """Qwen3 renders the last assistant turn with an empty ``<think>`` block:
    the text a tool turn adds is not a suffix of the text before it."""
    chat = chat_format(base_tokenizer_dir, "qwen3")
    decode = chat.tokenizer.decode
    assert decode(chat.observation_open) == "<|im_start|>user\n<tool_response>\n"
    assert decode(chat.observation_close) == "\n</tool_response><|im_end|>\n"
    assert decode(chat.assistant_header) == "<|im_start|>assistant\n"
    assert decode(chat.assistant_end) == "<|im_end|>" and decode(chat.assistant_footer) == "\n"


def test_qwen3_reasoning_in_an_action_is_kept_as_sampled(base_tokenizer_dir: Path) -> None:
    """After the task, Qwen3 keeps the reasoning of assistant turns: an
    action with a ``<think>`` block sits in the context as the template shows it."""
    chat = chat_format(base_tokenizer_dir, "qwen3")
    task = Task(task_id="t", system="s", instruction="find it")
    context = CompactionContext(chat.turns(task), chat.compaction)
    action = "<think>\nthe note is north\n</think>\n\ngo north"
    context.add_step(sampled(chat, action), chat.content("a note", 100)[0])
    assert context.action_prompt() == template_ids(chat, [
        {"role": "system", "content": "s"}, {"role": "user", "content": "find it"},
        {"role": "assistant", "content": action}, {"role": "tool", "content": "a note"}])


def test_llama3_pieces_carry_the_headers_and_the_default_system_lines(
        base_tokenizer_dir: Path) -> None:
    chat = chat_format(base_tokenizer_dir, "llama3", TOOLS)
    turns = chat.turns(Task(task_id="t", system="Be brief.", instruction="list files"))
    decode = chat.tokenizer.decode
    assert decode(turns.system).startswith("<|begin_of_text|><|start_header_id|>system")
    assert "Cutting Knowledge Date" in decode(turns.system)
    assert json.dumps(TOOLS[0], indent=4) in decode(turns.task)  # tools in the first user turn
    assert decode(chat.observation_open) == "<|start_header_id|>ipython<|end_header_id|>\n\n"
    assert decode(chat.assistant_end) == "<|eot_id|>" and chat.assistant_footer == []


def test_the_qwen25_default_system_prompt_is_replaced_by_the_tasks(
        base_tokenizer_dir: Path) -> None:
    chat = chat_format(base_tokenizer_dir, "qwen2.5", TOOLS)
    system = chat.tokenizer.decode(chat.turns(Task(task_id="t", system="Be brief.",
                                                   instruction="x")).system)
    assert system.startswith("<|im_start|>system\nBe brief.") and "You are Qwen" not in system


UNFRAMEABLE = {
    "numbered observations": (
        "{% for m in messages %}{{ '<|im_start|>' + m.role }}"
        "{% if m.role == 'tool' %}{{ ' ' + loop.index|string }}{% endif %}"
        "{{ '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "depends on its position"),
    "no tool role": (
        "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
        "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "refuses a conversation of roles"),
    "system dropped": (
        "{% for m in messages %}{% if m.role != 'system' %}"
        "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "does not show a system turn's content verbatim"),
    "no generation prompt": (
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content"
        " + '<|im_end|>\\n' }}{% endfor %}",
        "add_generation_prompt does not append an assistant header"),
    "history header differs": (
        "{% for m in messages %}{% if m.role == 'assistant' %}{{ '<|im_start|>bot\\n' }}"
        "{% else %}{{ '<|im_start|>' + m.role + '\\n' }}{% endif %}"
        "{{ m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "does not open with the generation prompt's header"),
}


@pytest.mark.parametrize("name", sorted(UNFRAMEABLE))
def test_a_template_that_cannot_be_framed_is_refused_naming_the_feature(
        base_tokenizer_dir: Path, name: str) -> None:
    template, feature = UNFRAMEABLE[name]
    config = ActorConfig()
    tokenizer = tokenizer_for(base_tokenizer_dir, template, [], "<|im_end|>")
    with pytest.raises(TemplateError, match=feature):
        ChatFormat(tokenizer, config.compaction, config.environment)
