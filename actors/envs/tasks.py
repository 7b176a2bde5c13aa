"""Task rows from a dataset, split into training and evaluation by construction.

An environment that takes its tasks as data (rather than generating them
from a seed) reads them here: a JSONL file (one JSON object per line), or a
folder written by Hugging Face ``datasets``' ``save_to_disk`` (a ``Dataset``,
or a ``DatasetDict`` whose splits name the rows' split).

Which rows train and which evaluate never mixes, whatever seeds are asked:

- the row's ``split`` column, if it has one (``train``; ``eval``,
  ``validation`` or ``test``), else the ``DatasetDict`` split it came from;
- otherwise a hash of the row's id (``id`` or ``task_id`` column, else its
  JSON), so that the same row is on the same side in every process and run:
  ``eval_fraction`` of the rows evaluate.

Seeds below :data:`EVALUATION_SEEDS_FROM` draw training rows, seeds from
there draw evaluation rows (as keyvault's seeds do), so ``compactionrl eval``
scores held-out rows only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from actors.envs.base import EVALUATION_SEEDS_FROM

Split = Literal["train", "eval"]
_EVAL_NAMES = {"eval", "evaluation", "validation", "valid", "test", "dev"}


class TaskRows:
    """The rows of one dataset, by split (see the module docstring)."""

    def __init__(self, source: str | Path, eval_fraction: float = 0.1) -> None:
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction = {eval_fraction}: must be in [0, 1)")
        self.source = str(source)
        self.rows: dict[Split, list[dict[str, Any]]] = {"train": [], "eval": []}
        for row, named in _read(Path(source)):
            self.rows[_split_of(row, named, eval_fraction)].append(row)
        self.eval_fraction = eval_fraction
        if not self.rows["train"]:
            raise ValueError(f"{source}: no training rows ({self._sizes()})")

    def __len__(self) -> int:
        return len(self.rows["train"]) + len(self.rows["eval"])

    def _sizes(self) -> str:
        return (f"{len(self.rows['train'])} training and {len(self.rows['eval'])} evaluation "
                f"rows, the unnamed split by hash at eval_fraction = {self.eval_fraction}")

    def for_seed(self, seed: int) -> dict[str, Any]:
        """The row an episode seed draws: a training row below
        :data:`EVALUATION_SEEDS_FROM`, an evaluation row from there."""
        split: Split = "eval" if seed >= EVALUATION_SEEDS_FROM else "train"
        rows = self.rows[split]
        if not rows:
            raise ValueError(f"{self.source}: no evaluation rows ({self._sizes()}): give rows "
                             "a split column, or raise options.eval_fraction")
        return rows[seed % len(rows)]


def row_id(row: dict[str, Any]) -> str:
    """A row's stable id: its ``id`` or ``task_id``, else a hash of its JSON."""
    for column in ("id", "task_id"):
        if row.get(column) not in (None, ""):
            return str(row[column])
    text = json.dumps(row, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def split_of(key: str, eval_fraction: float) -> Split:
    """The split of the row (or task) with id ``key``: the same in every
    process and run; ``eval_fraction`` of all keys evaluate."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "little") / 2**64 < eval_fraction else "train"


def _split_of(row: dict[str, Any], named: str | None, eval_fraction: float) -> Split:
    name = str(row.get("split") or named or "").lower()
    if name:
        return "eval" if name in _EVAL_NAMES else "train"
    return split_of(row_id(row), eval_fraction)


def _read(source: Path) -> list[tuple[dict[str, Any], str | None]]:
    """Rows with the name of the split they came in (None: unnamed)."""
    if source.is_file():
        rows = []
        for number, line in enumerate(source.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{source}:{number}: not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{source}:{number}: a row must be a JSON object")
            rows.append((row, None))
        return rows
    if source.is_dir():
        from datasets import DatasetDict, load_from_disk

        loaded = load_from_disk(str(source))
        if isinstance(loaded, DatasetDict):
            return [(dict(row), name) for name, split in loaded.items() for row in split]
        return [(dict(row), None) for row in loaded]
    raise FileNotFoundError(f"task rows {source}: no such file or folder")
