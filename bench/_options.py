"""The command line every benchmark here shares: ``--json`` (the last line
is one JSON object with the benchmark's documented keys), ``--quick`` (a
smoke test of the same code at small sizes), and sizes whose default is the
full run's or, under ``--quick``, the smoke test's, unless given.

Imported by the benchmarks (``python bench/NAME.py`` puts this folder first
on the import path); it is not a benchmark, and ``make bench`` skips it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(map(_shown, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


class BenchmarkParser(argparse.ArgumentParser):
    """An argument parser with ``--json``, ``--quick`` (unless ``quick`` is
    None: a benchmark without a smoke-test size) and :meth:`add_size`."""

    def __init__(self, description: str, quick: str | None = None) -> None:
        super().__init__(description=description)
        self.add_argument("--json", action="store_true", help="last line: one JSON object")
        if quick is not None:
            self.add_argument("--quick", action="store_true", help=quick)
        self._sizes: dict[str, tuple[Any, Any]] = {}

    def add_size(self, flag: str, full: Any, quick: Any, help: str, **options: Any) -> None:
        """An option that defaults to ``full``, or to ``quick`` under
        ``--quick``; its help says both."""
        action = self.add_argument(flag, default=None, **options,
                                   help=f"{help}: {_shown(full)} (--quick: {_shown(quick)})")
        self._sizes[action.dest] = (full, quick)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed = super().parse_args(args, namespace)
        for name, (full, quick) in self._sizes.items():
            if getattr(parsed, name) is None:
                setattr(parsed, name, quick if parsed.quick else full)
        return parsed
