"""Environment variables set for a while: what is built or started meanwhile
reads them (a process group, a child process, which inherits them), and the
caller's own settings come back after."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def environment(changes: Mapping[str, str]) -> Iterator[None]:
    """``changes`` set inside; each variable restored after, or removed if
    it was not set."""
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
