"""The GPUs a device plan is for: one or several types, each a count of GPUs
of one memory size (``compactionrl up --plan --fleet h100=8x79.6,a100-40=8x39.4``).

GPU indices count across the types in the order given: with the fleet
above, 0-7 are the H100s and 8-15 the A100s, as on one machine whose CUDA
order lists them so; ``learner.gpus`` and ``actors.gpus`` name them so.
Where each type is a node or a pool of its own (Kubernetes' per-type actor
Deployments, ``deploy/k8s``), the plan's lanes say which processes go on
which type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from deploy.memory_plan import GIB

#: One type of a ``--fleet``: a name, a count and each GPU's memory in GiB.
TYPE_PATTERN = re.compile(r"(?P<name>[a-z][a-z0-9_.-]*)=(?P<count>\d+)x(?P<gib>\d+(\.\d+)?)")
#: The name of the one type of a fleet given by a count alone (``--gpus N``).
UNNAMED = "gpu"


@dataclass(frozen=True)
class GpuType:
    """GPUs of one kind in a fleet."""

    name: str
    """A label, e.g. ``h100`` or ``a100-40`` (as k8s's compactionrl/gpu-type)."""
    count: int
    memory_bytes: int | None
    """Each GPU's memory as torch reports it (an H100 80GB: 79.6 GiB); None: unknown."""

    def describe(self) -> str:
        size = f"{self.memory_bytes / GIB:.1f} GiB" if self.memory_bytes else "size unknown"
        return f"{self.count} x {self.name} ({size})"


@dataclass(frozen=True)
class Fleet:
    """The GPU types of a plan, in the order their indices count."""

    types: tuple[GpuType, ...]

    @classmethod
    def uniform(cls, count: int, memory_bytes: int | None = None) -> Fleet:
        """``count`` GPUs of one size (none: the CPU)."""
        return cls((GpuType(UNNAMED, count, memory_bytes),) if count else ())

    @property
    def size(self) -> int:
        return sum(t.count for t in self.types)

    @property
    def named(self) -> bool:
        """Whether the types have names of their own (``--fleet``)."""
        return any(t.name != UNNAMED for t in self.types)

    @property
    def subject(self) -> str:
        """How a refusal names these GPUs: a fleet given (``--fleet``) is not
        this machine's."""
        return "the fleet" if self.named else "this machine"

    def indices(self, gpu_type: GpuType) -> range:
        """The GPU indices of ``gpu_type``."""
        start = 0
        for t in self.types:
            if t is gpu_type:
                return range(start, start + t.count)
            start += t.count
        raise KeyError(gpu_type.name)

    def types_of(self, devices: tuple[int, ...]) -> list[GpuType]:
        """The distinct types of ``devices`` within the fleet, in fleet order."""
        return [t for t in self.types if set(devices) & set(self.indices(t))]

    def describe(self) -> str:
        return ", ".join(t.describe() for t in self.types)

    def to_json(self) -> list[dict[str, str | int | None]]:
        return [{"name": t.name, "count": t.count, "memory_bytes": t.memory_bytes}
                for t in self.types]


def parse_fleet(text: str) -> Fleet:
    """``NAME=COUNTxGIB[,NAME=COUNTxGIB...]``, e.g. ``h100=8x79.6,a100-40=8x39.4``
    (GiB as torch reports a GPU's memory). Raises ValueError naming the
    format."""
    types = []
    for part in text.split(","):
        match = TYPE_PATTERN.fullmatch(part.strip().lower())
        if not match or not int(match["count"]) or not float(match["gib"]):
            raise ValueError(f"{part.strip()!r} is not NAME=COUNTxGIB with a count and a size "
                             "above 0 (e.g. h100=8x79.6,a100-40=8x39.4)")
        types.append(GpuType(match["name"], int(match["count"]),
                             int(float(match["gib"]) * GIB)))
    names = [t.name for t in types]
    if len(set(names)) < len(names):
        raise ValueError(f"{text!r} names a type twice: give each type once, with its count")
    return Fleet(tuple(types))
