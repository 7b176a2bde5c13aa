"""Checkpoints with torch.distributed.checkpoint, and the HF export.

A checkpoint folder ``step-N`` holds the sharded state of the policy (with
its value head, if it has one), the critic model, if there is one, and their
optimizers (every rank writes its shards) and ``meta.json``
(version, step). Resuming loads the newest complete one (``meta.json`` is
written last), or a chosen one (:func:`select_checkpoint`); retention keeps
the newest ``keep_last`` and every ``keep_every``-th (:func:`prune_checkpoints`).
The export is a plain HF folder (safetensors in the training
dtype, config, and every other file of the source model's folder: tokenizer,
chat template, generation config) that transformers and vLLM load.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from learner.config import CHECKPOINT_BYTES_PER_PARAMETER, HOST_STAGING_SHARE, LearnerConfig
from learner.models import is_value_head
from learner.ppo import PPOTrainer
from ops.files import atomic_write_text

#: Files of a model folder that hold weights, in any format, or index them:
#: the export writes its own weights in their place.
log = logging.getLogger("compactionrl.learner")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                   ".index.json")


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _models(trainer: PPOTrainer) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """Each model of ``trainer`` with its optimizer, by name."""
    models = {"policy": (trainer.policy, trainer.policy_optimizer)}
    if trainer.critic is not None and trainer.critic_optimizer is not None:
        models["critic"] = (trainer.critic, trainer.critic_optimizer)
    return models


def _state(trainer: PPOTrainer) -> dict:
    state = {}
    for name, (model, optimizer) in _models(trainer).items():
        state[name] = get_model_state_dict(model)
        state[f"{name}_optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


def save_checkpoint(folder: Path, trainer: PPOTrainer, version: int, step: int) -> Path:
    target = folder / f"step-{step}"
    dcp.save(_state(trainer), checkpoint_id=str(target))
    _complete(target, version, step)
    return target


def _complete(target: Path, version: int, step: int) -> None:
    """Once every rank's shards are written: ``meta.json``, written last and
    atomically, so that a checkpoint counts only once it is complete."""
    _barrier()
    if _is_rank0():
        atomic_write_text(target / "meta.json", json.dumps({"version": version, "step": step}))
    _barrier()


def background_saves(setting: str, device_type: str, staging_bytes: int,
                     host_bytes: int | None) -> bool:
    """Whether checkpoints are written in the background
    (``learner.async_checkpoint``): ``on`` always, ``off`` never, ``auto``
    on GPUs where the copy of the host's states (``staging_bytes``, all its
    ranks together) takes at most ``HOST_STAGING_SHARE`` of its memory
    (``host_bytes``; None: unknown, taken as enough). A host short of it
    saves synchronously: a copy beyond its memory gets the pod evicted."""
    if setting != "auto":
        return setting == "on"
    fits = host_bytes is None or staging_bytes <= HOST_STAGING_SHARE * host_bytes
    return device_type == "cuda" and fits


def host_memory_bytes(cgroup: Path = Path("/sys/fs/cgroup"),
                      meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The memory this process's host gives it: its cgroup's limit (v2
    ``memory.max``, v1 ``memory/memory.limit_in_bytes``: a pod's
    ``limits.memory``) where one is set, else the machine's; None where
    neither can be read."""
    limits = []
    for path in (cgroup / "memory.max", cgroup / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    try:
        total_kib = next(int(line.split()[1]) for line in meminfo.read_text().splitlines()
                         if line.startswith("MemTotal:"))
        limits.append(total_kib * 1024)
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    return min(limits) if limits else None


def staging_bytes(trainer: PPOTrainer, ranks_on_host: int) -> int:
    """What a background save copies to the host's memory: each rank's
    shard of every trained model and its optimizer states, for the
    ``ranks_on_host`` ranks of this host (FSDP shards evenly)."""
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                for model, _ in _models(trainer).values() for p in model.parameters())
    return CHECKPOINT_BYTES_PER_PARAMETER * local * ranks_on_host


def background_saves_here(setting: str, device_type: str, trainer: PPOTrainer) -> bool:
    """:func:`background_saves` on this host's numbers: the copy a background
    save makes of its ranks' states (torchrun's ``LOCAL_WORLD_SIZE`` ranks),
    against its memory; rank 0 says so where a GPU host saves synchronously
    for want of it."""
    ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    staging, host = staging_bytes(trainer, ranks_on_host), host_memory_bytes()
    background = background_saves(setting, device_type, staging, host)
    if setting == "auto" and device_type == "cuda" and not background and _is_rank0():
        log.warning("checkpoints are saved synchronously: a background save would copy %.1f "
                    "GiB of this host's states into its %.1f GiB of memory (at most %.0f%%; "
                    "docs/learner.md \"Checkpoints and host memory\")", staging / 2**30,
                    (host or 0) / 2**30, 100 * HOST_STAGING_SHARE)
    return background


class CheckpointWriter:
    """Checkpoints of one run folder, written in the background where asked.

    Asynchronous: :meth:`save` copies every rank's state to CPU memory and
    returns (training goes on and may change the weights: the copy is what is
    written), and a thread writes the copy; the checkpoint completes
    (``meta.json``, then retention) when the next save or :meth:`finish`
    finds every rank's write done. Training stalls only for the copy, not
    the write (``bench/checkpoint.py`` measures both). The writes go over a
    gloo group of their own: DCP's background save needs a CPU backend, and
    the default group is NCCL on GPUs."""

    def __init__(self, folder: Path, asynchronous: bool, keep_last: int, keep_every: int
                 ) -> None:
        self.folder = folder
        self.asynchronous = asynchronous
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._group = (dist.new_group(backend="gloo")
                       if asynchronous and dist.is_available() and dist.is_initialized()
                       else None)
        # One copy of the state in host memory for the run, reused by every
        # save (its storages cached per state tensor), pinned on a GPU host:
        # DCP's default stager allocates a fresh, unpinned one for each save.
        self._stager = (DefaultStager(StagingOptions(
            use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
            use_async_staging=False, use_non_blocking_copy=False)) if asynchronous else None)
        self._pending: tuple[Future, Path, int, int] | None = None
        self.removed: list[Path] = []
        """What retention removed at the last completion (rank 0)."""

    def save(self, trainer: PPOTrainer, version: int, step: int) -> Path:
        self.finish()
        target = self.folder / f"step-{step}"
        if not self.asynchronous:
            save_checkpoint(self.folder, trainer, version, step)
            self._retain()
            return target
        written = dcp.async_save(_state(trainer), checkpoint_id=str(target),
                                 process_group=self._group, async_stager=self._stager)
        self._pending = (written, target, version, step)
        return target

    def finish(self) -> None:
        """Wait for the save under way, if any, and complete it."""
        if self._pending is None:
            return
        written, target, version, step = self._pending
        self._pending = None
        written.result()
        _complete(target, version, step)
        self._retain()

    def close(self) -> None:
        """Complete the save under way and let go of the host copy."""
        self.finish()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _retain(self) -> None:
        self.removed = (prune_checkpoints(self.folder, self.keep_last, self.keep_every)
                        if _is_rank0() else [])


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def _checkpoint_folders(folder: Path) -> list[Path]:
    """Every ``step-N`` folder, complete or not, by step."""
    return sorted((p for p in folder.glob("step-*")
                   if p.is_dir() and p.name.removeprefix("step-").isdigit()), key=_step_of)


def complete_checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints in ``folder``, oldest first."""
    return [p for p in _checkpoint_folders(folder) if (p / "meta.json").is_file()]


def latest_checkpoint(folder: Path) -> Path | None:
    complete = complete_checkpoints(folder)
    return complete[-1] if complete else None


class CheckpointNotFound(ValueError):
    """The checkpoint asked to resume from is not there (or incomplete)."""


def select_checkpoint(folder: Path, choice: str) -> Path | None:
    """The checkpoint ``--resume`` names: ``latest`` (the newest complete one,
    None if there is none), a step number, or a checkpoint folder's path."""
    if choice == "latest":
        return latest_checkpoint(folder)
    complete = complete_checkpoints(folder)
    path = folder / f"step-{choice}" if choice.isdigit() else Path(choice)
    if not (path / "meta.json").is_file():
        steps = ", ".join(str(_step_of(p)) for p in complete) or "none"
        raise CheckpointNotFound(f"no complete checkpoint at {path} (complete steps in "
                                 f"{folder}: {steps})")
    return path


def set_aside_later(folder: Path, chosen: Path) -> Path | None:
    """Move the checkpoints of ``folder`` after ``chosen``'s step (a branch
    that resuming from an earlier one abandons) into ``abandoned-after-N``,
    so that the newest checkpoint is always the live branch's. Returns that
    folder, or None if nothing was later."""
    if chosen.parent.resolve() != folder.resolve():
        later = _checkpoint_folders(folder)
    else:
        later = [p for p in _checkpoint_folders(folder) if _step_of(p) > _step_of(chosen)]
    if not later:
        return None
    aside = folder / f"abandoned-after-{chosen.name}"
    aside.mkdir(exist_ok=True)
    for path in later:
        path.rename(aside / path.name)
    return aside


def prune_checkpoints(folder: Path, keep_last: int, keep_every: int) -> list[Path]:
    """Remove the complete checkpoints other than the newest ``keep_last``
    and those whose step is a multiple of ``keep_every`` (0: none kept for
    that), and incomplete ones older than the newest complete (saves that
    died). Returns what was removed, oldest first."""
    complete = complete_checkpoints(folder)
    if not complete:
        return []
    newest = _step_of(complete[-1])
    kept = {p for p in complete[-keep_last:]} | {
        p for p in complete if keep_every and _step_of(p) % keep_every == 0}
    removed = [p for p in _checkpoint_folders(folder)
               if p not in kept and (p in complete or _step_of(p) < newest)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def load_checkpoint(path: Path, trainer: PPOTrainer) -> tuple[int, int]:
    """Restore ``trainer`` in place; returns (version, step)."""
    state = _state(trainer)
    dcp.load(state, checkpoint_id=str(path))
    for name, (model, optimizer) in _models(trainer).items():
        set_model_state_dict(model, state[name])
        set_optimizer_state_dict(model, optimizer, state[f"{name}_optimizer"])
    return checkpoint_position(path)


def checkpoint_position(path: Path) -> tuple[int, int]:
    """(version, step) of the complete checkpoint at ``path``."""
    meta = json.loads((path / "meta.json").read_text())
    return meta["version"], meta["step"]


def export_hf(policy: torch.nn.Module, source_model: str, out: Path, dtype: torch.dtype,
              timeout_s: float = LearnerConfig.export_timeout_s,
              trust_remote_code: bool = False) -> Path | None:
    """Write ``policy`` to ``out`` as an HF folder, its floating-point
    weights in ``dtype`` (the dtype it trains in); returns ``out`` on rank 0,
    None elsewhere. Every rank must call it; it returns once the folder is
    written.

    The full tensors are gathered one at a time, each shard cast to ``dtype``
    first; only rank 0 keeps them (on the CPU), so the other ranks never hold
    more than one full tensor. Rank 0 then writes the folder while the others
    wait in a barrier of a gloo group made for that wait, whose timeout is
    ``timeout_s``: the default group's (10 minutes on NCCL) is shorter than
    writing a large model can take. (The others do not leave before rank 0
    is done: a gloo rank that exits while its peers still run can abort at
    exit.) A tied output layer is saved as transformers saves it, once. The
    source folder's other files, whatever they are (tokenizer files,
    SentencePiece models, chat template, generation config), are copied as
    they are. A value head is not exported (a causal LM has none)."""
    rank0 = _is_rank0()
    state: dict[str, torch.Tensor] = {}
    first_name: dict[int, str] = {}
    # keep_vars: the parameters themselves, so that tied names share one tensor
    for name, tensor in policy.state_dict(keep_vars=True).items():
        if is_value_head(name):
            continue
        if id(tensor) in first_name:  # tied: gathered under its first name already
            if rank0:
                state[name] = state[first_name[id(tensor)]]
            continue
        first_name[id(tensor)] = name
        full = tensor.detach()
        if full.is_floating_point():
            full = full.to(dtype)
        if isinstance(full, DTensor):
            full = full.full_tensor()  # a collective: every rank, in the same order
        if rank0:
            state[name] = full.cpu()
    waiting = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
               if dist.is_available() and dist.is_initialized() else None)
    if rank0:
        _write_hf(state, source_model, out, dtype, trust_remote_code)
    if waiting is not None:
        dist.barrier(group=waiting)
        dist.destroy_process_group(waiting)
    return out if rank0 else None


def _write_hf(state: dict[str, torch.Tensor], source_model: str, out: Path,
              dtype: torch.dtype, trust_remote_code: bool) -> None:
    """``state`` (full tensors in ``dtype``) as an HF folder at ``out``, with
    every file of ``source_model``'s folder but its weights and config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # the skeleton that save_pretrained writes the weights and config of (the
    # config naming ``dtype``, which vLLM and transformers load by default)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(source_model, trust_remote_code=trust_remote_code),
            dtype=dtype, trust_remote_code=trust_remote_code)
    skeleton.save_pretrained(out, state_dict=state)
    for path in Path(source_model).iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.endswith(
                WEIGHT_SUFFIXES):
            shutil.copy(path, out / path.name)
