"""Run by torchrun in tests: each rank loads the policy, the critic and a
policy with a value head ("headed") sharded (built on the meta device, then
only its shards read), counting every tensor it reads from a safetensors
file; then the ranks export the headed policy in bf16.

    torchrun --nproc_per_node N tests/programs/load_ranks.py MODEL OUT

OUT gets ``rank-R.json`` from each rank (what it read and holds),
``parameters.safetensors`` from rank 0 (the full parameters and buffers of
the three models, gathered after loading) and the export, ``export/``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import safetensors
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from learner.checkpoint import export_hf
from learner.models import Sharding, load_critic, load_policy
from tests.processes import leave_process_group

#: Elements of each tensor this rank read from a safetensors file.
READS: list[int] = []


class _CountingSlice:
    """A safetensors slice that records the size of what is read through it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self._inner[index]
        READS.append(tensor.numel())
        return tensor


class _CountingFile:
    """``safetensors.safe_open`` that records every tensor read, whole or sliced."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._inner = _safe_open(*args, **kwargs)

    def __enter__(self) -> _CountingFile:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self._inner.get_tensor(name)
        READS.append(tensor.numel())
        return tensor

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self._inner.get_slice(name))


_safe_open = safetensors.safe_open


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # readers import safe_open when they read (torch's Hugging Face reader,
    # transformers): every read from here on is counted
    safetensors.safe_open = _CountingFile
    sharding = Sharding(torch.device("cpu"))
    models = {"policy": load_policy(model, sharding=sharding),
              "critic": load_critic(model, sharding=sharding),
              "headed": load_policy(model, sharding=sharding, value_head=True)}
    reads = list(READS)
    safetensors.safe_open = _safe_open
    policy = models["policy"]
    full: dict[str, torch.Tensor] = {}
    local: dict[str, int] = {}  # elements of each parameter this rank holds
    plain = 0  # parameters held whole (not sharded)
    for prefix, module in models.items():
        for name, parameter in module.named_parameters():
            if isinstance(parameter, DTensor):
                local[f"{prefix}.{name}"] = parameter.to_local().numel()
                full[f"{prefix}.{name}"] = parameter.full_tensor()
            else:
                plain += 1
        full.update({f"{prefix}.{name}": buffer for name, buffer in module.named_buffers()})
    # the policy with a value head: the export leaves the head behind
    exported = export_hf(models["headed"], model, out / "export", torch.bfloat16)
    (out / f"rank-{rank}.json").write_text(json.dumps({
        "reads": reads, "local": local, "plain_parameters": plain,
        "tied": policy.lm_head.weight is policy.model.embed_tokens.weight,
        "export": str(exported) if exported else None}))
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, out / "parameters.safetensors")
    leave_process_group()  # after rank 0 has written


if __name__ == "__main__":
    main()
