"""Bounds declared on configuration fields, checked in one place.

A field says its range where it is defined::

    lr: float = bounded(1e-4, gt=0)
    gamma: float = bounded(1.0, ge=0, le=1)

(the field's docstring below it, as for any field), and a config's
``validate`` starts from :func:`bound_problems`, which names every field out
of its range at once (``learner.lr must be > 0 (is -1.0)``), then adds the
checks that relate several fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Bounds:
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""
    """Said after the problem: what the bound protects, or the fix."""

    def problem(self, value: float | str) -> str:
        """What is wrong with ``value`` ('' if nothing). A string is a
        field's named choice (``"auto"``), which its ``Literal`` checks."""
        if isinstance(value, str):
            return ""
        for bound, holds, word in ((self.ge, lambda b: value >= b, ">="),
                                   (self.gt, lambda b: value > b, ">"),
                                   (self.le, lambda b: value <= b, "<="),
                                   (self.lt, lambda b: value < b, "<")):
            if bound is not None and not holds(bound):
                return f"must be {word} {bound:g}"
        return ""


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, why: str = "") -> Any:
    """A dataclass field with ``default`` whose value must lie within the bounds."""
    return field(default=default, metadata={"bounds": Bounds(ge, gt, le, lt, why)})


def bound_problems(config: Any, section: str) -> list[str]:
    """One line per field of ``config`` out of its declared range."""
    problems = []
    for f in dataclasses.fields(config):
        bounds = f.metadata.get("bounds")
        if bounds is None:
            continue
        value = getattr(config, f.name)
        if problem := bounds.problem(value):
            why = f": {bounds.why}" if bounds.why else ""
            problems.append(f"{section}.{f.name} {problem} (is {value!r}){why}")
    return problems
