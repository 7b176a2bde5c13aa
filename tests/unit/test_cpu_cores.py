"""On a CPU-only machine ``compactionrl up`` gives each local actor a core
of its own and the learner the cores left, as a cluster gives each its own
devices."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.children import Child
from deploy.config import load_config
from deploy.placement import placement_lines
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


def test_up_says_which_cores_and_gpus_each_process_is_given_as_it_starts_them(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    up = cpu_up(monkeypatch, tmp_path, 2, ["--actors.count", "1"])
    started: list[str] = []
    for child in (up.replay, up.learner, *up.actors):
        child.start = lambda child=child: started.append(child.name)  # type: ignore[method-assign]
    up._start_first()
    assert capsys.readouterr().out.splitlines() == [
        "placement (the CPU cores and GPUs each process is given):",
        "  replay   any core, no GPU",
        "  learner  core 1, no GPU",
        "  actor-0  core 0, no GPU",
        "  every core is pinned: an actor added by hand here shares one with the process "
        "pinned there"]
    assert started == ["replay", "learner", "actor-0"]


def test_the_placement_names_gpus_and_the_cores_no_process_is_pinned_to() -> None:
    log = Path("log")
    children = [Child("replay", [], log), Child("learner", [], log, cores=frozenset({2, 3})),
                Child("actor-0", [], log, cores=frozenset({0})),
                Child("actor-1", [], log, env={"CUDA_VISIBLE_DEVICES": "4,5"})]
    assert placement_lines(children, [0, 1, 2, 3, 4])[1:] == [
        "  replay   any core, no GPU",
        "  learner  cores 2, 3, no GPU",
        "  actor-0  core 0, no GPU",
        "  actor-1  any core, GPUs 4,5 (CUDA_VISIBLE_DEVICES)",
        "  cores no process is pinned to: 1, 4"]
