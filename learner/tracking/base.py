"""The tracker interface, the figures a step records, and opening the
configured backends."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from learner.config import TrackingConfig
from protocol import Batch, sampled_runs

#: Columns of the rollout-sample table.
SAMPLE_COLUMNS = ("task", "summaries", "final_answer", "reward", "compactions", "staleness")
#: Characters of a summary or an answer kept in the table.
SAMPLE_TEXT_CHARS = 2000


class Tracker(Protocol):
    """One backend. Every call is made on rank 0 only."""

    def config(self, settings: dict[str, Any], revision: str) -> None:
        """The run's settings and the code's git revision, once."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """The step's figures, by name (``group/name``)."""

    def table(self, step: int, name: str, columns: Sequence[str],
              rows: list[list[Any]]) -> None:
        """A table of rows under ``name`` at ``step``."""

    def close(self) -> None:
        """Flush and end the run's record."""


class Trackers:
    """Every configured backend, called in turn."""

    def __init__(self, backends: list[Tracker]) -> None:
        self.backends = backends

    def config(self, settings: dict[str, Any], revision: str) -> None:
        for backend in self.backends:
            backend.config(settings, revision)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for backend in self.backends:
            backend.scalars(step, values)

    def table(self, step: int, name: str, columns: Sequence[str],
              rows: list[list[Any]]) -> None:
        for backend in self.backends:
            backend.table(step, name, columns, rows)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


def open_tracker(config: TrackingConfig, run_dir: Path, run_id: str) -> Trackers | None:
    """The configured backends, writing under ``run_dir/tracking``; None when
    there are none (the default)."""
    if not config.backends:
        return None
    backends: list[Tracker] = []
    for name in config.backends:
        if name == "wandb":
            from learner.tracking.wandb_backend import WandbTracker
            backends.append(WandbTracker(config, run_dir / "tracking", run_id))
        else:
            from learner.tracking.tensorboard_backend import TensorBoardTracker
            backends.append(TensorBoardTracker(run_dir / "tracking" / "tensorboard"))
    return Trackers(backends)


def git_revision(where: Path) -> str:
    """The commit of the code at ``where`` (with ``+dirty`` for uncommitted
    changes), or ``unknown`` outside a git checkout."""
    try:
        commit = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"],
                                capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def step_scalars(metrics: dict[str, float], batch: Batch, rewards: list[float],
                 successes: list[bool], compactions: list[int]) -> dict[str, float]:
    """A step's figures: the trainer's statistics and what the rollouts say
    of the actors (reward, success, compactions, summary length) and of the
    replay (staleness)."""
    finals = [rollout.segments[-1] for rollout in batch.rollouts]
    summary_tokens = [final.stats.summary_tokens for final in finals if final.stats]
    n = max(len(rewards), 1)
    values = {name if "/" in name else f"train/{name}": float(value)
              for name, value in metrics.items()}
    values.update({
        "rollouts/reward": sum(rewards) / n,
        "rollouts/success": sum(successes) / n,
        "rollouts/compactions": sum(compactions) / n,
        "rollouts/summary_tokens_per_rollout": (sum(summary_tokens) / len(summary_tokens)
                                                if summary_tokens else 0.0),
        "replay/staleness_mean": float(batch.staleness.mean),
        "replay/staleness_max": float(batch.staleness.max),
    })
    return values


def rollout_samples(batch: Batch, tokenizer: Any, count: int) -> list[list[Any]]:
    """Rows of :data:`SAMPLE_COLUMNS` for the first ``count`` rollouts of
    ``batch``: each summary's sampled text, and the last action's."""
    rows = []
    for rollout in batch.rollouts[:count]:
        summaries = [_sampled_text(segment, tokenizer) for segment in rollout.segments
                     if segment.segment_type == "summary"]
        final = rollout.segments[-1]
        executions = [s for s in rollout.segments if s.segment_type == "execution"]
        answer = _last_action_text(executions[-1], tokenizer) if executions else ""
        rows.append([final.task_id, "\n---\n".join(summaries)[:SAMPLE_TEXT_CHARS],
                     answer[:SAMPLE_TEXT_CHARS], float(final.reward or 0.0), len(summaries),
                     rollout.staleness])
    return rows


def _sampled_text(segment: Any, tokenizer: Any) -> str:
    mask = segment.loss_mask.numpy().astype(bool)
    return tokenizer.decode(segment.tokens.numpy()[mask].tolist(), skip_special_tokens=True)


def _last_action_text(segment: Any, tokenizer: Any) -> str:
    """The last run of sampled tokens in ``segment``: its final action."""
    runs = sampled_runs(segment.loss_mask.numpy())
    start, end = runs[-1] if runs else (0, 0)
    return tokenizer.decode(segment.tokens.numpy()[start:end].tolist(), skip_special_tokens=True)
