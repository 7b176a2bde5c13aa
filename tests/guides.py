"""The code a guide in docs/ prints, read so that a test runs it as printed."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parents[1]


def guide_block(document: str, heading: str, language: str) -> str:
    """The first fenced ``language`` block after ``heading`` in ``document``
    (a path from the repository root)."""
    text = (ROOT / document).read_text()
    section = text[text.index(heading):]
    opening = f"```{language}\n"
    start = section.index(opening) + len(opening)
    return section[start:section.index("```\n", start)]
