"""Which GPUs each process of ``compactionrl up`` gets, and how weights travel.

:func:`plan_devices` is plain arithmetic on the configuration and the number
of GPUs present (``up`` asks ``torch.cuda.device_count()``; ``up --plan
--gpus N`` previews a machine with N): the learner's GPUs (``learner.gpus``,
or the first ``learner.nproc``), each actor's (``actors.gpus``, or the GPUs
after the learner's, ``actors.engine.tensor_parallel`` each), the weight
transport ``learner.weight_transport = "auto"`` stands for, each engine's
``gpu_memory_utilization`` and the order of the starts. Every child gets its
GPUs as ``CUDA_VISIBLE_DEVICES``: without it, every process lands on GPU 0.

Co-location (a learner rank and an engine on one GPU, the usual single-GPU
set-up) is a plan of its own: the weights go over CUDA IPC (NCCL refuses two
ranks of one group on one device), the engine takes what the learner leaves
(``learner.gpu_memory_fraction``), and it starts first: vLLM measures the
free memory while it starts and fails if another process allocates or frees
meanwhile.

A plan that cannot work is refused with every reason, each naming the fix
(``DevicePlan.problems``); those that need no count of GPUs are
:func:`deploy.device_rules.static_device_problems`, checked when the
configuration loads.

Usage::

    plan = plan_devices(config, gpus_present=8)
    if plan.problems: ...
    plan.process("actor-0").env(os.environ.get("CUDA_VISIBLE_DEVICES"))
    print(plan.table())
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from deploy.device_rules import join_ids, static_device_problems, two_nccl_ranks
from deploy.memory_plan import (
    GIB,
    ModelShape,
    engine_memory,
    learner_rank_memory,
    memory_problems,
    pass_tokens,
)
from learner.config import SHARED_GPU_RANKS_ENV, memory_switches
from protocol.transport import bound_endpoint

if TYPE_CHECKING:
    from actors.config import ActorConfig
    from deploy.config import JobConfig
    from learner.config import LearnerConfig

Transport = Literal["gloo", "nccl", "ipc"]


@dataclass(frozen=True)
class ProcessPlan:
    """One process ``up`` starts."""

    name: str
    """``replay``, ``learner``, ``actor-I``."""
    devices: tuple[int, ...] = ()
    """GPU indices as ``up`` sees them; empty: the CPU (no CUDA_VISIBLE_DEVICES)."""
    parallel: int = 1
    """Learner: its ranks (FSDP2); actor: the engine's tensor parallel; replay: 1."""
    ports: tuple[int, ...] = ()
    """TCP ports it listens on (its metrics port included)."""
    weight_transport: Transport | None = None
    """How it sends (learner) or receives (actor) weights; None for the replay."""
    gpu_memory_utilization: float | None = None
    """The engine's share of its GPUs (actors on GPU); None otherwise."""
    waits_for: tuple[str, ...] = ()
    """Processes whose engines must be ready before this one starts."""
    shared_ranks: tuple[int, ...] = ()
    """Learner: its local ranks whose GPU an engine shares (co-location);
    each caps its allocator at ``learner.gpu_memory_fraction``."""
    memory: str = ""
    """What it needs of its GPU (:mod:`deploy.memory_plan`); empty on the CPU
    or where the model's shape or the GPUs' size is unknown."""

    def env(self, inherited: str | None = None) -> dict[str, str]:
        """Its ``CUDA_VISIBLE_DEVICES`` (nothing on the CPU), and for a
        learner on a shared GPU the ranks that cap their memory
        (``learner.config.SHARED_GPU_RANKS_ENV``). ``inherited``: the
        variable as ``up`` got it, if set: the plan's indices count within
        it, as ``torch.cuda.device_count()`` did."""
        if not self.devices:
            return {}
        env = {"CUDA_VISIBLE_DEVICES": cuda_visible_devices(self.devices, inherited)}
        if self.shared_ranks:
            env[SHARED_GPU_RANKS_ENV] = ",".join(str(rank) for rank in self.shared_ranks)
        return env


@dataclass(frozen=True)
class DevicePlan:
    """Every process of the run on this machine; ``problems`` non-empty: refused."""

    gpus_present: int
    weight_transport: Transport
    processes: tuple[ProcessPlan, ...]
    problems: tuple[str, ...] = ()
    colocated: tuple[str, ...] = field(default=())
    """Actors whose engine shares a GPU with a learner rank."""
    memory_note: str = ""
    """Why the memory arithmetic was not done, where it was not."""

    def process(self, name: str) -> ProcessPlan:
        return next(p for p in self.processes if p.name == name)

    def to_json(self, inherited: str | None = None) -> dict:
        """What ``up --plan --json`` prints; ``inherited`` as in :meth:`ProcessPlan.env`."""
        return {"gpus_present": self.gpus_present, "weight_transport": self.weight_transport,
                "colocated": list(self.colocated), "problems": list(self.problems),
                "memory_note": self.memory_note,
                "processes": [{**asdict(p), "devices": list(p.devices), "ports": list(p.ports),
                               "waits_for": list(p.waits_for), "env": p.env(inherited)}
                              for p in self.processes]}

    def table(self, inherited: str | None = None) -> str:
        """The plan as ``up --plan`` prints it."""
        where = f"{self.gpus_present} GPU{'s' if self.gpus_present != 1 else ''}"
        head = (f"device plan for {where}: weights over {self.weight_transport}"
                + (f"; co-located: {', '.join(self.colocated)}" if self.colocated else ""))
        rows = [("process", "CUDA_VISIBLE_DEVICES", "parallel", "ports", "weights",
                 "gpu memory", "starts")]
        for p in self.processes:
            parallel = (f"{p.parallel} rank{'s' if p.parallel != 1 else ''}" if p.name == "learner"
                        else f"TP {p.parallel}" if p.name.startswith("actor") else "-")
            rows.append((p.name, p.env(inherited).get("CUDA_VISIBLE_DEVICES", "- (CPU)"),
                         parallel,
                         " ".join(map(str, p.ports)) or "-", p.weight_transport or "-",
                         "-" if p.gpu_memory_utilization is None
                         else f"{p.gpu_memory_utilization:.2f}",
                         f"after {', '.join(p.waits_for)} ready" if p.waits_for else "first"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
                 .rstrip() for row in rows]
        memory = [f"memory, {p.name}: {p.memory}" for p in self.processes if p.memory]
        if self.memory_note:
            memory.append(f"memory: {self.memory_note}")
        return "\n".join([head, *lines, *memory])


def cuda_visible_devices(devices: Sequence[int], inherited: str | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``devices``, counted within ``inherited``
    (``up``'s own setting) when there is one: a child's setting replaces the
    parent's, so index 0 under ``CUDA_VISIBLE_DEVICES=2,3`` is GPU 2."""
    visible = [d.strip() for d in (inherited or "").split(",") if d.strip()]
    return ",".join(visible[d] if visible else str(d) for d in devices)


def plan_devices(config: JobConfig, gpus_present: int, gpu_bytes: int | None = None
                 ) -> DevicePlan:
    """The plan of ``compactionrl up`` for ``config`` on a machine with
    ``gpus_present`` GPUs (0: the CPU plan, as today: gloo, no
    CUDA_VISIBLE_DEVICES, core pinning left to ``up``) of ``gpu_bytes``
    each (None: unknown, memory not checked)."""
    learner, actors = config.learner, config.actors
    problems = static_device_problems(learner, actors) + _machine_problems(config, gpus_present)
    learner_on_gpu = gpus_present > 0 and learner.device != "cpu"
    learner_gpus = _learner_gpus(learner, learner_on_gpu, gpus_present, problems)
    actor_gpus = _actor_gpus(actors, gpus_present, learner_gpus, problems)
    learner_set = set(learner_gpus)
    colocated = [i for i, gpus in enumerate(actor_gpus) if learner_set & set(gpus)]
    transport = _transport(learner, actors, learner_on_gpu, learner_gpus, actor_gpus, colocated,
                           problems)
    memory = _memory(config, learner_on_gpu, gpu_bytes, bool(colocated), problems)
    processes = _processes(config, learner_gpus, actor_gpus, colocated, transport, memory)
    if colocated and not actors.metrics_port:
        problems.append("co-location starts the learner once the engine answers on its metrics "
                        "port, and actors.metrics_port = 0 turns it off: set actors.metrics_port")
    return DevicePlan(gpus_present, transport, processes, tuple(problems),
                      tuple(f"actor-{i}" for i in colocated), memory.note)


def _machine_problems(config: JobConfig, gpus_present: int) -> list[str]:
    """What ``config`` asks of devices that a machine with ``gpus_present``
    GPUs does not have."""
    learner, actors = config.learner, config.actors
    problems = []
    if learner.device == "cuda" and gpus_present == 0:
        problems.append("learner.device = \"cuda\" but this machine has no GPU: set "
                        "learner.device = \"auto\" (the CPU here) or plan for a GPU machine "
                        "(--gpus N)")
    if gpus_present == 0 and actors.engine.tensor_parallel > 1 and actors.count:
        problems.append(f"actors.engine.tensor_parallel = {actors.engine.tensor_parallel} on a "
                        "machine without GPUs: set it to 1 (the CPU engine)")
    for name, ids in (("learner.gpus", learner.gpus), ("actors.gpus", actors.gpus)):
        beyond = [g for g in ids if g >= gpus_present]
        if beyond:
            have = f"GPUs 0-{gpus_present - 1}" if gpus_present else "no GPU"
            fix = (f"list GPUs below {gpus_present}" if gpus_present
                   else f"empty {name} to run on the CPU")
            problems.append(f"{name} = {ids} names GPU {join_ids(beyond)}, but this machine has "
                            f"{have}: {fix}")
    return problems


def _learner_gpus(learner: LearnerConfig, on_gpu: bool, gpus_present: int,
                  problems: list[str]) -> tuple[int, ...]:
    """The learner's GPUs: listed, or the first ``nproc``; none on the CPU."""
    if not on_gpu:
        return ()
    if not learner.gpus and learner.nproc > gpus_present:
        problems.append(f"learner.nproc = {learner.nproc} ranks need a GPU each; this "
                        f"machine has {gpus_present}: lower learner.nproc")
    return tuple(learner.gpus) or tuple(range(min(learner.nproc, gpus_present)))


def _actor_gpus(actors: ActorConfig, gpus_present: int, learner_gpus: tuple[int, ...],
                problems: list[str]) -> list[tuple[int, ...]]:
    """Each actor's GPUs (``tensor_parallel`` each): listed, or the GPUs
    after the learner's, or the learner's first for one actor where no GPU
    is left (co-location); none on the CPU."""
    tp = max(1, actors.engine.tensor_parallel)
    none: list[tuple[int, ...]] = [() for _ in range(actors.count)]
    if not gpus_present or not actors.count:
        return none
    if actors.gpus:  # a list of the wrong length was refused before
        return ([tuple(actors.gpus[i * tp:(i + 1) * tp]) for i in range(actors.count)]
                if len(actors.gpus) == actors.count * tp else none)
    free = [g for g in range(gpus_present) if g not in learner_gpus]
    needed = actors.count * tp
    if len(free) >= needed:
        return [tuple(free[i * tp:(i + 1) * tp]) for i in range(actors.count)]
    if not free and actors.count == 1 and tp == 1 and learner_gpus:
        return [(learner_gpus[0],)]  # one GPU for both: co-location
    problems.append(
        f"actors.count = {actors.count} engines of actors.engine.tensor_parallel = "
        f"{tp} need {needed} GPUs besides the learner's {len(learner_gpus)}; this "
        f"machine has {len(free)} left of {gpus_present}: lower actors.count or "
        "learner.nproc, or list actors.gpus (an actor on learner rank 0's GPU "
        "shares it: co-location)")
    return none


def _processes(config: JobConfig, learner_gpus: tuple[int, ...],
               actor_gpus: list[tuple[int, ...]], colocated: list[int], transport: Transport,
               memory: _Memory) -> tuple[ProcessPlan, ...]:
    """The replay's, the learner's and each actor's plan."""
    learner, actors, engine = config.learner, config.actors, config.actors.engine
    # the engine on a shared GPU takes what the learner leaves
    shared_share = round(1.0 - learner.gpu_memory_fraction, 4)
    processes = [ProcessPlan("replay", ports=_ports(
        config.replay.actor_address, config.replay.learner_address, config.replay.metrics_port))]
    processes.append(ProcessPlan(
        "learner", devices=learner_gpus, parallel=learner.nproc,
        ports=_ports(learner.control_address, learner.weight_store_address,
                     learner.metrics_port),
        weight_transport=transport,
        waits_for=tuple(f"actor-{i}" for i in colocated),
        shared_ranks=tuple(rank for rank, gpu in enumerate(learner_gpus)
                           if any(gpu in actor_gpus[i] for i in colocated)),
        memory=memory.learner))
    for i, gpus in enumerate(actor_gpus):
        share = None
        if gpus:
            share = (min(engine.gpu_memory_utilization, shared_share) if i in colocated
                     else engine.gpu_memory_utilization)
        processes.append(ProcessPlan(
            f"actor-{i}", devices=gpus, parallel=engine.tensor_parallel,
            ports=(actors.metrics_port + i,) if actors.metrics_port else (),
            weight_transport=transport, gpu_memory_utilization=share,
            memory=memory.engine(share) if gpus else ""))
    return tuple(processes)


@dataclass(frozen=True)
class _Memory:
    """The memory arithmetic's lines for the plan (empty where not done)."""

    learner: str = ""
    note: str = ""
    shape: ModelShape | None = None
    config: JobConfig | None = None
    gpu_bytes: int = 0

    def engine(self, share: float | None) -> str:
        if self.shape is None or self.config is None or share is None:
            return ""
        return engine_memory(self.shape, self.config.actors, self.gpu_bytes, share).describe()


def _memory(config: JobConfig, learner_on_gpu: bool, gpu_bytes: int | None, shared: bool,
            problems: list[str]) -> _Memory:
    """The learner rank's and the engines' memory on GPUs of ``gpu_bytes``
    (:mod:`deploy.memory_plan`); a learner rank that does not fit is refused
    into ``problems``."""
    if gpu_bytes is None:
        return _Memory(note="not checked: the GPUs' size is unknown (--gpu-memory-gib)")
    shape = ModelShape.of(config.run.model)
    if shape is None:
        return _Memory(note=f"not checked: no config.json in run.model ({config.run.model})")
    lines = _Memory(shape=shape, config=config, gpu_bytes=gpu_bytes)
    if not learner_on_gpu:
        return lines
    chunk, microbatch = memory_switches(config.learner, on_gpu=True)
    rank = learner_rank_memory(shape, config.learner, pass_tokens(
        config.learner, config.actors, config.replay, microbatch), chunk)
    budget = int(gpu_bytes * (config.learner.gpu_memory_fraction if shared else 1.0))
    problems += memory_problems(rank, budget)
    return _Memory(f"{rank.describe()} (of {budget / GIB:.1f} GiB)", "", shape, config,
                   gpu_bytes)


def _transport(learner: LearnerConfig, actors: ActorConfig, learner_on_gpu: bool,
               learner_gpus: tuple[int, ...], actor_gpus: list[tuple[int, ...]],
               colocated: list[int], problems: list[str]) -> Transport:
    """What ``learner.weight_transport`` is on this plan: gloo when the
    learner is on the CPU (ipc there if asked: shared memory), ipc when an
    engine shares learner rank 0's GPU, nccl otherwise; an explicit choice
    the plan cannot carry is refused."""
    requested = learner.weight_transport
    if not learner_on_gpu:
        if requested == "nccl":
            problems.append("learner.weight_transport = \"nccl\" needs the learner on a "
                            "GPU, and it runs on the CPU here: set it to \"auto\" (gloo)")
        # ipc on the CPU: staging files in this host's memory (up runs one host)
        return "ipc" if requested == "ipc" else "gloo"
    if colocated:
        shared = sorted(set(learner_gpus) & {g for i in colocated for g in actor_gpus[i]})
        if requested == "nccl":
            if not (learner.gpus and actors.gpus):  # explicit lists: refused at load already
                problems.append(two_nccl_ranks(shared))
            return "nccl"
        if requested == "gloo":  # through the CPU: any sharing works, slowly
            return "gloo"
        rank0 = learner_gpus[0]
        for i in colocated:
            if actor_gpus[i] != (rank0,):
                problems.append(
                    f"actor {i} on GPU {join_ids(actor_gpus[i])} shares the learner's GPUs, but "
                    f"ipc hands the weights from learner rank 0 (GPU {rank0}) to an engine on "
                    f"that one GPU: put actor {i} on GPU {rank0} alone (tensor_parallel 1), or "
                    "give it GPUs of its own")
        apart = [i for i in range(len(actor_gpus)) if i not in colocated]
        if apart:
            problems.append(
                f"actor {join_ids(apart)} on GPUs of their own beside co-located actor "
                f"{join_ids(colocated)}: one run has one weight transport (ipc to the co-located "
                "engine, nccl to the others): co-locate one actor alone, or give every actor "
                "GPUs of its own")
        return "ipc"
    if requested == "ipc":
        problems.append("learner.weight_transport = \"ipc\" needs an engine on learner rank 0's "
                        "GPU, and no actor shares one: set it to \"auto\" (nccl here), or list "
                        f"actors.gpus = [{learner_gpus[0]}] with actors.count = 1")
        return "nccl"
    return "nccl" if requested == "auto" else requested


def _ports(*endpoints: str | int) -> tuple[int, ...]:
    """The TCP ports among addresses (``tcp://HOST:PORT``, ``HOST:PORT``) and
    port numbers (0: off); ipc endpoints take none."""
    ports = []
    for endpoint in endpoints:
        if isinstance(endpoint, int):
            if endpoint:
                ports.append(endpoint)
            continue
        bound = bound_endpoint(endpoint)
        if bound.startswith("port ") and bound[5:].isdigit():
            ports.append(int(bound[5:]))
    return tuple(ports)
