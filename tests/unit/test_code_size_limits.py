"""Rooms a reader can hold in their head (README, "Layout"): no class over
:data:`MAX_CLASS_LINES` lines in the runtime packages, and no function over
:data:`MAX_FUNCTION_LINES` lines anywhere in the project's code, counted from
the ``class``/``def`` line to the last line of the body (Python's ``ast``).

Two kinds of function are exempt by design: the command-line parser (one
table of options) and the ``__init__`` of a metrics class (one table of
metric declarations)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 60
#: Where the class limit holds: the packages that run in a training run.
CLASS_PACKAGES = ("actors", "replay", "learner", "protocol", "deploy")
#: Where the function limit holds: all of the project's code but its tests.
FUNCTION_PACKAGES = (*CLASS_PACKAGES, "ops", "starting_points", "bench")
#: Tables, not logic: the argument parser and metric declarations.
EXEMPT = {("deploy/cli.py", "build_parser")}


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _sizes(tree: ast.AST, kinds: tuple[type, ...]) -> list[tuple[str, int]]:
    """(name, lines) of every definition of ``kinds`` in ``tree``, nested ones too."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, kinds)]


def _definitions(packages: tuple[str, ...], kinds: tuple[type, ...]
                 ) -> list[tuple[str, str, int]]:
    """(file, name, lines) of every definition of ``kinds`` in ``packages``."""
    found = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            file = str(path.relative_to(ROOT))
            found += [(file, name, lines)
                      for name, lines in _sizes(ast.parse(path.read_text(), file), kinds)]
    return found


def _exempt(file: str, name: str) -> bool:
    return (file, name) in EXEMPT or (Path(file).name == "metrics.py" and name == "__init__")


def test_no_class_is_longer_than_the_limit() -> None:
    long = [(file, name, lines) for file, name, lines in _definitions(
        CLASS_PACKAGES, (ast.ClassDef,)) if lines > MAX_CLASS_LINES]
    assert not long, long


def test_no_function_is_longer_than_the_limit() -> None:
    long = [(file, name, lines) for file, name, lines in _definitions(
        FUNCTION_PACKAGES, FUNCTIONS)
        if lines > MAX_FUNCTION_LINES and not _exempt(file, name)]
    assert not long, long


def test_the_count_runs_from_the_definition_to_its_last_line() -> None:
    """A method one line over the function limit, in a class one line over
    the class limit: both counted, the method as a function too."""
    method = "    async def step(self):\n" + "        x = 1\n" * MAX_FUNCTION_LINES
    padding = "    y = 1\n" * (MAX_CLASS_LINES - MAX_FUNCTION_LINES - 1)
    tree = ast.parse("class Long:\n" + padding + method)
    assert _sizes(tree, (ast.ClassDef,)) == [("Long", MAX_CLASS_LINES + 1)]
    assert _sizes(tree, FUNCTIONS) == [("step", MAX_FUNCTION_LINES + 1)]
