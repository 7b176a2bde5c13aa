"""No code of the project writes ``os.environ`` while its process runs
other threads (glibc's ``setenv`` against a concurrent ``getenv`` can
crash): each write is in one of a few places that run at a process's start,
and settings meant for a child go through ``protocol.environment`` around
that child's start, or are passed to ``exec``."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.environ_writes import Aliases, writes

ROOT = Path(__file__).resolve().parents[2]
#: The project's code (its tests may set up their own processes' environments).
PACKAGES = ("actors", "replay", "learner", "protocol", "deploy", "ops", "bench",
            "starting_points")
#: Where an ``os.environ`` write is allowed, and why.
WRITERS = {
    "protocol/environment.py:environment": "the one mechanism, around a child's start",
    "actors/engine.py:quiet_vllm_logging": "a command's own start, before vLLM is imported",
    "bench/gpu_parts/raw_ipc.py:shared_device_rank": "a member process's own start",
    "bench/gpu_parts/weight_group.py:group_member": "a member process's own start",
}
#: Where ``protocol.environment.environment`` is used, and why.
USERS = {
    "actors/engine.py:engine_process_started": "vLLM's engine process starts meanwhile",
}


def _places(kind: str) -> dict[str, int]:
    """``file:function`` -> how many ``kind`` ("write" or "use") it holds."""
    found: dict[str, int] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            if kind == "use" and "from protocol.environment import environment" not in text:
                continue  # another function of that name
            tree = ast.parse(text, str(path))
            aliases = Aliases.of(tree)
            for function in ast.walk(tree):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if kind == "write" and writes(node, aliases) or kind == "use" and _uses(node):
                        key = f"{path.relative_to(ROOT)}:{function.name}"
                        found[key] = found.get(key, 0) + 1
    return found


def _uses(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "environment")


def test_os_environ_is_written_only_where_a_process_starts() -> None:
    assert set(_places("write")) <= set(WRITERS), set(_places("write")) - set(WRITERS)


def test_a_child_s_settings_are_set_only_around_its_start() -> None:
    assert set(_places("use")) == set(USERS)
