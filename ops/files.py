"""Files that a crash must never leave half-written."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary name beside ``path``, fsync, rename over ``path``,
    fsync the folder: readers see the old content or the new, never a part."""
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def write_section(path: Path, name: str, text: str) -> None:
    """Put ``text`` between the lines ``<!-- begin NAME -->`` and ``<!-- end
    NAME -->`` of ``path`` (created if missing), replacing what they held, or
    append the marked section: a document whose parts different scripts
    generate, each rewriting only its own."""
    begin, end = f"<!-- begin {name} -->\n", f"<!-- end {name} -->\n"
    section = begin + text.rstrip("\n") + "\n" + end
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old.split(begin, 1)[1]:
        before, rest = old.split(begin, 1)
        new = before + section + rest.split(end, 1)[1]
    else:
        new = old + ("\n" if old and not old.endswith("\n\n") else "") + section
    atomic_write_text(path, new)
