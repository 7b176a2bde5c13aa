"""The packages depend one way (README, "Layout"): what each imports of the
others, read from the source (every import, at module level or inside a
function), is within what its layer may import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
#: Each package and the packages of ours it may import.
ALLOWED = {
    "protocol": set(),
    "ops": set(),
    "actors": {"protocol", "ops"},
    "replay": {"protocol", "ops"},
    "learner": {"protocol", "ops"},
    "recipes": {"protocol", "ops", "actors"},
    "deploy": {"protocol", "ops", "actors", "replay", "learner", "recipes"},
}


def imported_packages(package: str) -> dict[str, set[str]]:
    """Per package of ours that ``package`` imports, the files that do."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in ALLOWED and top != package:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_package_imports_only_the_layers_below_it() -> None:
    wrong = {package: {other: files for other, files in imported_packages(package).items()
                       if other not in ALLOWED[package]}
             for package in ALLOWED}
    assert not any(wrong.values()), wrong


def test_the_table_knows_every_package() -> None:
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == set(ALLOWED)
