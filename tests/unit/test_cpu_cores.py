"""On a CPU-only machine ``compactionrl up`` gives each local actor a core
of its own and the learner the cores left, as a cluster gives each its own
devices."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.config import load_config
from deploy.up import Up


def cpu_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cores: int,
           overrides: list[str]) -> Up:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr("deploy.placement.on_gpu", lambda: False)
    return Up(load_config(None, overrides), tmp_path, interactive=False)


@pytest.mark.parametrize(("cores", "actors", "nproc", "actor_cores", "learner_cores", "threads"), [
    (2, 1, 1, [0], {1}, "1"),                   # this machine: one core each
    (8, 2, 1, [0, 1], {2, 3, 4, 5, 6, 7}, "6"),
    (8, 2, 2, [0, 1], {2, 3, 4, 5, 6, 7}, "3"),  # ranks share the learner's cores
    (4, 6, 1, [0, 1, 2, 0, 1, 2], {3}, "1"),     # more actors than cores: the last is the learner's
    (1, 2, 1, [0, 0], {0}, "1"),
])
def test_actors_get_a_core_each_and_the_learner_the_rest(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cores: int, actors: int, nproc: int,
        actor_cores: list[int], learner_cores: set[int], threads: str) -> None:
    up = cpu_up(monkeypatch, tmp_path, cores, ["--actors.count", str(actors),
                                               "--learner.nproc", str(nproc)])
    assert [set(actor.cores) for actor in up.actors] == [{core} for core in actor_cores]
    assert [actor.args[actor.args.index("--actors.engine.cpu_threads_bind") + 1]
            for actor in up.actors] == [str(core) for core in actor_cores]
    assert up.learner.cores == learner_cores
    assert up.learner.env == {"OMP_NUM_THREADS": threads}


def test_an_explicit_engine_binding_leaves_placement_to_the_user(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    up = cpu_up(monkeypatch, tmp_path, 2, ["--actors.engine.cpu_threads_bind", "0-1"])
    assert up.learner.env == {} and not up.learner.cores
    assert "--actors.engine.cpu_threads_bind" not in up.actors[0].args and not up.actors[0].cores
