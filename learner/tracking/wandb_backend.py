"""Weights & Biases (``wandb``): a run under ``tracking/wandb``; offline
(``tracking.wandb_mode = "offline"``) it writes files only, for ``wandb sync``
later."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from learner.config import TrackingConfig


class WandbTracker:
    def __init__(self, config: TrackingConfig, folder: Path, run_id: str) -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self.run = wandb.init(project=config.project, name=run_id, dir=str(folder),
                              mode=config.wandb_mode, resume="allow",
                              settings=wandb.Settings(console="off", silent=True))

    def config(self, settings: dict[str, Any], revision: str) -> None:
        self.run.config.update({**settings, "git_revision": revision}, allow_val_change=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def table(self, step: int, name: str, columns: Sequence[str],
              rows: list[list[Any]]) -> None:
        self.run.log({name: self._wandb.Table(columns=list(columns), data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()
        self._wandb.teardown()
