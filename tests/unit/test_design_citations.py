"""Every citation of docs/design.md in the repository names a section that
exists there (``docs/design.md §2.3``, or a range ``§2.1-2.2``), and no file
cites a design document the repository does not hold."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
#: Where code, configuration and documentation live (not the virtual
#: environment, not generated results).
CITING = ("*.py", "*.md", "*.toml", "Makefile")
CITATION = re.compile(r"docs/design\.md §(\d+(?:\.\d+)*)(?:-(\d+(?:\.\d+)*))?")


def _files() -> list[Path]:
    skipped = {".venv", ".git", "runs", "node_modules"}
    return [path for pattern in CITING for path in ROOT.rglob(pattern)
            if not skipped.intersection(path.relative_to(ROOT).parts)]


def _sections() -> set[str]:
    return set(re.findall(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", DESIGN.read_text(), re.MULTILINE))


def test_every_citation_names_a_section_of_the_design_document() -> None:
    sections = _sections()
    assert {"2.1", "2.2", "2.3", "2.4", "3.3", "4"} <= sections
    cited: dict[str, list[str]] = {}
    for path in _files():
        for match in CITATION.finditer(path.read_text(errors="replace")):
            for number in filter(None, match.groups()):
                cited.setdefault(number, []).append(str(path.relative_to(ROOT)))
    assert cited, "no file cites docs/design.md"
    missing = {number: files for number, files in cited.items() if number not in sections}
    assert not missing, f"cited sections docs/design.md does not have: {missing}"


def test_no_file_cites_a_design_document_outside_the_repository() -> None:
    outside = [str(path.relative_to(ROOT)) for path in _files()
               if re.search(r"\bDESIGN(\.md)? ?§", path.read_text(errors="replace"))]
    assert outside == []
