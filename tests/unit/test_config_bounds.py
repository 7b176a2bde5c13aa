"""Bounds declared on configuration fields (protocol/bounds.py): every field
out of its range is named at once, with its value and what the bound
protects; the sections that declare them validate with them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from learner.config import LearnerConfig
from protocol.bounds import bound_problems, bounded
from replay.config import ReplayConfig
from starting_points.config import BootstrapConfig


@dataclass
class Example:
    rate: float = bounded(0.1, gt=0)
    share: float = bounded(0.5, ge=0, le=1, why="a fraction")
    free: int = 3


@pytest.mark.parametrize("changes, expected", [
    ({}, []),
    ({"rate": 0.0}, ["example.rate must be > 0 (is 0.0)"]),
    ({"share": 1.5}, ["example.share must be <= 1 (is 1.5): a fraction"]),
    ({"rate": -1.0, "share": -0.5, "free": -9},
     ["example.rate must be > 0 (is -1.0)", "example.share must be >= 0 (is -0.5): a fraction"]),
])
def test_every_field_out_of_range_is_named_with_its_value(changes: dict,
                                                          expected: list[str]) -> None:
    assert bound_problems(Example(**changes), "example") == expected


@pytest.mark.parametrize("config, section, field", [
    (LearnerConfig(lam=1.5), "learner", "lam"),
    (LearnerConfig(minibatches=0), "learner", "minibatches"),
    (ReplayConfig(max_staleness=-1, durable_log=False), "replay", "max_staleness"),
    (ReplayConfig(max_buffer_bytes=1000, durable_log=False), "replay", "max_buffer_bytes"),
    (BootstrapConfig(drop_fact_probability=2.0), "bootstrap", "drop_fact_probability"),
])
def test_sections_validate_with_their_declared_bounds(config: object, section: str,
                                                      field: str) -> None:
    [problem] = config.validate(section)
    assert problem.startswith(f"{section}.{field} must be ")


def test_the_defaults_are_within_their_bounds() -> None:
    for config, section in ((LearnerConfig(), "learner"), (ReplayConfig(), "replay"),
                            (BootstrapConfig(), "bootstrap")):
        assert bound_problems(config, section) == []
