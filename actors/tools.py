"""The model's tool calls, parsed by vLLM's own tool parsers.

An environment's task declares its tools as JSON schemas (OpenAI function
format, ``Task.tools``); they reach the chat template (``tools=``), and each
action of such a task is parsed here by the parser configured for the model
family (``actors.environment.tool_parser``: ``hermes`` for Qwen-style
``<tool_call>`` JSON, ``llama3_json``, ``pythonic``, ... any name vLLM
registers). A call that cannot be taken (not parseable, a tool the task does
not declare, arguments that break the tool's schema) is never passed on: the
loop answers it with an observation saying what was wrong and counts it
(``crl_actor_tool_call_errors_total{reason}``). Summaries are never parsed:
only actions come here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from actors.envs.base import ToolCall

ToolCallErrorReason = Literal["malformed", "unknown_tool", "invalid_arguments"]


@dataclass
class ParsedAction:
    """An action of a task with tools: its calls, or why they cannot be taken."""

    calls: list[ToolCall] = field(default_factory=list)
    """Empty: a plain text turn (an answer, not a call)."""
    error: str | None = None
    """What was wrong, as the observation tells the model."""
    reason: ToolCallErrorReason | None = None
    content: str | None = None
    """With calls: the text around them, as the parser extracted it."""


class ToolCallParser:
    """One vLLM tool parser for one tokenizer. vLLM is imported at the first
    call: environments without tools never load it."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self._parser_class: type | None = None

    def _parser(self, tools: list[dict]) -> tuple[Any, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        if self._parser_class is None:
            try:
                self._parser_class = ToolParserManager.get_tool_parser(self.name)
            except KeyError:
                raise ValueError(
                    f"actors.environment.tool_parser = {self.name!r} is not a vLLM tool parser; "
                    f"choose one of {sorted(ToolParserManager.list_registered())}") from None
        request = ChatCompletionRequest(model="policy", messages=[], tools=tools or None)
        # parsers keep streaming state: a fresh one per action
        return self._parser_class(self.tokenizer, request.tools), request

    def check(self) -> None:
        """Refuse now a parser name vLLM lacks or a tokenizer it cannot use
        (``llama3_json`` needs ``<|python_tag|>``)."""
        self._parser([])

    def parse(self, text: str, tools: list[dict]) -> ParsedAction:
        """The calls in ``text`` (the action with its special tokens), checked
        against ``tools``."""
        parser, request = self._parser(tools)
        extracted = parser.extract_tool_calls(text, request)
        if not extracted.tools_called:
            if self._attempted(parser, text):
                return ParsedAction(error=f"the tool call could not be parsed ({self.name} "
                                          "format expected)", reason="malformed")
            return ParsedAction()
        schemas = {tool["function"]["name"]: tool["function"].get("parameters") or {}
                   for tool in tools}
        calls = []
        for extracted_call in extracted.tool_calls:
            name = extracted_call.function.name
            if name not in schemas:
                return ParsedAction(error=f"there is no tool {name!r}; the tools are "
                                          f"{sorted(schemas)}", reason="unknown_tool")
            try:
                arguments = json.loads(extracted_call.function.arguments or "{}")
            except ValueError:
                return ParsedAction(error=f"the arguments of {name!r} are not JSON",
                                    reason="malformed")
            problem = _schema_problem(arguments, schemas[name])
            if problem:
                return ParsedAction(error=f"the arguments of {name!r} do not fit its schema: "
                                          f"{problem}", reason="invalid_arguments")
            calls.append(ToolCall(name, arguments))
        return ParsedAction(calls, content=extracted.content)

    @staticmethod
    def _attempted(parser: Any, text: str) -> bool:
        """Whether ``text`` tries a call the parser did not take: it holds the
        parser's start token (``<tool_call>``), or, for parsers that also take
        a bare call (``llama3_json``, ``pythonic``), it holds their marker or
        opens like a JSON object or a list of calls."""
        start = getattr(parser, "tool_call_start_token", None)
        if isinstance(start, str) and start:
            return start in text
        marker = getattr(parser, "bot_token", None)
        return ((isinstance(marker, str) and bool(marker) and marker in text)
                or text.lstrip().startswith(("{", "[")))


def _schema_problem(arguments: Any, schema: dict) -> str | None:
    import jsonschema

    if not isinstance(arguments, dict):
        return "arguments must be a JSON object"
    try:
        jsonschema.validate(arguments, schema or {"type": "object"})
    except jsonschema.ValidationError as exc:
        return exc.message
    except jsonschema.SchemaError as exc:
        return f"the tool's own schema is invalid: {exc.message}"
    return None
