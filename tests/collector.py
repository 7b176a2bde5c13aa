"""Tests of what reference counting alone frees: a learner's large heap
makes full collections rare, so memory that only the collector can free
(a reference cycle) stays for minutes."""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def collector_disabled() -> Iterator[None]:
    """No garbage collection inside (what was garbage before is collected
    first, so that nothing older is mistaken for what the block left)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def python_holders(obj: object) -> list[object]:
    """The objects the collector knows of that refer to ``obj`` (frames,
    containers, instances' dicts), but for the caller's frame: what keeps it
    alive on the Python side, whatever a library's C++ side also holds."""
    caller = sys._getframe(1)
    return [holder for holder in gc.get_referrers(obj) if holder is not caller]
