"""The same batches give the same update on 1 rank and on 2 ranks (FSDP2, gloo,
torchrun): the loss is normalised by the global token count, and whitening's
statistics are global, with a rank whose share of a minibatch is empty."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.ppo_ranks_script import CONFIG, batches
from tests.processes import VENV_BIN, run_command
from tests.tolerances import rounding_tolerance

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("ppo_ranks_script.py")
ROOT = Path(__file__).parents[2]
#: Learner steps of each run.
STEPS = 2


def train(model: Path, out: Path, ranks: int) -> dict[str, torch.Tensor]:
    result = run_command(
        [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc_per_node={ranks}",
         str(SCRIPT), str(model), str(out), str(STEPS)],
        timeout=300, env={"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                          "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return load_file(out)


def test_one_rank_and_two_ranks_give_the_same_parameters(tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    one = train(tiny_model_dir, tmp_path / "one.safetensors", 1)
    two = train(tiny_model_dir, tmp_path / "two.safetensors", 2)
    assert one.keys() == two.keys()
    start = load_file(tiny_model_dir / "model.safetensors")
    # The script trains in double with SGD: each update moves a parameter by lr
    # times its gradient, clipped to a norm of max_grad_norm, which bounds every
    # element. 2 ranks sum that gradient's per-token contributions (one per
    # position of the minibatch, and one per rank) in another order; float32
    # is left only in transformers' RMSNorm and the learner's log-softmax.
    updates = positions = 0
    for batch in batches(STEPS):
        for minibatch in batch.minibatches(CONFIG.minibatches):
            updates += CONFIG.ppo_epochs
            positions = max(positions, sum(len(s.tokens) for s in batch.sequences
                                           if s.rollout in minibatch))
    tolerance = (max(CONFIG.lr, CONFIG.critic_lr) * updates
                 * rounding_tolerance(CONFIG.max_grad_norm, positions + 2))
    moved = 0
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, rtol=0, atol=tolerance, msg=name)
        key = name.removeprefix("policy.")
        if key in start and not torch.equal(start[key].to(tensor.dtype), tensor):
            moved += 1
    assert moved > 0, "training changed nothing"
