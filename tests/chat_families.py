"""Chat templates by family for the tests (``tests/unit/chat_templates/``):
each family's template, special tokens and end of turn on the tiny model's
byte-level tokenizer, and a ``ChatFormat`` built from them. None of the
templates is a copy of a model's file."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from actors.chat import ChatFormat
from actors.config import ActorConfig
from starting_points.tiny_model import CHAT_TEMPLATE as CHATML

TEMPLATES = Path(__file__).parent / "unit" / "chat_templates"


def template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text()


#: The special tokens each family's tokenizer has, and its end of turn.
FAMILIES: dict[str, tuple[str, list[str], str]] = {
    "chatml": (CHATML, [], "<|im_end|>"),
    "qwen2.5": (template("qwen2.5"),
                ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
                "<|im_end|>"),
    "qwen3": (template("qwen3"),
              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>"], "<|im_end|>"),
    "llama3": (template("llama3"),
               ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|eom_id|>"], "<|eot_id|>"),
}

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]


def tokenizer_for(model_dir: Path, template: str, specials: list[str], eos: str) -> Any:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    if "<|begin_of_text|>" in specials:
        tokenizer.bos_token = "<|begin_of_text|>"
    tokenizer.eos_token = eos
    tokenizer.chat_template = template
    return tokenizer


def chat_format(model_dir: Path, family: str, tools: list[dict] | None = None,
                **compaction: Any) -> ChatFormat:
    template, specials, eos = FAMILIES[family]
    config = ActorConfig()
    return ChatFormat(tokenizer_for(model_dir, template, specials, eos),
                      dataclasses.replace(config.compaction, **compaction), config.environment,
                      tools=tools)


def template_ids(chat: ChatFormat, messages: list[dict]) -> list[int]:
    text = chat.render(messages, generation_prompt=True)
    return chat.tokenizer.encode(text, add_special_tokens=False)
