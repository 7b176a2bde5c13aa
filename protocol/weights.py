"""How weights travel from learner rank 0 to the actors' engines: the one
interface every transport implements, and what all of them share.

Learner rank 0 hosts the rendezvous store (:mod:`protocol.weights_store`: a
ZeroMQ service, CURVE-authenticated like the others, since a ``TCPStore``
lets anyone who reaches its port list and read the keys a group forms from).
Every publication goes to one *group
generation* made of rank 0 (the sender) and the current actors' engine
workers, formed under the store prefix ``weights/<generation>``; a new
generation is formed whenever the member set changes or a publication failed.
A :class:`WeightChannel` is one member's end of one generation; the transport
(``GroupInfo.backend``) says how the bytes move, one file per backend,
each importing this interface (``join_channel`` in
:mod:`protocol.weights_backends` chooses among them, so nothing imports back):

- ``gloo`` / ``nccl``: a process-group broadcast
  (:mod:`protocol.weights_collective`): any hosts, any devices;
- ``ipc``: rank 0 stages each bucket in memory the receivers map, and the
  store carries the handles and the receivers' acknowledgements
  (:mod:`protocol.weights_ipc`): CUDA IPC when an engine shares learner rank
  0's GPU, shared files on the CPU (its twin, same code but the mapping).

Tensors go in manifest order, in the manifest's dtypes: the *wire* dtype,
which for floating-point tensors is the receiving engines' own (bf16 to a
bf16 engine), converted once per tensor by the sender, never fp32 master
weights to a bf16 engine. With ``bucket_bytes == 0`` each tensor is its own
bucket; otherwise consecutive tensors are packed into flat byte buffers of at
most ``bucket_bytes``, a tensor larger than a bucket travelling alone. Both
sides cut buckets with :func:`buckets` from the announced manifest, never
from a value of their own.

Ranks: the sender is rank 0; each member engine holds as many consecutive
ranks as it has workers (tensor parallel), every worker receiving the full
tensors (vLLM's loader takes each worker's shard): :func:`member_ranks`,
:func:`worker_rank`.

Every bucket completes within ``timeout_s`` on every transport, or the
channel is aborted and :class:`TransferFailed` raised: a dead or stalled
member fails that publication, never the sender's process. Rank 0 then
abandons the generation in the store (:func:`abandon_generation`), and the
members still joining or receiving it fail at once, not at their deadline.

Usage (rank 0, then every actor with its rank; ``join_channel`` is
:func:`protocol.weights_backends.join_channel`)::

    store = host_store(port)
    channel = join_channel(store, generation=3, world_size=3, rank=0, backend="gloo")
    channel.send(manifest, (p.full_tensor() for p in params))
    ...
    channel = join_channel(connect_store(host, port), 3, 3, rank=1, backend="gloo")
    for name, tensor in channel.receive(manifest):
        ...
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from queue import Full, Queue

import torch

from protocol.messages import TensorSpec, WeightManifest
from protocol.transport import TransportConfig
from protocol.weights_store import HostedStore, StoreClient

log = logging.getLogger("compactionrl.weights")

#: Each tensor starts at a multiple of this many bytes inside a bucket, so
#: that it can be viewed in its own dtype without a copy.
BUCKET_ALIGN_BYTES = 16

#: Default bound on joining a generation and on each broadcast: a member that
#: died makes the others fail after this long instead of hanging.
GROUP_TIMEOUT_S = 30.0

#: The floating-point dtypes weights may travel in (a manifest's wire
#: dtypes), by index: learner ranks agree on one with a single integer.
WIRE_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


#: How often a member waiting on a broadcast asks the store whether rank 0
#: abandoned the generation (a broadcast that completes sooner never asks).
ABANDONED_POLL_S = 0.25

#: How often a join that may be given up (``JoinCancelled``) asks why: the
#: most a stop or a member's departure waits for the join to notice it.
JOIN_POLL_S = 0.5

#: Asked while a join or rank 0's broadcast waits for the other members: a
#: reason to give the generation up now (the learner stops; a member left),
#: or None to wait on.
JoinCancelled = Callable[[], str | None]


class TransferFailed(RuntimeError):
    """A bucket failed or did not complete in time; the channel is aborted."""


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


def host_store(port: int, timeout_s: float = GROUP_TIMEOUT_S,
               transport: TransportConfig | None = None, host: str = "127.0.0.1",
               refused: Callable[[str], None] = lambda reason: None) -> HostedStore:
    """The rendezvous store, on learner rank 0, listening on ``host:port``
    (port 0: any free one, ``.port`` says which), CURVE-authenticated when
    ``transport.curve`` is on (:mod:`protocol.weights_store`); ``refused``
    counts the requests it refuses."""
    return HostedStore(f"tcp://{host}:{port}", transport or TransportConfig(), timeout_s,
                       refused)


def connect_store(host: str, port: int, timeout_s: float = GROUP_TIMEOUT_S,
                  transport: TransportConfig | None = None) -> StoreClient:
    """A member's client of the rendezvous store at ``host:port``."""
    return StoreClient(f"tcp://{host}:{port}", transport or TransportConfig(), timeout_s)


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


def generation_store(store: StoreClient, generation: int) -> StoreClient:
    """The view of ``store`` that one group generation's keys live in."""
    return store.prefixed(f"weights/{generation}")


def join_key(rank: int) -> str:
    """The key ``rank`` sets in its generation's store as it joins."""
    return f"join/{rank}"


def ranks_not_joined(store: StoreClient, generation: int, ranks: Iterable[int]) -> list[int]:
    """Rank 0, once ``generation`` did not form (before it abandons it):
    which of ``ranks`` never joined, so that the failure is put down to the
    members that caused it, not to those that came. Never raises: none, if
    the store cannot say."""
    view = generation_store(store, generation)
    try:
        return [rank for rank in ranks if not view.check([join_key(rank)])]
    except RuntimeError as exc:  # DistStoreError
        log.warning("could not tell who never joined generation %d: %s", generation, exc)
        return []


def abandon_generation(store: StoreClient, generation: int) -> None:
    """Rank 0, once ``generation`` failed (a member never joined, or a
    broadcast failed): the members still joining or receiving fail at once
    and go on to the next generation, instead of each waiting out its
    deadline (and then joining the next one as late). Never raises: the
    deadlines still bound every wait."""
    try:
        generation_store(store, generation).abandon()
    except RuntimeError as exc:  # DistStoreError
        log.warning("could not mark generation %d abandoned: %s", generation, exc)


class WeightChannel(ABC):
    """One member's end of one group generation. Rank 0 sends, the others
    receive; a transport implements how one bucket moves (a flat ``uint8``
    buffer, or a tensor travelling alone) and how the channel is aborted."""

    device: torch.device
    """Where received tensors are (and where rank 0 packs buckets)."""

    def __init__(self, store: StoreClient, generation: int, world_size: int, rank: int,
                 timeout_s: float, cancelled: JoinCancelled | None = None) -> None:
        """``cancelled``: see :meth:`_join`."""
        self.generation = generation
        self.world_size = world_size
        self.rank = rank
        self.timeout_s = timeout_s
        self._store = generation_store(store, generation)
        self._cancelled = cancelled

    def _join(self, transport: str) -> None:
        """Returns once every member of the generation has joined (each
        sets its key in the generation's store); raises ``RuntimeError``
        after ``timeout_s``, or as soon as ``cancelled()`` gives a reason
        (asked every ``JOIN_POLL_S``: rank 0 gives up a generation whose
        member left, or when it stops, rather than wait out the deadline).
        Before the first collective: NCCL creates its communicator inside
        it, with no deadline of ours."""
        self._store.set(join_key(self.rank), "1")
        keys = [join_key(r) for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            wait_s = max(0.0, left if self._cancelled is None else min(left, JOIN_POLL_S))
            asked = time.monotonic()
            try:
                self._store.wait(keys, timedelta(seconds=wait_s))
                return
            except RuntimeError as exc:  # DistStoreError
                # sooner than asked: not a timeout (rank 0 abandoned the generation)
                early = time.monotonic() - asked < wait_s
                if early or time.monotonic() >= deadline:
                    raise RuntimeError(f"{transport} generation {self.generation} did not "
                                       f"form in {self.timeout_s:g} s: {exc}") from exc
                if self._cancelled is not None and (why := self._cancelled()):
                    raise RuntimeError(f"{transport} generation {self.generation} given up "
                                       f"while forming: {why}") from exc

    def abandoned(self, within_s: float | None = None) -> bool:
        """Members: whether rank 0 abandoned this generation, asked within
        ``within_s`` (False if the store cannot say in time: the wait's own
        deadline still holds)."""
        try:
            return self._store.abandoned(within_s)
        except RuntimeError:  # DistStoreError
            return False

    def given_up(self, within_s: float | None = None) -> bool:
        """Whether to stop waiting on a broadcast under way: for a member,
        rank 0 abandoned the generation (:meth:`abandoned`); for rank 0, the
        join's ``cancelled()`` gives a reason (a member left, its goodbye
        read, or the learner stops), so that a member gone mid-publication
        fails it now, not at the bucket's deadline."""
        if self.rank:
            return self.abandoned(within_s)
        return self._cancelled is not None and self._cancelled() is not None

    # ------------------------------------------------------------ transport
    def _bucket_buffer(self, nbytes: int) -> torch.Tensor:
        """Rank 0: a ``uint8`` buffer of ``nbytes`` to pack the next bucket into."""
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    @abstractmethod
    def _send_bucket(self, flat: torch.Tensor) -> None:
        """Rank 0: move the buffer from :meth:`_bucket_buffer` to every
        member; raises :class:`TransferFailed` (the channel aborted)."""

    @abstractmethod
    def _receive_bucket(self, nbytes: int) -> torch.Tensor:
        """Members: the next bucket's ``nbytes`` as a ``uint8`` tensor of
        their own on :attr:`device`; raises :class:`TransferFailed`."""

    def _send_tensor(self, tensor: torch.Tensor) -> None:
        """Rank 0: a tensor that is a bucket of its own (in its wire dtype)."""
        flat = self._bucket_buffer(tensor.nbytes)
        flat.copy_(tensor.reshape(-1).view(torch.uint8))
        self._send_bucket(flat)

    def _receive_tensor(self, spec: TensorSpec) -> torch.Tensor:
        return self._receive_bucket(nbytes_of(spec)).view(dtype_of(spec)).view(spec.shape)

    def _begin(self) -> None:  # noqa: B027 - most transports need no hook
        """A publication starts (both sides)."""

    def _finish_send(self) -> None:  # noqa: B027 - a broadcast is complete when sent
        """Rank 0: returns once every member holds every bucket; raises
        :class:`TransferFailed`."""

    @abstractmethod
    def abort(self) -> None:
        """Abort the channel, leaving the process healthy; it is unusable
        afterwards. Never raises."""

    # ------------------------------------------------------------ publications
    def sender(self, manifest: WeightManifest) -> BucketSender:
        """Rank 0: a publication fed tensor by tensor (several channels can be
        fed the same tensors in lockstep, each in its own wire dtype)."""
        self._begin()
        return BucketSender(self, manifest)

    def send(self, manifest: WeightManifest, tensors: Iterable[torch.Tensor]) -> None:
        """Rank 0: send ``tensors`` (in manifest order, consumed lazily so
        that at most one bucket is held); raises :class:`TransferFailed`."""
        sender = self.sender(manifest)
        for index, tensor in enumerate(tensors):
            sender.add(index, tensor)
        sender.finish()

    def receive(self, manifest: WeightManifest, ahead: int = 0
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Members: the manifest's tensors as they arrive, on :attr:`device`.
        With ``ahead > 0`` a thread receives up to ``ahead`` tensors ahead of
        the consumer, so that the next bucket travels while the engine loads
        this one (a failure is raised where the consumer reaches it)."""
        received = self._received(manifest)
        return received if ahead == 0 else received_ahead(received, ahead)

    def _received(self, manifest: WeightManifest) -> Iterator[tuple[str, torch.Tensor]]:
        self._begin()
        for indices in buckets(manifest):
            specs = [manifest.tensors[i] for i in indices]
            if len(specs) == 1:
                yield specs[0].name, self._receive_tensor(specs[0])
                continue
            flat = self._receive_bucket(sum(_aligned(nbytes_of(s)) for s in specs))
            offset = 0
            for spec in specs:
                size = nbytes_of(spec)
                yield spec.name, flat[offset: offset + size].view(dtype_of(spec)).view(spec.shape)
                offset += _aligned(size)


def hand_over(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, made by another thread's work on its device's default
    stream (a receiving thread never sets a stream of its own), made safe to
    use on the consumer's current stream: that stream waits for the
    producer's work, and the caching allocator keeps the tensor's block until
    the consumer's work on it is done (``record_stream``). Without the
    second, a block freed on the producer's side could be reused before the
    consumer's copy from it ran (vLLM's loader copies on a stream of its
    own): silent weight corruption. A CPU tensor is returned as it is."""
    if not tensor.is_cuda:
        return tensor
    producer = torch.cuda.default_stream(tensor.device)
    consumer = torch.cuda.current_stream(tensor.device)
    if consumer != producer:
        consumer.wait_stream(producer)
        tensor.record_stream(consumer)
    return tensor


def received_ahead(tensors: Iterator[tuple[str, torch.Tensor]], ahead: int
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors``, drawn by a thread of its own up to ``ahead`` items before
    the consumer; its exception, if any, is raised in the consumer. A consumer
    that stops early stops the thread at its next item. On a GPU each tensor
    is handed over from the thread's stream to the consumer's (:func:`hand_over`)."""
    queue: Queue = Queue(maxsize=ahead)
    stop = threading.Event()
    end = object()

    def put(item: object) -> bool:
        """Queue ``item`` unless the consumer has stopped."""
        while not stop.is_set():
            try:
                queue.put(item, timeout=0.1)
                return True
            except Full:
                continue
        return False

    def draw() -> None:
        try:
            for item in tensors:
                if not put(item):
                    return
            put(end)
        except BaseException as exc:  # noqa: BLE001 - raised in the consumer
            put(exc)

    thread = threading.Thread(target=draw, name="weights-receive", daemon=True)
    thread.start()
    try:
        while (item := queue.get()) is not end:
            if isinstance(item, BaseException):
                try:
                    raise item
                finally:
                    # The raised exception's traceback holds this frame: were
                    # the frame to hold the exception too, the pair (and the
                    # receiving frames' buckets the traceback keeps) would
                    # wait for a full collection instead of going with the
                    # consumer's last reference.
                    item = None
            name, tensor = item
            yield name, hand_over(tensor)
    finally:
        stop.set()
        thread.join()


def detached(exc: BaseException) -> BaseException:
    """``exc`` with no traceback along its chain of causes and contexts:
    what a failed publication keeps of its failure. A stored traceback keeps
    every frame it passed through alive, among them the one that packed or
    waited on the bucket (and, through the frame that stored it, the keeper
    itself, a cycle only a full collection frees)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc


class BucketSender:
    """One publication into one channel, fed tensor by tensor in manifest order.

    Each tensor is converted to its wire dtype as it is packed (once per
    channel); a bucket is sent when its last tensor arrives, so at most one
    bucket is held. After a failure it ignores the rest (``error`` says why,
    without its traceback) and holds no bucket, so that the caller can go on
    feeding the other channels and a failed lane costs no memory until the
    publication ends."""

    def __init__(self, channel: WeightChannel, manifest: WeightManifest) -> None:
        self.channel = channel
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
        wire = tensor.to(self.channel.device, dtype_of(spec)).contiguous()
        try:
            if len(indices) == 1:
                self.channel._send_tensor(wire)
            else:
                if self._flat is None:
                    self._flat = self.channel._bucket_buffer(
                        sum(_aligned(nbytes_of(self.manifest.tensors[i])) for i in indices))
                    self._offset = 0
                nbytes = nbytes_of(spec)
                self._flat[self._offset: self._offset + nbytes] = wire.view(-1).view(torch.uint8)
                self._offset += _aligned(nbytes)
                if index == indices[-1]:
                    self.channel._send_bucket(self._flat)
                    self._flat = None
        except TransferFailed as exc:
            self._flat = None
            self.error = detached(exc)
            return
        if index == indices[-1]:
            self._bucket += 1

    def finish(self) -> None:
        """Returns once every member holds the publication; raises the
        failure, if any, or if tensors are missing."""
        if self.error is None and self._bucket == len(self._cuts):
            try:
                self.channel._finish_send()
            except TransferFailed as exc:
                self.error = detached(exc)
        if self.error is not None:
            # a new exception: raising the stored one would give it a
            # traceback through this frame, which holds the sender that holds it
            raise TransferFailed(str(self.error)) from self.error
        if self._bucket != len(self._cuts):
            raise ValueError(f"{len(self._cuts) - self._bucket} buckets were never filled")
