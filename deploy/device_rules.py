"""What is wrong with a run's GPU settings whatever the machine: checked when
the configuration loads (``JobConfig.problems``), before any GPU is counted.
The plan on a machine with a given number of GPUs is
:mod:`deploy.device_plan`'s, which applies these rules first."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.config import ActorConfig
    from learner.config import LearnerConfig


def static_device_problems(learner: LearnerConfig, actors: ActorConfig) -> list[str]:
    """What is wrong whatever the machine: the GPU lists against the ranks,
    the engines and the transport. Checked when the configuration loads."""
    problems = []
    tp = actors.engine.tensor_parallel
    for name, ids in (("learner.gpus", learner.gpus), ("actors.gpus", actors.gpus)):
        if any(g < 0 for g in ids):
            problems.append(f"{name} = {ids}: GPU indices are >= 0")
        twice = sorted({g for g in ids if ids.count(g) > 1})
        if twice:
            problems.append(
                f"{name} = {ids} lists GPU {join_ids(twice)} twice: "
                + ("each learner rank needs a GPU of its own (NCCL refuses two ranks of one "
                   "group on one device)" if name == "learner.gpus" else
                   "each GPU serves one engine (a second engine fails vLLM's free-memory "
                   "check at start)") + ": list distinct GPUs")
    if learner.gpus and len(learner.gpus) != learner.nproc:
        problems.append(f"learner.gpus = {learner.gpus} lists {len(learner.gpus)} GPUs for "
                        f"learner.nproc = {learner.nproc} ranks: list one GPU per rank, or "
                        "leave it empty (the first learner.nproc GPUs)")
    if learner.gpus and learner.device == "cpu":
        problems.append(f"learner.gpus = {learner.gpus} with learner.device = \"cpu\": empty "
                        "learner.gpus, or set learner.device = \"auto\"")
    if actors.gpus and tp >= 1:
        if len(actors.gpus) % tp:
            problems.append(f"actors.gpus = {actors.gpus} ({len(actors.gpus)} GPUs) is not a "
                            f"whole number of engines of actors.engine.tensor_parallel = {tp}: "
                            f"list a multiple of {tp} GPUs, or change tensor_parallel to divide "
                            "them")
        elif len(actors.gpus) // tp != actors.count:
            problems.append(f"actors.gpus = {actors.gpus} makes {len(actors.gpus) // tp} engines "
                            f"of tensor_parallel {tp} for actors.count = {actors.count}: list "
                            f"count x tensor_parallel = {actors.count * tp} GPUs, or leave it "
                            "empty (the GPUs after the learner's)")
    shared = sorted(set(learner.gpus) & set(actors.gpus))
    if shared and learner.weight_transport == "nccl":
        problems.append(two_nccl_ranks(shared))
    return problems


def two_nccl_ranks(shared: list[int]) -> str:
    return (f"GPU {join_ids(shared)} would hold a learner rank and an engine, two NCCL ranks on "
            "one device, which NCCL refuses: set learner.weight_transport = \"auto\" (ipc for "
            "co-location), or give the actors GPUs of their own (actors.gpus)")


def join_ids(values: Sequence[int]) -> str:
    return ", ".join(map(str, values))
