"""TensorBoard: event files under ``tracking/tensorboard``; a table is a
Markdown text summary (TensorBoard renders it under Text)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class TensorBoardTracker:
    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def config(self, settings: dict[str, Any], revision: str) -> None:
        text = json.dumps({**settings, "git_revision": revision}, indent=2, default=str)
        self.writer.add_text("run/config", f"```\n{text}\n```", 0)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def table(self, step: int, name: str, columns: Sequence[str],
              rows: list[list[Any]]) -> None:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", "<br>")
