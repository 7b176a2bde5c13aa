"""How a weight broadcast travels, shared by the learner and the actors.

Learner rank 0 hosts a ``TCPStore``. Every publication goes to one *group
generation*: a process group (gloo on CPU, NCCL on GPU) made of rank 0 (rank 0
of the group) and the current actors, formed under the store prefix
``weights/<generation>``, beside the learner's own default group. A new
generation is formed whenever the member set changes.

Tensors go in manifest order. With ``bucket_bytes == 0`` each tensor is one
broadcast (fastest on gloo, where packing only adds copies); otherwise
consecutive tensors are packed into flat byte buffers of at most
``bucket_bytes`` (the norm on NCCL), a tensor larger than a bucket travelling
alone. Both sides cut buckets with :func:`buckets` from the announced manifest,
never from a value of their own.

Usage (rank 0, then every actor with its rank)::

    store = host_store(port)
    group = WeightGroup(store, generation=3, world_size=3, rank=0, backend="gloo")
    group.send(manifest, (p.full_tensor() for p in params))
    ...
    group = WeightGroup(connect_store(host, port), 3, 3, rank=1, backend="gloo")
    for name, tensor in group.receive(manifest, device):
        ...
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from protocol.messages import TensorSpec, WeightManifest

#: Each tensor starts at a multiple of this many bytes inside a bucket, so
#: that it can be viewed in its own dtype without a copy.
BUCKET_ALIGN_BYTES = 16

#: Default bound on joining a generation and on each broadcast: a member that
#: died makes the others fail after this long instead of hanging.
GROUP_TIMEOUT_S = 30.0


def host_store(port: int, timeout_s: float = GROUP_TIMEOUT_S) -> dist.TCPStore:
    """The rendezvous store, on learner rank 0 (listens on every interface)."""
    return dist.TCPStore("0.0.0.0", port, None, is_master=True,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def connect_store(host: str, port: int, timeout_s: float = GROUP_TIMEOUT_S) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def buckets(manifest: WeightManifest) -> list[list[int]]:
    """Indices of the manifest's tensors, grouped into broadcasts."""
    if manifest.bucket_bytes == 0:
        return [[i] for i in range(len(manifest.tensors))]
    cut: list[list[int]] = []
    size = 0
    for index, spec in enumerate(manifest.tensors):
        nbytes = _aligned(nbytes_of(spec))
        if not cut or size + nbytes > manifest.bucket_bytes:
            cut.append([])
            size = 0
        cut[-1].append(index)
        size += nbytes
    return cut


def dtype_of(spec: TensorSpec) -> torch.dtype:
    dtype = getattr(torch, spec.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor {spec.name!r}: unknown dtype {spec.dtype!r}")
    return dtype


def nbytes_of(spec: TensorSpec) -> int:
    return dtype_of(spec).itemsize * int(torch.Size(spec.shape).numel())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // BUCKET_ALIGN_BYTES) * BUCKET_ALIGN_BYTES


def manifest_of(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> WeightManifest:
    return WeightManifest(
        tensors=[TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                 for name, t in named],
        bucket_bytes=bucket_bytes)


class WeightGroup:
    """One generation of the broadcast group, as seen by one member."""

    def __init__(self, store: dist.Store, generation: int, world_size: int, rank: int,
                 backend: str = "gloo", timeout_s: float = GROUP_TIMEOUT_S) -> None:
        """Join; returns when every member has joined (or raises after ``timeout_s``)."""
        timeout = timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(f"weights/{generation}", store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            self.device = torch.device("cpu")
        self.rank = rank
        self.generation = generation

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._group.broadcast(tensor, 0).wait()

    def send(self, manifest: WeightManifest, tensors: Iterable[torch.Tensor]) -> None:
        """Rank 0: broadcast ``tensors`` (in manifest order, consumed lazily so
        that at most one bucket is held)."""
        stream = iter(tensors)
        for indices in buckets(manifest):
            if len(indices) == 1:
                self._broadcast(next(stream).to(self.device).contiguous())
                continue
            specs = [manifest.tensors[i] for i in indices]
            flat = torch.zeros(sum(_aligned(nbytes_of(s)) for s in specs), dtype=torch.uint8,
                               device=self.device)
            offset = 0
            for spec in specs:
                size = nbytes_of(spec)
                flat[offset: offset + size] = (next(stream).to(self.device).contiguous()
                                               .view(-1).view(torch.uint8))
                offset += _aligned(size)
            self._broadcast(flat)

    def receive(self, manifest: WeightManifest) -> Iterator[tuple[str, torch.Tensor]]:
        """Members: the manifest's tensors as they arrive, on this group's device."""
        for indices in buckets(manifest):
            specs = [manifest.tensors[i] for i in indices]
            if len(specs) == 1:
                tensor = torch.empty(specs[0].shape, dtype=dtype_of(specs[0]),
                                     device=self.device)
                self._broadcast(tensor)
                yield specs[0].name, tensor
                continue
            flat = torch.empty(sum(_aligned(nbytes_of(s)) for s in specs),
                               dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            offset = 0
            for spec in specs:
                size = nbytes_of(spec)
                yield spec.name, flat[offset: offset + size].view(dtype_of(spec)).view(spec.shape)
                offset += _aligned(size)
