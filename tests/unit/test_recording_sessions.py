"""The recording endpoint's bookkeeping: a harness's calls rendered to token
ids with the policy's own tokens spliced in (``ChatFormat.conversation_ids``)
and cut into segments (actors/sessions.py), on each template family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.chat import ChatFormat, TemplateError, message_text
from actors.context import Generation
from actors.sessions import SessionRecord
from tests.chat_families import FAMILIES, TOOLS, chat_format, template_ids

CALL = {"name": "bash", "arguments": {"command": "ls"}}


def generation(ids: list[int], version: int = 2) -> Generation:
    return Generation(ids, [-0.25] * len(ids), [version] * len(ids))


def sampled_ids(chat: ChatFormat, text: str) -> list[int]:
    return chat.tokenizer.encode(text, add_special_tokens=False) + chat.assistant_end


def no_record(index: int, message: dict) -> None:
    return None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_conversation_renders_as_the_template_does_with_the_policy_s_turns_spliced_in(
        tiny_model_dir: Path, family: str) -> None:
    chat = chat_format(tiny_model_dir, family)
    conversation = [{"role": "system", "content": "Open the vault."},
                    {"role": "user", "content": "Find the code."},
                    {"role": "assistant", "content": "look north"},
                    {"role": "tool", "content": "a box"},
                    {"role": "user", "content": [{"type": "text", "text": "go "},
                                                 {"type": "text", "text": "on"}]}]
    plain = [m | {"content": message_text(m)} for m in conversation]
    assert chat.conversation_ids(conversation, no_record) == template_ids(chat, plain)
    # the policy's turn as sampled (its end-of-turn token included) gives the same ids
    recorded = sampled_ids(chat, "look north")
    assert chat.conversation_ids(
        conversation, lambda i, m: recorded if i == 2 else None) == template_ids(chat, plain)
    # rendered again from the framing and ids it remembered, unchanged by the splice
    assert chat.conversation_ids(conversation, no_record) == template_ids(chat, plain)


@pytest.mark.parametrize("family", ["chatml", "qwen2.5"])
def test_a_recorded_tool_call_turn_goes_in_as_its_sampled_text(tiny_model_dir: Path,
                                                               family: str) -> None:
    """The harness sends the call back structured; the template would render
    it its own way, but the context holds what the policy sampled."""
    chat = chat_format(tiny_model_dir, family, tools=TOOLS)
    text = f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
    sent_back = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "bash", "arguments": json.dumps(CALL["arguments"])}}]}
    conversation = [{"role": "user", "content": "list the files"}, sent_back,
                    {"role": "tool", "content": "a.txt", "tool_call_id": "call-1"}]
    ids = chat.conversation_ids(conversation, lambda i, m: sampled_ids(chat, text)
                                if i == 1 else None)
    as_sampled = [conversation[0], {"role": "assistant", "content": text}, conversation[2]]
    assert ids == template_ids(chat, as_sampled)


def test_content_that_is_not_text_is_refused() -> None:
    with pytest.raises(TemplateError, match="text"):
        message_text({"role": "user", "content": [{"type": "image_url", "image_url": "x"}]})
    assert message_text({"role": "assistant", "content": None}) == ""


def test_calls_that_extend_the_context_make_one_execution_segment() -> None:
    session = SessionRecord("s", "r")
    assert session.record([1, 2, 3], generation([10, 11]), summary=False) == []
    # the next prompt holds the first prompt, its completion and a new turn
    assert session.record([1, 2, 3, 10, 11, 4, 5], generation([12]), summary=False) == []
    last = session.finish()
    assert last is not None and last.segment_type == "execution"
    assert last.tokens == [1, 2, 3, 10, 11, 4, 5, 12]
    assert last.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert last.logprobs == [0.0] * 3 + [-0.25] * 2 + [0.0] * 2 + [-0.25]
    assert last.versions == [-1] * 3 + [2, 2, -1, -1, 2]
    assert (session.calls, session.summaries, session.rebuilds) == (2, 0, 0)


def test_a_summary_call_closes_the_execution_segment_and_is_a_segment_of_its_own() -> None:
    session = SessionRecord("s", "r")
    session.record([1, 2], generation([10]), summary=False)
    closed = session.record([1, 2, 10, 7, 8], generation([20, 21]), summary=True)
    assert [s.segment_type for s in closed] == ["execution", "summary"]
    assert closed[0].tokens == [1, 2, 10]
    assert closed[1].tokens == [1, 2, 10, 7, 8, 20, 21]
    assert closed[1].loss_mask == [0] * 5 + [1, 1]
    # the context rebuilt around the summary: a new execution segment
    assert session.record([1, 9, 20, 21], generation([30]), summary=False) == []
    assert session.finish().tokens == [1, 9, 20, 21, 30]
    assert (session.summaries, session.rebuilds, session.summary_tokens) == (1, 0, 2)


def test_a_prompt_that_does_not_extend_the_context_starts_a_new_segment() -> None:
    """The harness compacted with its own prompt-free rewrite (or edited its
    history): the open segment closes as it was."""
    session = SessionRecord("s", "r")
    session.record([1, 2], generation([10]), summary=False)
    closed = session.record([1, 5], generation([11]), summary=False)
    assert [s.tokens for s in closed] == [[1, 2, 10]]
    assert session.rebuilds == 1
    assert session.finish().tokens == [1, 5, 11]
    assert session.finish() is None


def test_segments_without_a_sampled_token_are_not_emitted() -> None:
    session = SessionRecord("s", "r")
    assert session.record([1, 2], generation([]), summary=False) == []
    closed = session.record([1, 2, 3], generation([4]), summary=True)
    assert [s.segment_type for s in closed] == ["summary"]
    assert session.finish() is None
