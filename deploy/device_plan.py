"""Which GPUs each process of ``compactionrl up`` gets, and how weights travel.

:func:`plan_devices` is plain arithmetic on the configuration and the GPUs:
a count (``up`` asks ``torch.cuda.device_count()``; ``up --plan --gpus N``
previews a machine with N) or a fleet of several types
(:mod:`deploy.fleet`; ``up --plan --fleet h100=8x79.6,a100-40=8x39.4``).
It decides the learner's GPUs (``learner.gpus``, or ``learner.nproc`` of
one type: the largest where a rank fits), each actor's (``actors.gpus``,
or the GPUs left after the learner's, in the fleet's order,
``actors.engine.tensor_parallel`` of one type each), the weight transport
``learner.weight_transport = "auto"`` stands for, each engine's
``gpu_memory_utilization`` and the order of the starts. Every child gets its
GPUs as ``CUDA_VISIBLE_DEVICES``: without it, every process lands on GPU 0.

Co-location (a learner rank and an engine on one GPU, the usual single-GPU
set-up) is a plan of its own: the weights go over CUDA IPC (NCCL refuses two
ranks of one group on one device), the engine takes what the learner leaves
(``learner.gpu_memory_fraction``), and it starts first: vLLM measures the
free memory while it starts and fails if another process allocates or frees
meanwhile.

Where the GPUs' sizes and the model's shape are known, each process's
memory is sized (:mod:`deploy.memory_plan`). A plan that cannot work is
refused with every reason (``DevicePlan.problems``, the last lines of
``up --plan``'s table), each naming the fixes the configuration does not
have yet; a fix that moves processes names every other setting it then
needs for each process to get its GPUs, or says that none is left for the
engines. Those that need no count of GPUs are
:func:`deploy.device_rules.static_device_problems`, checked when the
configuration loads.

Usage::

    plan = plan_devices(config, 8)  # or parse_fleet("h100=8x79.6,a100-40=8x39.4")
    if plan.problems: ...
    plan.process("actor-0").env(os.environ.get("CUDA_VISIBLE_DEVICES"))
    print(plan.table())
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from deploy.device_rules import join_ids, static_device_problems, two_nccl_ranks
from deploy.fleet import Fleet, GpuType
from deploy.memory_plan import (
    GIB,
    NO_ENGINE,
    EngineMemory,
    Fix,
    LearnerHostMemory,
    LearnerRankMemory,
    Widening,
    engine_memory,
    engine_memory_problems,
    learner_host_memory,
    learner_memory_problems,
    learner_need,
)
from deploy.model_shapes import ModelShape
from learner.config import SHARED_GPU_RANKS_ENV
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
    gpu_type: str = ""
    """The fleet's type of its GPUs (:mod:`deploy.fleet`); empty on the CPU."""
    memory: LearnerRankMemory | EngineMemory | None = None
    """What it needs of each GPU (:mod:`deploy.memory_plan`); None on the CPU
    or where the model's shape or the GPUs' size is unknown."""
    memory_budget: int = 0
    """Bytes of each GPU it may use: a learner rank's GPU (its
    ``learner.gpu_memory_fraction`` of a shared one), an engine's share."""

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

    def describe_memory(self) -> str:
        """Its memory as ``up --plan`` prints it; empty where not sized."""
        if isinstance(self.memory, LearnerRankMemory):
            return f"{self.memory.describe()} (of {self.memory_budget / GIB:.1f} GiB)"
        return self.memory.describe() if self.memory else ""

    def to_json(self, inherited: str | None = None) -> dict[str, Any]:
        """Its part of ``up --plan --json``: memory in bytes, as numbers."""
        memory = (None if self.memory is None
                  else {**self.memory.to_json(), "budget_bytes": self.memory_budget})
        return {"name": self.name, "devices": list(self.devices), "gpu_type": self.gpu_type,
                "parallel": self.parallel, "ports": list(self.ports),
                "weight_transport": self.weight_transport,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "waits_for": list(self.waits_for), "shared_ranks": list(self.shared_ranks),
                "memory": memory, "env": self.env(inherited)}


@dataclass(frozen=True)
class DevicePlan:
    """Every process of the run on its GPUs; ``problems`` non-empty: refused."""

    fleet: Fleet
    weight_transport: Transport
    processes: tuple[ProcessPlan, ...]
    problems: tuple[str, ...] = ()
    colocated: tuple[str, ...] = field(default=())
    """Actors whose engine shares a GPU with a learner rank."""
    memory_note: str = ""
    """Why the memory arithmetic was not done, where it was not."""
    shape: ModelShape | None = None
    """The model's shape the memory was sized for."""
    unplaced: tuple[str, ...] = ()
    """Processes that need GPUs and got none: the plan refuses them."""
    learner_host: LearnerHostMemory | None = None
    """What a learner node's host memory holds for checkpoints and exports
    (a learner on GPUs, the model's shape known)."""

    @property
    def gpus_present(self) -> int:
        return self.fleet.size

    def process(self, name: str) -> ProcessPlan:
        return next(p for p in self.processes if p.name == name)

    def lanes(self) -> list[tuple[GpuType, list[str], int]]:
        """Per GPU type: the processes on it, and its GPUs left free."""
        lanes = []
        for gpu_type in self.fleet.types:
            own = set(self.fleet.indices(gpu_type))
            on = [p for p in self.processes if own & set(p.devices)]
            used = own & {d for p in on for d in p.devices}
            lanes.append((gpu_type, [p.name for p in on], len(own - used)))
        return lanes

    def to_json(self, inherited: str | None = None) -> dict[str, Any]:
        """What ``up --plan --json`` prints; ``inherited`` as in :meth:`ProcessPlan.env`."""
        return {"gpus_present": self.gpus_present, "fleet": self.fleet.to_json(),
                "weight_transport": self.weight_transport,
                "colocated": list(self.colocated), "problems": list(self.problems),
                "memory_note": self.memory_note,
                "model_shape": self.shape.source if self.shape else None,
                "learner_host": self.learner_host.to_json() if self.learner_host else None,
                "lanes": [{"gpu_type": t.name, "processes": names, "free": free}
                          for t, names, free in self.lanes()],
                "unplaced": list(self.unplaced),
                "processes": [p.to_json(inherited) for p in self.processes]}

    def table(self, inherited: str | None = None) -> str:
        """The plan as ``up --plan`` prints it."""
        where = (self.fleet.describe() if self.fleet.named
                 else f"{self.gpus_present} GPU{'s' if self.gpus_present != 1 else ''}")
        head = (f"device plan for {where}: "
                + (f"REFUSED ({len(self.problems)} reason{'s' if len(self.problems) != 1 else ''}"
                   " at the end); " if self.problems else "")
                + f"weights over {self.weight_transport}"
                + (f"; co-located: {', '.join(self.colocated)}" if self.colocated else ""))
        lanes = [f"lane {t.describe()}: {_span(names) or 'nothing'}; {free} free"
                 for t, names, free in self.lanes()] if self.fleet.named else []
        rows = [_row(p, inherited) for p in self.processes if p.name not in self.unplaced]
        unplaced = ([f"not placed: {_span(list(self.unplaced))}, for want of GPUs: the plan is "
                     "refused (at the end)"] if self.unplaced else [])
        memory = [f"memory, {_span(names)}{f' on {gpu_type}' if self.fleet.named else ''}: {text}"
                  for names, gpu_type, text in _groups(self.processes)]
        if self.memory_note:
            memory.append(f"memory: {self.memory_note}")
        if self.learner_host is not None:
            memory.append(f"memory: {self.learner_host.describe()}")
        if self.shape is not None:
            memory.append(f"memory sized for {self.shape.source}")
        refused = [f"REFUSED: {problem}" for problem in self.problems]
        return "\n".join([head, *lanes, *_aligned(rows), *unplaced, *memory, *refused])


def _row(p: ProcessPlan, inherited: str | None) -> tuple[str, ...]:
    """A process's row of the plan's table."""
    parallel = (f"{p.parallel} rank{'s' if p.parallel != 1 else ''}" if p.name == "learner"
                else f"TP {p.parallel}" if p.name.startswith("actor") else "-")
    return (p.name, p.env(inherited).get("CUDA_VISIBLE_DEVICES", "- (CPU)"), parallel,
            " ".join(map(str, p.ports)) or "-", p.weight_transport or "-",
            "-" if p.gpu_memory_utilization is None else f"{p.gpu_memory_utilization:.2f}",
            f"after {', '.join(p.waits_for)} ready" if p.waits_for else "first")


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """The table's lines under its header, in columns."""
    # The engines' column is a share of each GPU, not a size: it carries the setting's name.
    rows = [("process", "CUDA_VISIBLE_DEVICES", "parallel", "ports", "weights",
             "gpu_memory_utilization", "starts"), *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            .rstrip() for row in rows]


def _groups(processes: Sequence[ProcessPlan]) -> list[tuple[list[str], str, str]]:
    """(names, GPU type, memory) of each run of processes whose memory reads
    the same: eight actors of one type are one line."""
    groups: list[tuple[list[str], str, str]] = []
    for p in processes:
        text = p.describe_memory()
        if not text:
            continue
        if groups and groups[-1][1:] == (p.gpu_type, text):
            groups[-1][0].append(p.name)
        else:
            groups.append(([p.name], p.gpu_type, text))
    return groups


def _span(names: list[str]) -> str:
    """The names, a run of three or more consecutive actors as ``actor-0 to actor-7``."""
    actors = [n for n in names if n.startswith("actor-")]
    rest = [n for n in names if not n.startswith("actor-")]
    numbers = [int(n.removeprefix("actor-")) for n in actors]
    run = len(actors) > 2 and numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    return ", ".join([*rest, f"{actors[0]} to {actors[-1]}"] if run else [*rest, *actors])


def cuda_visible_devices(devices: Sequence[int], inherited: str | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``devices``, counted within ``inherited``
    (``up``'s own setting) when there is one: a child's setting replaces the
    parent's, so index 0 under ``CUDA_VISIBLE_DEVICES=2,3`` is GPU 2."""
    visible = [d.strip() for d in (inherited or "").split(",") if d.strip()]
    return ",".join(visible[d] if visible else str(d) for d in devices)


def plan_devices(config: JobConfig, gpus: int | Fleet, shape: ModelShape | None = None
                 ) -> DevicePlan:
    """The plan of ``compactionrl up`` for ``config`` on ``gpus``: a count of
    GPUs of unknown size (0: the CPU plan, as today: gloo, no
    CUDA_VISIBLE_DEVICES, core pinning left to ``up``), or a fleet whose
    types give each GPU's size. ``shape``: the model's (None: from
    run.model's config.json, where it is on this machine)."""
    fleet = gpus if isinstance(gpus, Fleet) else Fleet.uniform(gpus)
    learner, actors = config.learner, config.actors
    shape = shape or ModelShape.of(config.run.model)
    problems = static_device_problems(learner, actors) + _machine_problems(config, fleet)
    learner_on_gpu = fleet.size > 0 and learner.device != "cpu"
    need = (learner_need(shape, learner, actors, config.replay).total
            if shape and learner_on_gpu else None)
    learner_gpus = _learner_gpus(learner, learner_on_gpu, fleet, need, problems)
    actor_gpus = _actor_gpus(actors, fleet, learner_gpus, problems)
    problems += _spanning_problems(fleet, learner_gpus, actor_gpus)
    learner_set = set(learner_gpus)
    colocated = [i for i, gpus in enumerate(actor_gpus) if learner_set & set(gpus)]
    transport = _transport(learner, actors, learner_on_gpu, learner_gpus, actor_gpus, colocated,
                           problems)
    processes = _processes(config, fleet, learner_gpus, actor_gpus, colocated, transport)
    processes, note = _sized(config, fleet, shape, processes, problems)
    if colocated and not actors.metrics_port:
        problems.append("co-location starts the learner once the engine answers on its metrics "
                        "port, and actors.metrics_port = 0 turns it off: set actors.metrics_port")
    unplaced = tuple(f"actor-{i}" for i, gpus in enumerate(actor_gpus) if fleet.size and not gpus)
    sized = any(p.memory for p in processes)
    host = (learner_host_memory(shape, learner)
            if sized and shape is not None and learner_on_gpu else None)
    return DevicePlan(fleet, transport, processes, tuple(problems),
                      tuple(f"actor-{i}" for i in colocated), note,
                      shape if sized else None, unplaced, host)


def _machine_problems(config: JobConfig, fleet: Fleet) -> list[str]:
    """What ``config`` asks of devices that ``fleet`` (a machine's GPUs, or
    a fleet given) does not have."""
    learner, actors = config.learner, config.actors
    gpus_present = fleet.size
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
            problems.append(f"{name} = {ids} names GPU {join_ids(beyond)}, but {fleet.subject} "
                            f"has {have}: {fix}")
    return problems


def _learner_gpus(learner: LearnerConfig, on_gpu: bool, fleet: Fleet, need: int | None,
                  problems: list[str]) -> tuple[int, ...]:
    """The learner's GPUs: listed, or ``nproc`` of one type (the largest
    whose GPUs hold a rank's ``need``, or the largest where none does: the
    memory check refuses it there); none on the CPU."""
    if not on_gpu:
        return ()
    if learner.gpus:
        return tuple(learner.gpus)
    enough = [t for t in fleet.types if t.count >= learner.nproc]
    fitting = [t for t in enough if need is None or not t.memory_bytes or need <= t.memory_bytes]
    home = max(fitting or enough, key=lambda t: t.memory_bytes or 0, default=None)
    if home is None:
        home = max(fleet.types, key=lambda t: t.count)
        where = (f"{fleet.subject} has {fleet.size}" if len(fleet.types) == 1 else
                 f"the fleet's largest type has {home.count} ({home.name}), and a learner's "
                 "ranks share one type")
        problems.append(f"learner.nproc = {learner.nproc} ranks need a GPU each; {where}: "
                        "lower learner.nproc")
    return tuple(fleet.indices(home)[:learner.nproc])


def _actor_gpus(actors: ActorConfig, fleet: Fleet, learner_gpus: tuple[int, ...],
                problems: list[str]) -> list[tuple[int, ...]]:
    """Each actor's GPUs (``tensor_parallel`` of one type each): listed, or
    the GPUs left after the learner's in the fleet's order, or the learner's
    first for one actor where no GPU is left (co-location); none on the CPU."""
    tp = max(1, actors.engine.tensor_parallel)
    none: list[tuple[int, ...]] = [() for _ in range(actors.count)]
    if not fleet.size or not actors.count:
        return none
    if actors.gpus:  # a list of the wrong length was refused before
        return ([tuple(actors.gpus[i * tp:(i + 1) * tp]) for i in range(actors.count)]
                if len(actors.gpus) == actors.count * tp else none)
    engines = _engine_slots(fleet, learner_gpus, tp)
    if len(engines) >= actors.count:
        return engines[:actors.count]
    left = len(set(range(fleet.size)) - set(learner_gpus))
    if not left and actors.count == 1 and tp == 1 and learner_gpus:
        return [(learner_gpus[0],)]  # one GPU for both: co-location
    problems.append(
        f"actors.count = {actors.count} engines of actors.engine.tensor_parallel = "
        f"{tp} need {actors.count * tp} GPUs besides the learner's {len(learner_gpus)}"
        + (" (an engine's of one type)" if len(fleet.types) > 1 else "")
        + f"; {fleet.subject} has {left} left of {fleet.size}: lower actors.count or "
        "learner.nproc, or list actors.gpus (an actor on learner rank 0's GPU "
        "shares it: co-location)")
    return none


def _engine_slots(fleet: Fleet, learner_gpus: Sequence[int], tp: int
                  ) -> list[tuple[int, ...]]:
    """The engines of ``tp`` GPUs that the GPUs beside the learner's hold, in
    the fleet's order, each of one type."""
    free = [[g for g in fleet.indices(t) if g not in learner_gpus] for t in fleet.types]
    return [tuple(gpus[i * tp:(i + 1) * tp]) for gpus in free for i in range(len(gpus) // tp)]


def _beside(actors: ActorConfig, fleet: Fleet, learner_gpus: Sequence[int]
            ) -> list[str] | None:
    """The actors' settings that must change for each actor to get its
    engine's GPUs beside a learner on ``learner_gpus``, as the plan places
    them: listed GPUs the learner leaves alone are kept; otherwise the GPUs
    left, in the fleet's order, ``actors.count`` lowered where fewer engines
    fit. None where no engine fits: a fix that leaves the actors nothing."""
    tp = max(1, actors.engine.tensor_parallel)
    listed = list(actors.gpus)
    if listed and len(listed) == actors.count * tp and not set(listed) & set(learner_gpus):
        return []
    engines = _engine_slots(fleet, learner_gpus, tp)[:actors.count]
    if actors.count and not engines:
        return None
    changes = [f"actors.count = {len(engines)}"] if len(engines) < actors.count else []
    if listed:
        changes.append(f"actors.gpus = [{join_ids([g for gpus in engines for g in gpus])}]")
    return changes


def _widenings(config: JobConfig, fleet: Fleet, home: GpuType) -> list[Widening]:
    """Each count of ranks above ``learner.nproc`` that the learner's type
    holds, on its first GPUs (where the plan puts them once unlisted), with
    what the actors must change beside them."""
    widenings = []
    for nproc in range(config.learner.nproc + 1, home.count + 1):
        gpus = fleet.indices(home)[:nproc]
        beside = _beside(config.actors, fleet, gpus)
        listed = [f"learner.gpus = [{join_ids(gpus)}]"] if config.learner.gpus else []
        widenings.append(Widening(nproc, ", ".join([f"learner.nproc = {nproc}", *listed,
                                                    *(beside or ())]), beside is not None))
    return widenings


def _moved_learner(label: str, settings: list[str], effect: str, beside: list[str] | None
                   ) -> Fix:
    """The learner on other GPUs, where a rank fits, with what the actors
    then change (``beside``, as :func:`_beside` says)."""
    changes = [*settings, *(beside or ())]
    return Fix(label + (f": {', '.join(changes)}" if changes else ""),
               effect + ("" if beside is not None else f", {NO_ENGINE}"), beside is not None)


def _spanning_problems(fleet: Fleet, learner_gpus: tuple[int, ...],
                       actor_gpus: list[tuple[int, ...]]) -> list[str]:
    """Listed GPUs of two types under one process: FSDP2 gives each rank an
    equal shard and tensor parallel each GPU an equal slice, so the smaller
    type would bound them all, and the slower pace them."""
    problems = []
    for name, gpus in (("the learner", learner_gpus),
                       *((f"actor {i}", gpus) for i, gpus in enumerate(actor_gpus))):
        types = fleet.types_of(gpus)
        if len(types) > 1:
            problems.append(f"{name}'s GPUs {join_ids(gpus)} are of types "
                            f"{' and '.join(t.name for t in types)}: each rank or engine slice "
                            "gets an equal share, bounded by the smaller: list GPUs of one type "
                            "(learner.gpus, actors.gpus)")
    return problems


def _processes(config: JobConfig, fleet: Fleet, learner_gpus: tuple[int, ...],
               actor_gpus: list[tuple[int, ...]], colocated: list[int], transport: Transport
               ) -> tuple[ProcessPlan, ...]:
    """The replay's, the learner's and each actor's plan, not yet sized."""
    learner, actors, engine = config.learner, config.actors, config.actors.engine
    # the engine on a shared GPU takes what the learner leaves
    shared_share = round(1.0 - learner.gpu_memory_fraction, 4)

    def type_name(gpus: tuple[int, ...]) -> str:
        return "+".join(t.name for t in fleet.types_of(gpus))

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
        gpu_type=type_name(learner_gpus)))
    for i, gpus in enumerate(actor_gpus):
        share = None
        if gpus:
            share = (min(engine.gpu_memory_utilization, shared_share) if i in colocated
                     else engine.gpu_memory_utilization)
        processes.append(ProcessPlan(
            f"actor-{i}", devices=gpus, parallel=engine.tensor_parallel,
            ports=(actors.metrics_port + i,) if actors.metrics_port else (),
            weight_transport=transport, gpu_memory_utilization=share,
            gpu_type=type_name(gpus)))
    return tuple(processes)


def _sized(config: JobConfig, fleet: Fleet, shape: ModelShape | None,
           processes: tuple[ProcessPlan, ...], problems: list[str]
           ) -> tuple[tuple[ProcessPlan, ...], str]:
    """The processes with what each needs of its GPUs (:mod:`deploy.memory_plan`),
    a learner rank or an engine that does not fit refused into ``problems``;
    or, where the sizes or the model's shape are unknown, why not."""
    if not any(p.devices for p in processes):
        return processes, ""
    if any(not t.memory_bytes for t in fleet.types):
        return processes, "not checked: the GPUs' size is unknown (--gpu-memory-gib, --fleet)"
    if shape is None:
        return processes, (f"not checked: no config.json in run.model ({config.run.model}): "
                           "name one, its folder or a known family with --model-shape")
    sized: list[ProcessPlan] = []
    engines_refused: dict[tuple[str, str], list[str]] = {}
    # What twice the tensor parallel asks of the actors' settings: the same for every engine.
    engine = config.actors.engine
    doubled = _beside(replace(config.actors, engine=replace(
        engine, tensor_parallel=2 * engine.tensor_parallel)), fleet,
        next(p.devices for p in processes if p.name == "learner"))
    for p in processes:
        types = fleet.types_of(p.devices)
        if len(types) != 1:  # the CPU, or GPUs of two types (refused above)
            sized.append(p)
            continue
        gpu_bytes = types[0].memory_bytes or 0
        if p.name == "learner":
            sized.append(_sized_learner(config, fleet, shape, p, processes, problems))
            continue
        share = p.gpu_memory_utilization or 0.0
        for problem in engine_memory_problems(shape, config.actors, gpu_bytes, share, doubled):
            engines_refused.setdefault((p.gpu_type, problem), []).append(p.name)
        sized.append(replace(p, memory=engine_memory(shape, config.actors, gpu_bytes, share),
                             memory_budget=int(gpu_bytes * share)))
    problems += [f"{_span(names)}{f' on {gpu_type}' if fleet.named else ''}: {problem}"
                 for (gpu_type, problem), names in engines_refused.items()]
    return tuple(sized), ""


def _sized_learner(config: JobConfig, fleet: Fleet, shape: ModelShape, learner: ProcessPlan,
                   processes: tuple[ProcessPlan, ...], problems: list[str]) -> ProcessPlan:
    """The learner's plan with a rank's memory on its GPU type; refused into
    ``problems`` where it does not fit, naming more ranks of its type and the
    larger types where it fits, each with what the actors then change."""
    settings, actors, replay = config.learner, config.actors, config.replay
    [home] = fleet.types_of(learner.devices)
    gpu_bytes = home.memory_bytes or 0
    budget = int(gpu_bytes * (settings.gpu_memory_fraction if learner.shared_ranks else 1.0))
    need = learner_need(shape, settings, actors, replay)
    placements = []
    for t in fleet.types:
        if t is not home and t.count >= settings.nproc and (t.memory_bytes or 0) >= need.total:
            gpus = fleet.indices(t)[:settings.nproc]
            placements.append(_moved_learner(f"the learner on {t.name}",
                                             [f"learner.gpus = [{join_ids(gpus)}]"],
                                             f"{t.memory_bytes / GIB:.1f} GiB a GPU",
                                             _beside(actors, fleet, gpus)))
    if learner.shared_ranks and need.total <= gpu_bytes:
        placements.append(_moved_learner("the learner on GPUs of its own", [],
                                         f"{gpu_bytes / GIB:.1f} GiB a GPU",
                                         _beside(actors, fleet, learner.devices)))
    problems += learner_memory_problems(shape, settings, actors, replay, budget,
                                        _widenings(config, fleet, home), placements)
    return replace(learner, memory=need, memory_budget=budget)


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
