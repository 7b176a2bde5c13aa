"""A test process computes on its own cores only: under ``pytest -n N``
each xdist worker is pinned to its share of the cores (tests/conftest.py),
and torch, imported before the pin, must not keep more threads than that
share (two threads on one core made every in-process training step about 30
times slower)."""

from __future__ import annotations

import os

import torch


def test_torch_runs_no_more_threads_than_the_process_has_cores() -> None:
    assert torch.get_num_threads() <= len(os.sched_getaffinity(0))
