"""Environment variables set for a while: a child process started meanwhile
inherits them, and the caller's own settings come back after. The one place
the project writes ``os.environ`` once a process runs
(tests/unit/test_environment_writes.py): glibc's ``setenv`` is not safe
against another thread's ``getenv``, so it is used only where a child
starts (vLLM's engine process)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def environment(changes: Mapping[str, str | None]) -> Iterator[None]:
    """``changes`` set inside (None: unset); each variable restored after,
    or removed if it was not set."""
    saved = {name: os.environ.get(name) for name in changes}
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
