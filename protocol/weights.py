"""How a weight broadcast travels, shared by the learner and the actors.

Learner rank 0 hosts a ``TCPStore``. Every publication goes to one *group
generation*: a process group (gloo on CPU, NCCL on GPU) made of rank 0 (rank 0
of the group) and the current actors, formed under the store prefix
``weights/<generation>``, beside the learner's own default group. A new
generation is formed whenever the member set changes.

Tensors go in manifest order, in the manifest's dtypes: the *wire* dtype,
which for floating-point tensors is the receiving engines' own (bf16 to a
bf16 engine), converted once per tensor by the sender, never fp32 master
weights to a bf16 engine. With ``bucket_bytes == 0`` each tensor is one
broadcast (fastest on gloo, where packing only adds copies); otherwise
consecutive tensors are packed into flat byte buffers of at most
``bucket_bytes`` (the norm on NCCL), a tensor larger than a bucket travelling
alone. Both sides cut buckets with :func:`buckets` from the announced manifest,
never from a value of their own.

Ranks: the sender is rank 0; each member engine holds as many consecutive
ranks as it has workers (tensor parallel), every worker receiving the full
tensors (vLLM's loader takes each worker's shard): :func:`member_ranks`,
:func:`worker_rank`.

Every broadcast completes within ``timeout_s`` or the group is aborted and
:class:`TransferFailed` raised (:func:`wait_within`): the same explicit wait
on gloo and NCCL, whose ``wait()`` does not block the host.

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

import time
from collections.abc import Iterable, Iterator, Sequence
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


class TransferFailed(RuntimeError):
    """A broadcast failed or did not complete in time; the group is aborted."""


def member_ranks(workers: Sequence[int]) -> tuple[list[int], int]:
    """Group ranks of member engines with ``workers[i]`` workers each: rank 0
    is the sender, member ``i``'s workers hold ``bases[i] .. bases[i] +
    workers[i] - 1``. Returns ``(bases, world_size)``."""
    if any(w < 1 for w in workers):
        raise ValueError(f"every engine has at least one worker, got {list(workers)}")
    bases, next_rank = [], 1
    for count in workers:
        bases.append(next_rank)
        next_rank += count
    return bases, next_rank


def worker_rank(base: int, worker: int) -> int:
    """The group rank of an engine's ``worker`` (its rank within the engine,
    vLLM's ``parallel_config.rank``) when the engine's base rank is ``base``."""
    return base + worker


def wait_within(work: dist.Work, timeout_s: float) -> None:
    """Until ``work`` completes; raises :class:`TimeoutError` after
    ``timeout_s`` (and the op's own error if it failed). Polls: an NCCL work's
    ``wait()`` only orders streams, it neither blocks the host nor times out."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"a broadcast did not complete in {timeout_s:g} s")
        time.sleep(pause)
        pause = min(0.001, pause + 0.0001)
    work.wait()


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def manifest_of(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                wire_dtype: torch.dtype | None = None) -> WeightManifest:
    """The manifest of ``named``; floating-point tensors travel in
    ``wire_dtype`` (None: their own)."""
    return WeightManifest(
        tensors=[TensorSpec(name, dtype_name(wire_dtype if wire_dtype is not None
                                             and t.is_floating_point() else t.dtype),
                            tuple(t.shape))
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
        self.timeout_s = timeout_s

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            wait_within(self._group.broadcast(tensor, 0), self.timeout_s)
        except (RuntimeError, TimeoutError) as exc:  # torch's DistError is a RuntimeError
            self.abort()
            raise TransferFailed(f"generation {self.generation}: {exc}") from exc

    def abort(self) -> None:
        """Abort the communicator (NCCL: ``ncclCommAbort``; the process stays
        healthy); the group is unusable afterwards."""
        try:
            self._group.abort()
        except RuntimeError:
            pass

    def sender(self, manifest: WeightManifest) -> BucketSender:
        """Rank 0: a publication fed tensor by tensor (several groups can be fed
        the same tensors in lockstep, each in its own wire dtype)."""
        return BucketSender(self, manifest)

    def send(self, manifest: WeightManifest, tensors: Iterable[torch.Tensor]) -> None:
        """Rank 0: broadcast ``tensors`` (in manifest order, consumed lazily so
        that at most one bucket is held); raises :class:`TransferFailed`."""
        sender = self.sender(manifest)
        for index, tensor in enumerate(tensors):
            sender.add(index, tensor)
        sender.finish()

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


class BucketSender:
    """One publication into one group, fed tensor by tensor in manifest order.

    Each tensor is converted to its wire dtype as it is packed (once per
    group); a bucket is broadcast when its last tensor arrives, so at most
    one bucket is held. After a failure it ignores the rest (``error`` says
    why), so that the caller can go on feeding the other groups."""

    def __init__(self, group: WeightGroup, manifest: WeightManifest) -> None:
        self.group = group
        self.manifest = manifest
        self.error: TransferFailed | None = None
        self._cuts = buckets(manifest)
        self._bucket = 0
        self._flat: torch.Tensor | None = None
        self._offset = 0

    def add(self, index: int, tensor: torch.Tensor) -> None:
        if self.error is not None:
            return
        indices = self._cuts[self._bucket]
        if index not in indices:
            raise ValueError(f"tensor {index} out of manifest order (bucket {indices})")
        spec = self.manifest.tensors[index]
        wire = tensor.to(self.group.device, dtype_of(spec)).contiguous()
        try:
            if len(indices) == 1:
                self.group._broadcast(wire)
            else:
                if self._flat is None:
                    size = sum(_aligned(nbytes_of(self.manifest.tensors[i])) for i in indices)
                    self._flat = torch.zeros(size, dtype=torch.uint8, device=self.group.device)
                    self._offset = 0
                nbytes = nbytes_of(spec)
                self._flat[self._offset: self._offset + nbytes] = wire.view(-1).view(torch.uint8)
                self._offset += _aligned(nbytes)
                if index == indices[-1]:
                    self.group._broadcast(self._flat)
                    self._flat = None
        except TransferFailed as exc:
            self.error = exc
            return
        if index == indices[-1]:
            self._bucket += 1

    def finish(self) -> None:
        """Raises the failure, if any, or if tensors are missing."""
        if self.error is not None:
            raise self.error
        if self._bucket != len(self._cuts):
            raise ValueError(f"{len(self._cuts) - self._bucket} buckets were never filled")
