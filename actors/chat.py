"""The agent's turns rendered with the model's own chat template, in token space.

The framing pieces (the assistant header the generation prompt opens, the
end of an assistant turn, an observation's open and close, the summary
request, the resume turn around the policy's summary) are cut from *one*
rendering of a probe conversation whose every content is a distinct sentinel,
split at the sentinels: a template that renders earlier turns differently
once more follow (Qwen3 drops the ``<think>`` of earlier assistant turns and
marks the last one) still yields the pieces it puts between contents. The
context then only appends ids: the policy's own tokens are never
re-tokenised.

Derived, then verified (:func:`verify_framing`): an episode with two steps
and a compaction is played through :class:`~actors.context.CompactionContext`
with these pieces, and the token ids of every prompt it builds must equal the
template's own rendering of the same conversation, tokenised whole. A template the method
cannot frame raises :class:`TemplateError` naming the template feature; it is
never used with a wrong framing.

Contents go in as their own tokens: where the template's whole-text
tokenisation would merge a content's first or last characters with the
framing around it, the context keeps them apart (the probe's contents are
words, so the check holds for every template that separates turns by special
tokens or newlines).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

from actors.config import CompactionConfig, EnvironmentConfig
from actors.context import CompactionContext, Generation, TurnTokens
from actors.envs.base import Task
from actors.tools import ToolCallParser

_Message = dict[str, Any]
#: Sentinels wrap their slot name in invisible separators: never in real text.
_MARK = "\u2063"
#: Texts (contents, framing) whose token ids :meth:`ChatFormat.conversation_ids` keeps.
CACHED_TEXTS = 16_384
#: Conversation shapes whose framing :meth:`ChatFormat.conversation_ids` keeps.
CACHED_SHAPES = 1_024


def _slot(name: str) -> str:
    return f"{_MARK}CRL-{name}{_MARK}"


def message_text(message: _Message) -> str:
    """A chat message's text content: a string, or its text parts joined
    (OpenAI's content parts); None is empty. Other parts are refused."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str)
                                         for part in content):
        return "".join(part["text"] for part in content)
    raise TemplateError("a message's content must be text or a list of text parts")


class TemplateError(ValueError):
    """A chat template that cannot be framed token-in/token-out; the message
    names the template feature in the way."""


class ChatFormat:
    """Renders the turns of an episode for one tokenizer and its chat template.

    ``tools``: the environment's tools as JSON schemas, passed to the template
    (``tools=``) in every rendering, so the framing includes what the template
    says about them (Qwen puts them in the system turn, Llama 3 in the first
    user turn)."""

    def __init__(self, tokenizer: Any, compaction: CompactionConfig,
                 environment: EnvironmentConfig, tools: list[dict] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.compaction = compaction
        self.environment = environment
        self.tools = tools or None
        self.assistant_header = self.text_ids(self._generation_prompt())
        step = self._step_pieces()
        self.assistant_end, self.assistant_footer = step["end"], step["footer"]
        self._assistant_end_text = self.decode(self.assistant_end, keep_special=True)
        self.observation_open, self.observation_close = step["open"], step["close"]
        self.truncation_marker = self.text_ids(environment.truncation_marker)
        self.summary_request = self.text_ids(self._summary_request_text(step["close_text"]))
        verify_framing(self)
        self.tool_calls = ToolCallParser(environment.tool_parser, tokenizer)
        self._with_tools: dict[str, ChatFormat] = {}
        # A harness resends its whole conversation every call: each content
        # is tokenised alone (so its ids never depend on its neighbours) and
        # the framing depends only on the conversation's shape (roles, slots,
        # other keys), so both are remembered, not recomputed per call.
        self._content_ids = functools.lru_cache(maxsize=CACHED_TEXTS)(self._ids_tuple)
        self._framing = functools.lru_cache(maxsize=CACHED_SHAPES)(self._split_shape)

    def with_tools(self, tools: list[dict] | None) -> ChatFormat:
        """This format for a task that declares ``tools``: derived and
        verified once per tool set."""
        if (tools or None) == self.tools:
            return self
        key = json.dumps(tools, sort_keys=True)
        if key not in self._with_tools:
            self._with_tools[key] = ChatFormat(self.tokenizer, self.compaction,
                                               self.environment, tools)
        return self._with_tools[key]

    # ------------------------------------------------------------------ rendering

    def render(self, messages: list[_Message], generation_prompt: bool = False) -> str:
        """The template's own text for ``messages``."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=self.tools, tokenize=False,
                add_generation_prompt=generation_prompt)
        except Exception as exc:  # jinja's raise_exception, a missing role branch
            roles = ", ".join(message["role"] for message in messages)
            raise TemplateError(f"the template refuses a conversation of roles [{roles}]: "
                                f"{exc}") from exc

    def split(self, messages: list[_Message], generation_prompt: bool) -> list[str]:
        """The rendering of ``messages`` (each content a sentinel) cut at
        the sentinels: the framing before, between and after the contents."""
        text = self.render(messages, generation_prompt)
        pieces = []
        for message in messages:
            head, found, text = text.partition(message["content"])
            if not found:
                raise TemplateError(
                    f"the template does not show a {message['role']} turn's content verbatim "
                    "(it drops, trims or rewrites it), so the policy's tokens could not be "
                    "kept as sampled")
            pieces.append(head)
        return pieces + [text]

    def _generation_prompt(self) -> str:
        base = [{"role": "system", "content": _slot("s")}, {"role": "user", "content": _slot("u")}]
        plain, prompted = self.render(base), self.render(base, generation_prompt=True)
        if not prompted.startswith(plain) or prompted == plain:
            raise TemplateError("add_generation_prompt does not append an assistant header "
                                "to the conversation as rendered without it")
        return prompted[len(plain):]

    def _step_pieces(self) -> dict[str, Any]:
        """End of an assistant turn, and an observation's open and close, from
        one conversation of two steps (the pieces must not depend on the step)."""
        header = self._generation_prompt()
        conversation = [{"role": "system", "content": _slot("s")},
                        {"role": "user", "content": _slot("u")},
                        {"role": "assistant", "content": _slot("a1")},
                        {"role": "tool", "content": _slot("o1")},
                        {"role": "assistant", "content": _slot("a2")},
                        {"role": "tool", "content": _slot("o2")}]
        pieces = self.split(conversation, generation_prompt=True)
        after_action, after_observation = pieces[3], pieces[4]
        if not pieces[2].endswith(header):
            raise TemplateError("an assistant turn in the history does not open with the "
                                f"generation prompt's header {header!r}")
        if not after_observation.endswith(header):
            raise TemplateError("the turn after an observation does not open with the "
                                f"generation prompt's header {header!r}")
        if pieces[5] != after_action or pieces[6] != after_observation:
            raise TemplateError("the framing of a step depends on its position (the template "
                                "numbers, merges or otherwise varies repeated turns)")
        # where the assistant turn ends: rendered as the last turn, before any tool turn
        closing = self.split(conversation[:3], generation_prompt=False)[-1]
        if not after_action.startswith(closing):
            raise TemplateError("an assistant turn closes differently once a tool turn "
                                f"follows ({closing!r} vs {after_action!r})")
        eos = self.tokenizer.eos_token or ""
        end = eos if eos and closing.startswith(eos) else ""
        close_text = after_observation[:len(after_observation) - len(header)]
        return {"end": self.text_ids(end), "footer": self.text_ids(closing[len(end):]),
                "open": self.text_ids(after_action[len(closing):]),
                "close": self.text_ids(close_text), "close_text": close_text}

    def _summary_request_text(self, observation_close: str) -> str:
        """The user turn holding q_sum, as it follows an observation."""
        header = self._generation_prompt()
        instruction = self.compaction.summary_instruction
        pieces = self.split([{"role": "system", "content": _slot("s")},
                              {"role": "user", "content": _slot("u")},
                              {"role": "assistant", "content": _slot("a")},
                              {"role": "tool", "content": _slot("o")},
                              {"role": "user", "content": _slot("q")}], generation_prompt=True)
        if not pieces[4].startswith(observation_close) or not pieces[5].endswith(header):
            raise TemplateError("a user turn after an observation is framed differently from "
                                "an observation followed by the assistant")
        return (pieces[4][len(observation_close):] + instruction
                + pieces[5][:len(pieces[5]) - len(header)])

    def conversation_ids(self, messages: list[_Message],
                         recorded: Callable[[int, _Message], list[int] | None]) -> list[int]:
        """Token ids of a whole conversation, ready for the assistant's next
        turn: the template's framing between the contents, each content
        tokenised alone, except the assistant turns for which ``recorded``
        (given the message's index and the message) returns the policy's own
        sampled ids: those go in as sampled (the end-of-turn token they hold is
        not framed again). A recorded turn is rendered as plain content (its
        tool calls are in its sampled text)."""
        framed = []
        spliced: dict[int, list[int]] = {}
        for index, message in enumerate(messages):
            ids = recorded(index, message) if message.get("role") == "assistant" else None
            plain = {key: value for key, value in message.items()
                     if ids is None or key not in ("tool_calls", "reasoning_content")}
            if ids is not None:
                spliced[index] = ids
            framed.append(plain | {"content": _slot(f"m{index}")})
        pieces = self._framing(json.dumps(framed))
        end = self._assistant_end_text
        result = list(self._content_ids(pieces[0]))
        for index, message in enumerate(messages):
            after = pieces[index + 1]
            if index in spliced:
                ids = spliced[index]
                result += ids
                if end and ids[-len(self.assistant_end):] == self.assistant_end:
                    after = after.removeprefix(end)
            else:
                result += self._content_ids(message_text(message))
            result += self._content_ids(after)
        return result

    def _split_shape(self, framed: str) -> tuple[str, ...]:
        return tuple(self.split(json.loads(framed), generation_prompt=True))

    def _ids_tuple(self, text: str) -> tuple[int, ...]:
        return tuple(self.text_ids(text))

    # ------------------------------------------------------------------ pieces

    def text_ids(self, text: str) -> list[int]:
        """``text`` tokenised alone, without special tokens added."""
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def content(self, text: str, max_tokens: int) -> tuple[list[int], bool]:
        """Token ids of turn content cut to ``max_tokens`` (ending with the
        marker when cut), and whether it was cut."""
        ids = self.text_ids(text)
        if len(ids) <= max_tokens:
            return ids, False
        keep = max(0, max_tokens - len(self.truncation_marker))
        return ids[:keep] + self.truncation_marker, True

    def decode(self, ids: list[int], keep_special: bool = False) -> str:
        """Text of ``ids``; ``keep_special`` keeps special tokens (a tool
        call's ``<tool_call>`` is one in some tokenizers)."""
        return self.tokenizer.decode(ids, skip_special_tokens=not keep_special)

    def strip_end(self, ids: list[int]) -> list[int]:
        """A turn's tokens without the end-of-turn token the model sampled."""
        end = self.assistant_end
        return ids[: -len(end)] if end and ids[-len(end):] == end else ids

    def turns(self, task: Task) -> TurnTokens:
        """The token pieces of one episode."""
        system, task_turn, after_task = self.split(
            [{"role": "system", "content": _slot("s")}, {"role": "user", "content": _slot("u")}],
            generation_prompt=False)
        resume_head, resume_tail = self._resume_pieces(task)
        head_ids, tail_ids = self.text_ids(resume_head), self.text_ids(resume_tail)
        return TurnTokens(
            system=self.text_ids(system + task.system),
            task=self.text_ids(task_turn + task.instruction + after_task),
            summary_request=self.summary_request,
            assistant_header=self.assistant_header, assistant_end=self.assistant_end,
            assistant_footer=self.assistant_footer, observation_open=self.observation_open,
            observation_close=self.observation_close, truncation_marker=self.truncation_marker,
            resume=lambda summary_ids: head_ids + summary_ids + tail_ids)

    def _resume_pieces(self, task: Task) -> tuple[str, str]:
        """The resume turn's text before and after the summary (the summary
        goes in as the policy's tokens)."""
        summary = _slot("summary")
        content = self.compaction.resume_template.format(task=task.instruction, summary=summary)
        between, after = self.split([{"role": "system", "content": _slot("s")},
                                      {"role": "user", "content": content}],
                                     generation_prompt=False)[1:]
        head, _, tail = content.partition(summary)
        return between + head, tail + after


# ---------------------------------------------------------------------- verification


def verify_framing(chat: ChatFormat) -> None:
    """Play a probe episode (two steps, a compaction keeping one) with
    ``chat``'s pieces; every prompt's ids must equal the template's rendering
    of the same conversation, tokenised whole, or :class:`TemplateError`
    says where they differ."""
    task = Task(task_id="probe", system="You solve tasks with the tools given.",
                instruction="Find the code in the rooms.")
    actions = ["look north", "open the door"]
    observations = ["a room with a box", "the door is open"]
    summary = "I looked north and opened the door"
    # room for anything: the probe compacts when told to, not when full
    config = dataclasses.replace(chat.compaction, enabled=True, context_tokens=1 << 20,
                                 reserve_tokens=1 << 19, max_summary_tokens=1 << 10,
                                 keep_steps=1)
    context = CompactionContext(chat.turns(task), config)
    history: list[_Message] = [{"role": "system", "content": task.system},
                               {"role": "user", "content": task.instruction}]
    _expect(chat, context.action_prompt(), history, "the first prompt (system and task)")
    for action, observation in zip(actions, observations, strict=True):
        context.add_step(_sampled(chat, action), chat.text_ids(observation))
        history += [{"role": "assistant", "content": action},
                    {"role": "tool", "content": observation}]
        _expect(chat, context.action_prompt(), history, "a step (action and observation)")
    request = {"role": "user", "content": chat.compaction.summary_instruction}
    _expect(chat, context.summary_prompt(), history + [request], "the summary request")
    sampled = _sampled(chat, summary)
    context.compact(sampled, chat.strip_end(sampled.token_ids))
    resumed = chat.compaction.resume_template.format(task=task.instruction, summary=summary)
    rebuilt = [history[0], {"role": "user", "content": resumed}] + history[-2:]
    _expect(chat, context.action_prompt(), rebuilt,
            "the context rebuilt after a compaction (resume turn and the kept step)")


def _sampled(chat: ChatFormat, text: str) -> Generation:
    """``text`` as the policy would sample it: its tokens, then the end of turn."""
    ids = chat.text_ids(text) + chat.assistant_end
    return Generation(ids, [0.0] * len(ids), [0] * len(ids))


def _expect(chat: ChatFormat, ids: list[int], messages: list[_Message], what: str) -> None:
    tokenizer = chat.tokenizer
    expected = chat.text_ids(chat.render(messages, generation_prompt=True))
    if ids == expected:
        return
    at = next((i for i, (a, b) in enumerate(zip(ids, expected, strict=False)) if a != b),
              min(len(ids), len(expected)))
    raise TemplateError(
        f"{what} framed from the template's pieces differs from the template's own "
        f"rendering at token {at}: {tokenizer.decode(ids[at:at + 12])!r} vs "
        f"{tokenizer.decode(expected[at:at + 12])!r}")
