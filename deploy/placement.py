"""Where each child of ``compactionrl up`` runs: its arguments, its CPU
cores on a machine without GPUs, its environment (``CUDA_VISIBLE_DEVICES``
and the rest of the device plan's), and which child waits for which.

The device plan (:mod:`deploy.device_plan`) decides the GPUs and the weight
transport; this turns it, with the configuration, into the children that
:class:`deploy.up.Up` supervises."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deploy.children import Child
from deploy.config import JobConfig
from deploy.device_plan import DevicePlan
from deploy.device_rules import join_ids


@dataclass
class Placement:
    """The children of one run, not started yet."""

    replay: Child
    learner: Child
    actors: list[Child]
    waiting: dict[str, tuple[str, ...]]
    """Per child that must wait, the children it starts after (a learner
    beside co-located engines starts once they are up)."""


def place_children(config: JobConfig, plan: DevicePlan, run_dir: Path,
                   resume: bool) -> Placement:
    """The children of a run in ``run_dir`` under ``plan``; the learner
    resumes from its checkpoint when ``resume`` (and on every restart)."""
    logs = run_dir / "logs"
    common = ["--config", str(run_dir / "config.toml")]
    actor_cores, learner_cores = cpu_cores(config, plan)
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    learner_plan = plan.process("learner")
    transport = _transport_args(plan)
    learner_env = {**_learner_env(config, learner_cores), **learner_plan.env(inherited)}
    learner = Child("learner", ["learner", *common, *transport, *(["--resume"] if resume else [])],
                    logs / "learner.log", env=learner_env, cores=learner_cores,
                    restart_args=["learner", *common, *transport, "--resume"],
                    leader_follows=True)
    actors = [Child(f"actor-{i}", ["actor", *common, "--index", str(i), "--actor-id",
                                   f"{config.run.name}-actor-{i}",
                                   *_bind_engine(actor_cores, i), *transport,
                                   *_engine_memory(config, plan, i)],
                    logs / f"actor-{i}.log", env=plan.process(f"actor-{i}").env(inherited),
                    cores=frozenset({actor_cores[i]}) if actor_cores else frozenset())
              for i in range(config.actors.count)]
    waiting = {learner.name: learner_plan.waits_for} if learner_plan.waits_for else {}
    return Placement(Child("replay", ["replay", *common], logs / "replay.log"), learner, actors,
                     waiting)


def placement_lines(children: Sequence[Child], cores: Sequence[int]) -> list[str]:
    """Which CPU cores and GPUs each child is given, as ``up`` says when it
    starts them, and the cores of ``cores`` (this machine's) that none is
    pinned to: an actor added by hand wants a core no engine spins on."""
    width = max(len(child.name) for child in children)
    lines = ["placement (the CPU cores and GPUs each process is given):"]
    for child in children:
        gpus = child.env.get("CUDA_VISIBLE_DEVICES")
        lines.append(f"  {child.name.ljust(width)}  "
                     + (f"core{'s' if len(child.cores) > 1 else ''} "
                        f"{join_ids(sorted(child.cores))}" if child.cores else "any core")
                     + (f", GPU{'s' if ',' in gpus else ''} {gpus} (CUDA_VISIBLE_DEVICES)"
                        if gpus else ", no GPU"))
    pinned = {core for child in children for core in child.cores}
    if pinned:
        free = [core for core in cores if core not in pinned]
        lines.append(f"  cores no process is pinned to: {join_ids(free)}" if free else
                     "  every core is pinned: an actor added by hand here shares one with "
                     "the process pinned there")
    return lines


def _transport_args(plan: DevicePlan) -> list[str]:
    """The plan's weight transport for learner and actors ("auto" resolved
    here: only the plan knows of co-location). Nothing on the CPU plan."""
    if not plan.gpus_present:
        return []
    return ["--learner.weight_transport", plan.weight_transport]


def _engine_memory(config: JobConfig, plan: DevicePlan, index: int) -> list[str]:
    """A co-located engine's lowered share of its GPU."""
    memory = plan.process(f"actor-{index}").gpu_memory_utilization
    if memory is None or memory == config.actors.engine.gpu_memory_utilization:
        return []
    return ["--actors.engine.gpu_memory_utilization", str(memory)]


def cpu_cores(config: JobConfig, plan: DevicePlan) -> tuple[list[int], frozenset[int]]:
    """On a CPU-only machine (engine binding "auto"): the core of each local
    actor, round robin over all cores but the last ones, and the cores left
    to the learner — as on a cluster, where each has devices of its own.
    Engines that each spin OpenMP threads on every core starve each other
    and the learner, and a learner on an engine's core slows both. Empty
    (no placement) on GPU machines or with an explicit binding."""
    if plan.gpus_present or config.actors.engine.cpu_threads_bind != "auto":
        return [], frozenset()
    cores = sorted(os.sched_getaffinity(0))
    # at least one core is the learner's whenever there are two
    span = max(1, min(config.actors.count, len(cores) - 1))
    actor_cores = [cores[i % span] for i in range(config.actors.count)]
    return actor_cores, frozenset(cores[span:] or cores)


def _bind_engine(actor_cores: list[int], index: int) -> list[str]:
    """The engine's OpenMP threads on the actor's core."""
    return ["--actors.engine.cpu_threads_bind", str(actor_cores[index])] if actor_cores else []


def _learner_env(config: JobConfig, learner_cores: frozenset[int]) -> dict[str, str]:
    """The learner's ranks share its cores: one OpenMP thread each per core."""
    if not learner_cores:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, len(learner_cores) // config.learner.nproc))}


def on_gpu() -> bool:
    """Whether this process sees a CUDA device."""
    import torch

    return torch.cuda.is_available()


def gpus_present() -> int:
    """GPUs this process sees (within its own CUDA_VISIBLE_DEVICES)."""
    if not on_gpu():
        return 0
    import torch

    return torch.cuda.device_count()


def gpu_bytes() -> int | None:
    """The smallest GPU's memory in bytes (None without GPUs)."""
    if not gpus_present():
        return None
    import torch

    return min(torch.cuda.get_device_properties(i).total_memory
               for i in range(torch.cuda.device_count()))
