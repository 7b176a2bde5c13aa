"""Checkpoints with torch.distributed.checkpoint, and the HF export.

A checkpoint folder ``step-N`` holds the sharded state of the policy, the
critic and both optimizers (every rank writes its shards) and ``meta.json``
(version, step). Resuming loads the newest complete one (``meta.json`` is
written last). The export is a plain HF folder (safetensors, config,
tokenizer) that transformers and vLLM load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from learner.ppo import PPOTrainer
from ops.files import atomic_write_text

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json", "vocab.json",
                   "merges.txt")


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _state(trainer: PPOTrainer) -> dict:
    return {
        "policy": get_model_state_dict(trainer.policy),
        "critic": get_model_state_dict(trainer.critic),
        "policy_optimizer": get_optimizer_state_dict(trainer.policy, trainer.policy_optimizer),
        "critic_optimizer": get_optimizer_state_dict(trainer.critic, trainer.critic_optimizer),
    }


def save_checkpoint(folder: Path, trainer: PPOTrainer, version: int, step: int) -> Path:
    target = folder / f"step-{step}"
    dcp.save(_state(trainer), checkpoint_id=str(target))
    _barrier()
    if _is_rank0():
        # written last and atomically: a checkpoint counts only once it is complete
        atomic_write_text(target / "meta.json", json.dumps({"version": version, "step": step}))
    _barrier()
    return target


def latest_checkpoint(folder: Path) -> Path | None:
    complete = [p for p in folder.glob("step-*") if (p / "meta.json").is_file()]
    return max(complete, key=lambda p: int(p.name.removeprefix("step-")), default=None)


def load_checkpoint(path: Path, trainer: PPOTrainer) -> tuple[int, int]:
    """Restore ``trainer`` in place; returns (version, step)."""
    state = _state(trainer)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(trainer.policy, state["policy"])
    set_model_state_dict(trainer.critic, state["critic"])
    set_optimizer_state_dict(trainer.policy, trainer.policy_optimizer, state["policy_optimizer"])
    set_optimizer_state_dict(trainer.critic, trainer.critic_optimizer, state["critic_optimizer"])
    meta = json.loads((path / "meta.json").read_text())
    return meta["version"], meta["step"]


def export_hf(policy: torch.nn.Module, source_model: str, out: Path) -> Path | None:
    """Write the policy as an HF folder (rank 0 writes; every rank must call)."""
    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if not _is_rank0():
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source_model)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(full)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(source_model) / name).is_file():
            shutil.copy(Path(source_model) / name, out / name)
    return out
