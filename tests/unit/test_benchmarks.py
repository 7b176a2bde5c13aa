"""The benchmarks' layout. ``python bench/NAME.py`` puts ``bench/`` first on
the import path, so a file there named after a module shadows it for every
benchmark: ``bench/learner.py`` once made ``bench/actor.py`` fail with "No
module named 'learner.advantages'; 'learner' is not a package". No file in
``bench/`` may take a module's name, and none edits the import path instead.

The benchmarks themselves run, as the README documents them, in
tests/integration/test_documented_commands.py."""

from __future__ import annotations

import importlib.machinery
import sys
import tomllib
from pathlib import Path

from tests.scripts import import_script

ROOT = Path(__file__).parents[2]
BENCH = ROOT / "bench"


def top_level_packages() -> set[str]:
    """The project's top-level packages: the folders at the root with an
    ``__init__.py``, and what pyproject.toml's package finder includes."""
    folders = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    included = project["tool"]["setuptools"]["packages"]["find"]["include"]
    return folders | {pattern.rstrip("*").rstrip(".") for pattern in included}


def benchmarks() -> list[Path]:
    return sorted(BENCH.glob("*.py"))


def test_the_package_list_is_what_the_project_has() -> None:
    packages = top_level_packages()
    assert {"protocol", "actors", "replay", "learner", "ops", "deploy", "tests"} <= packages
    assert "bench" not in packages  # bench/ is scripts, not a package
    assert benchmarks()


def installed(name: str) -> bool:
    """Whether a module ``name`` is found on the import path, ``bench/`` left
    out. Not ``importlib.util.find_spec``, which answers from ``sys.modules``
    first: once a test has loaded a benchmark (tests/scripts.py), its
    ``_options`` is there, and this test failed or passed by the order the
    suite ran in."""
    path = [entry for entry in sys.path if Path(entry or ".").resolve() != BENCH]
    return importlib.machinery.PathFinder.find_spec(name, path) is not None


def test_no_benchmark_is_named_after_a_module() -> None:
    """Not a package of ours, not the standard library's, nothing installed."""
    clashes = {path.name: reason for path in benchmarks() for reason in (
        "a package of this project" if path.stem in top_level_packages() else None,
        "a standard-library module" if path.stem in sys.stdlib_module_names else None,
        "an installed module" if installed(path.stem) else None,
    ) if reason}
    assert not clashes, f"bench/ files that shadow a module: {clashes}"


def test_no_benchmark_edits_the_import_path() -> None:
    edits = [path.name for path in benchmarks() if "sys.path" in path.read_text()]
    assert not edits, f"bench/ files editing sys.path: {edits}"


def test_a_size_left_unset_is_the_full_run_s_or_the_smoke_test_s_and_a_given_one_stays() -> None:
    options = import_script(BENCH / "_options.py", "_options")
    parser = options.BenchmarkParser("a benchmark", quick="smoke test")
    parser.add_size("--episodes", 200, 8, "episodes", type=int)
    parser.add_size("--receivers", [1, 2, 4], [1], "receivers", type=int, nargs="+")
    full, quick, given = (parser.parse_args(argv) for argv in (
        [], ["--quick"], ["--quick", "--episodes", "3", "--receivers", "5", "6"]))
    assert (full.episodes, full.receivers, full.quick, full.json) == (200, [1, 2, 4], False, False)
    assert (quick.episodes, quick.receivers) == (8, [1])
    assert (given.episodes, given.receivers) == (3, [5, 6])
    assert "episodes: 200 (--quick: 8)" in parser.format_help()
