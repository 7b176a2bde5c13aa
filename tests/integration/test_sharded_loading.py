"""The learner builds its models on the meta device, shards them, and each
rank reads only its shards of the weights: the parameters equal a full
load's (transformers' ``from_pretrained``) on 1 rank and on 2, from a
float32 and from a bfloat16 source; a rank of 2 reads its half of the
weights and never a whole tensor; a value head, in no file, starts at zero.
The 2 ranks export together: rank 0 writes the gathered parameters in the
training dtype, a value head left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from deploy.cli import torchrun_args
from learner.checkpoint import export_hf
from learner.config import LearnerConfig
from learner.models import load_critic, load_policy
from tests.processes import VENV_BIN, run_command

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[1] / "programs" / "load_ranks.py"
ROOT = Path(__file__).parents[2]


def load_on_ranks(model: Path, out: Path, ranks: int) -> tuple[dict[str, torch.Tensor],
                                                               list[dict]]:
    """The full parameters and buffers after a sharded load on ``ranks``
    ranks, and what each rank reported (tests/programs/load_ranks.py)."""
    command = [str(VENV_BIN / "torchrun"), *torchrun_args(LearnerConfig(nproc=ranks)),
               str(SCRIPT), str(model), str(out)]
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    result = run_command(command, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(ranks)]
    return load_file(out / "parameters.safetensors"), reports


def full_load(model: Path) -> dict[str, torch.Tensor]:
    """The parameters and buffers of the unsharded load (the whole model in
    one process, as the learner loaded it before it sharded on meta)."""
    state = {}
    for prefix, module in (("policy", load_policy(str(model))),
                           ("critic", load_critic(str(model))),
                           ("headed", load_policy(str(model), value_head=True))):
        state.update({f"{prefix}.{name}": tensor for name, tensor in
                      [*module.named_parameters(), *module.named_buffers()]})
    return state


def assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    different = [name for name, tensor in expected.items()
                 if not (got[name].dtype == tensor.dtype and torch.equal(got[name], tensor))]
    assert not different, different


@pytest.fixture(scope="module")
def bf16_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model in bfloat16, as real checkpoints are."""
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return export_hf(source, str(tiny_model_dir), tmp_path_factory.mktemp("bf16") / "model",
                     torch.bfloat16)


@pytest.fixture(scope="module")
def two_ranks(bf16_model: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[dict[str, torch.Tensor], list[dict], Path]:
    out = tmp_path_factory.mktemp("two-ranks")
    return *load_on_ranks(bf16_model, out, 2), out


def test_loading_on_meta_on_one_rank_gives_the_parameters_of_a_full_load(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    got, [report] = load_on_ranks(tiny_model_dir, tmp_path, 1)
    assert_equal(got, full_load(tiny_model_dir))
    assert report["tied"] and report["plain_parameters"] == 0


def test_loading_on_meta_on_two_ranks_gives_the_parameters_of_a_full_load(
        bf16_model: Path, two_ranks: tuple[dict[str, torch.Tensor], list[dict], Path]) -> None:
    """From bfloat16 files into float32 parameters (the master weights)."""
    got, reports, _ = two_ranks
    expected = full_load(bf16_model)
    assert expected["policy.model.embed_tokens.weight"].dtype == torch.float32
    assert_equal(got, expected)
    assert all(report["tied"] for report in reports)


def test_a_rank_of_two_reads_only_its_shards_and_never_a_whole_tensor(
        bf16_model: Path, two_ranks: tuple[dict[str, torch.Tensor], list[dict], Path]) -> None:
    _, reports, _ = two_ranks
    with safe_open(bf16_model / "model.safetensors", "pt") as weights:
        sizes = [weights.get_slice(name).get_shape() for name in weights.keys()]
    elements = [torch.Size(shape).numel() for shape in sizes]
    for report in reports:
        assert report["plain_parameters"] == 0  # every parameter is a shard
        # its shards of the three models (the critic's head and the value head
        # are in no file), read once
        assert sum(report["reads"]) == sum(
            n for name, n in report["local"].items()
            if not name.startswith(("critic.head.", "headed.value_head.")))
        assert max(report["reads"]) < max(elements)
    # between them, the ranks read the files once for each model
    assert sum(sum(report["reads"]) for report in reports) == 3 * sum(elements)


def test_rank_0_of_two_writes_their_export_in_the_training_dtype(
        two_ranks: tuple[dict[str, torch.Tensor], list[dict], Path]) -> None:
    got, reports, out = two_ranks
    export = out / "export"
    assert [report["export"] for report in reports] == [str(export), None]
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(export / "model.safetensors")
    assert "lm_head.weight" not in weights  # tied: saved once, as transformers saves it
    assert not any(name.startswith("value_head.") for name in weights)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, got[f"policy.{name}"].to(torch.bfloat16)), name
