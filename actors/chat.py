"""The agent's turns rendered with the model's own chat template, in token space.

Each turn is rendered by the tokenizer's chat template (so Qwen models and
the tiny model work alike) and turned into token ids once; the context then
only appends ids. Pieces that wrap variable content (an observation, the
resume message around the policy's summary) are found by rendering a
sentinel and splitting the text around it, so the content goes in as tokens:
the policy's own tokens are never re-tokenised.
"""

from __future__ import annotations

from typing import Any

from actors.config import CompactionConfig, EnvironmentConfig
from actors.context import TurnTokens
from actors.envs.base import Task

_SENTINEL = "\u2063CRL-SLOT\u2063"  # invisible separator: never in real text
_Message = dict[str, str]


class ChatFormat:
    """Renders the turns of an episode for one tokenizer."""

    def __init__(self, tokenizer: Any, compaction: CompactionConfig,
                 environment: EnvironmentConfig) -> None:
        self.tokenizer = tokenizer
        self.compaction = compaction
        self.environment = environment
        self._system: list[_Message] = [{"role": "system", "content": "s"}]
        base = self._system + [{"role": "user", "content": "u"}]
        self.assistant_header = self._ids(self._render(base, generation_prompt=True)[
            len(self._render(base)):])
        after = self._render(base + [{"role": "assistant", "content": _SENTINEL}]).split(
            _SENTINEL, 1)[1]
        eos = tokenizer.eos_token or ""
        end = eos if eos and after.startswith(eos) else ""
        self.assistant_end = self._ids(end)
        self.assistant_footer = self._ids(after[len(end):])
        with_action = base + [{"role": "assistant", "content": "a"}]
        open_text, close_text = self._delta(with_action, {"role": "tool", "content": _SENTINEL})
        self.observation_open, self.observation_close = self._ids(open_text), self._ids(close_text)
        self.truncation_marker = self._ids(environment.truncation_marker)
        self.summary_request = self._ids(
            "".join(self._delta(base, {"role": "user",
                                       "content": compaction.summary_instruction})))

    def _render(self, messages: list[_Message], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _delta(self, before: list[_Message], message: _Message) -> tuple[str, str]:
        """The text ``message`` adds after ``before``, split at the sentinel."""
        added = self._render(before + [message])[len(self._render(before)):]
        head, _, tail = added.partition(_SENTINEL)
        return head, tail

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def content(self, text: str, max_tokens: int) -> tuple[list[int], bool]:
        """Token ids of turn content cut to ``max_tokens`` (ending with the
        marker when cut), and whether it was cut."""
        ids = self._ids(text)
        if len(ids) <= max_tokens:
            return ids, False
        keep = max(0, max_tokens - len(self.truncation_marker))
        return ids[:keep] + self.truncation_marker, True

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def strip_end(self, ids: list[int]) -> list[int]:
        """A turn's tokens without the end-of-turn token the model sampled."""
        end = self.assistant_end
        return ids[: -len(end)] if end and ids[-len(end):] == end else ids

    def turns(self, task: Task) -> TurnTokens:
        """The token pieces of one episode."""
        system = [{"role": "system", "content": task.system}]
        system_ids = self._ids(self._render(system))
        task_ids = self._ids("".join(self._delta(system, {"role": "user",
                                                          "content": task.instruction})))
        resume_head, resume_tail = self._delta(system, {
            "role": "user",
            "content": self.compaction.resume_template.format(task=task.instruction,
                                                              summary=_SENTINEL)})
        head_ids, tail_ids = self._ids(resume_head), self._ids(resume_tail)
        return TurnTokens(
            system=system_ids, task=task_ids, summary_request=self.summary_request,
            assistant_header=self.assistant_header, assistant_end=self.assistant_end,
            assistant_footer=self.assistant_footer, observation_open=self.observation_open,
            observation_close=self.observation_close, truncation_marker=self.truncation_marker,
            resume=lambda summary_ids: head_ids + summary_ids + tail_ids)
