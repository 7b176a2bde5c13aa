"""A policy without a model: it says the same text every turn."""

from __future__ import annotations

from typing import Any

from actors.context import Generation


class ScriptedPolicy:
    """Says ``text`` every turn (summaries included), each token at
    log-probability -0.1 and policy version 3; an engine as far as the agent
    loop and ``play_held_out`` read one."""

    def __init__(self, tokenizer: Any, text: str) -> None:
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        self.ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))

    async def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                       temperature: float | None = None) -> Generation:
        ids = self.ids[:max_tokens]
        return Generation(ids, [-0.1] * len(ids), [3] * len(ids))
