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
    "starting_points": {"protocol", "ops", "actors"},
    "deploy": {"protocol", "ops", "actors", "replay", "learner", "starting_points"},
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports() -> dict[str, set[str]]:
    """Per module of ours, the modules of ours it imports (every import,
    at module level, inside a function or for type checking only: each is a
    dependency a reader follows). ``from package import name`` counts as the
    submodule when ``name`` is one, else as the package."""
    paths = {_module_name(path): path for package in ALLOWED
             for path in sorted((ROOT / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        found = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{alias.name}"
                           if f"{node.module}.{alias.name}" in paths else node.module
                           for alias in node.names]
            else:
                continue
            found.update(target for target in targets if target in paths and target != module)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_back_through_others() -> None:
    """No import cycle among our modules, lazy or type-only ones included:
    an interface is imported by its implementations, never the other way."""
    assert import_cycles(module_imports()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
