"""On a CPU-only machine ``compactionrl up`` gives each local actor engine a
core of its own and the learner the cores left, as a cluster gives each its
own devices."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.config import load_config
from deploy.up import Up


def cpu_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cores: int,
           overrides: list[str]) -> Up:
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    monkeypatch.setattr(Up, "_on_gpu", staticmethod(lambda: False))
    return Up(load_config(None, overrides), tmp_path, interactive=False)


@pytest.mark.parametrize(("cores", "actors", "nproc", "threads"), [
    (2, 1, 1, "1"),   # this machine: one core each
    (8, 2, 1, "6"),
    (8, 2, 2, "3"),   # ranks share the free cores
    (4, 6, 1, "1"),   # more engines than cores: the learner still has a thread
])
def test_learner_threads_are_the_cores_no_engine_is_bound_to(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cores: int, actors: int, nproc: int,
        threads: str) -> None:
    up = cpu_up(monkeypatch, tmp_path, cores, ["--actors.count", str(actors),
                                               "--learner.nproc", str(nproc)])
    assert up.learner.env == {"OMP_NUM_THREADS": threads}
    assert [a.args[a.args.index("--actors.engine.cpu_threads_bind") + 1] for a in up.actors] == [
        str(i % cores) for i in range(actors)]


def test_explicit_engine_binding_leaves_threads_to_the_user(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    up = cpu_up(monkeypatch, tmp_path, 2, ["--actors.engine.cpu_threads_bind", "0-1"])
    assert up.learner.env == {}
    assert "--actors.engine.cpu_threads_bind" not in up.actors[0].args
