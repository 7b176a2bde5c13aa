"""Checkpoints resume exactly; the export is in the training dtype, carries
every other file of the source folder, and loads in transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner.batch import to_train_batch
from learner.checkpoint import (
    CHECKPOINT_BYTES_PER_PARAMETER,
    WEIGHT_SUFFIXES,
    CheckpointNotFound,
    CheckpointWriter,
    background_saves,
    complete_checkpoints,
    export_hf,
    host_memory_bytes,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    select_checkpoint,
    set_aside_later,
    staging_bytes,
)
from learner.config import LearnerConfig
from learner.models import engine_parameters, is_value_head, load_critic, load_policy
from learner.ppo import PPOTrainer
from protocol.synthetic import synthetic_batch

#: Each trains the tiny model for steps (seconds to a minute): make check leaves
#: them to make test.
pytestmark = pytest.mark.trains


def fresh(model: Path, critic: str = "model") -> PPOTrainer:
    torch.manual_seed(0)
    config = LearnerConfig(minibatches=2, critic=critic)
    if critic == "value_head":
        return PPOTrainer(load_policy(str(model), value_head=True), None, config)
    return PPOTrainer(load_policy(str(model)), load_critic(str(model)), config)


def run(trainer: PPOTrainer, steps: range) -> None:
    for step in steps:
        trainer.step(to_train_batch(synthetic_batch(rollouts=5, seed=step), True))


@pytest.mark.parametrize("critic", ["model", "value_head"])
def test_two_steps_resume_two_steps_equals_four_steps(tiny_model_dir: Path, tmp_path: Path,
                                                      critic: str) -> None:
    straight = fresh(tiny_model_dir, critic)
    run(straight, range(4))

    first = fresh(tiny_model_dir, critic)
    run(first, range(2))
    save_checkpoint(tmp_path, first, version=2, step=2)
    resumed = fresh(tiny_model_dir, critic)
    version, step = load_checkpoint(latest_checkpoint(tmp_path), resumed)
    assert (version, step) == (2, 2)
    run(resumed, range(2, 4))

    modules = ("policy",) if critic == "value_head" else ("policy", "critic")
    for module in modules:
        for (name, a), b in zip(getattr(straight, module).named_parameters(),
                                getattr(resumed, module).parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"{module}.{name}")


def test_a_background_save_writes_the_state_of_its_step_while_training_goes_on(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """The copy is taken when save returns: steps trained while the write
    runs are not in it; the checkpoint counts once finished; resumed, it
    trains on exactly as the uninterrupted run."""
    straight = fresh(tiny_model_dir)
    run(straight, range(4))

    trainer = fresh(tiny_model_dir)
    run(trainer, range(2))
    writer = CheckpointWriter(tmp_path, asynchronous=True, keep_last=3, keep_every=0)
    writer.save(trainer, version=2, step=2)
    run(trainer, range(2, 3))  # training goes on while the write runs
    writer.finish()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"
    resumed = fresh(tiny_model_dir)
    assert load_checkpoint(tmp_path / "step-2", resumed) == (2, 2)
    run(resumed, range(2, 4))
    for module in ("policy", "critic"):
        for (name, a), b in zip(getattr(straight, module).named_parameters(),
                                getattr(resumed, module).parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"{module}.{name}")


def test_only_complete_checkpoints_are_resumed(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = fresh(tiny_model_dir)
    save_checkpoint(tmp_path, trainer, version=1, step=1)
    (tmp_path / "step-7").mkdir()  # a crash mid-save leaves no meta.json
    assert latest_checkpoint(tmp_path).name == "step-1"


@pytest.mark.parametrize("critic", ["model", "value_head"])
def test_export_loads_in_transformers(tiny_model_dir: Path, tmp_path: Path, critic: str
                                      ) -> None:
    """A value head stays behind: the export is the causal LM alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = fresh(tiny_model_dir, critic)
    run(trainer, range(1))
    out = export_hf(trainer.policy, str(tiny_model_dir), tmp_path / "export", torch.float32)
    assert not any(is_value_head(name) for name in load_file(out / "model.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for (name, a), b in zip(engine_parameters(trainer.policy), loaded.parameters(), strict=True):
        torch.testing.assert_close(b, a, msg=name)
    assert AutoTokenizer.from_pretrained(out).chat_template


def test_export_is_in_the_training_dtype_with_every_file_of_the_source(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """A SentencePiece model, which the tiny model lacks, goes along: the
    export takes the source's files as they are, not a list of names."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "source"
    shutil.copytree(tiny_model_dir, source)
    (source / "tokenizer.model").write_bytes(b"\x0a\x0bnot a real SentencePiece model")
    trainer = fresh(source)
    run(trainer, range(1))
    out = export_hf(trainer.policy, str(source), tmp_path / "export", torch.bfloat16)

    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(out / "model.safetensors")
    for name, parameter in trainer.policy.named_parameters():
        assert weights[name].dtype == torch.bfloat16, name
        assert torch.equal(weights[name], parameter.detach().to(torch.bfloat16)), name
    others = [path.name for path in source.iterdir()
              if path.name != "config.json" and not path.name.endswith(WEIGHT_SUFFIXES)]
    assert {"tokenizer.model", "tokenizer.json", "chat_template.jinja"} <= set(others)
    for name in others:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16


def fake_checkpoints(folder: Path, complete: list[int], incomplete: list[int] = ()) -> None:
    for step in [*complete, *incomplete]:
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / "shard.distcp").write_bytes(b"x")
    for step in complete:
        (folder / f"step-{step}" / "meta.json").write_text(json.dumps({"version": step,
                                                                        "step": step}))


def steps_in(folder: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in folder.glob("step-*"))


def test_retention_keeps_the_newest_and_every_kth_and_drops_dead_saves(tmp_path: Path) -> None:
    fake_checkpoints(tmp_path, complete=[10, 20, 30, 40, 50, 60], incomplete=[35, 70])
    removed = prune_checkpoints(tmp_path, keep_last=2, keep_every=20)
    assert [p.name for p in removed] == ["step-10", "step-30", "step-35"]
    # 70 may be a save under way: only saves older than the newest complete go
    assert steps_in(tmp_path) == [20, 40, 50, 60, 70]
    assert prune_checkpoints(tmp_path, keep_last=2, keep_every=20) == []


def test_resume_chooses_the_newest_a_step_or_a_path_and_names_what_exists(
        tmp_path: Path) -> None:
    assert select_checkpoint(tmp_path, "latest") is None  # a fresh run: nothing to resume
    fake_checkpoints(tmp_path, complete=[2, 4], incomplete=[6])
    assert select_checkpoint(tmp_path, "latest") == tmp_path / "step-4"
    assert select_checkpoint(tmp_path, "2") == tmp_path / "step-2"
    assert select_checkpoint(tmp_path, str(tmp_path / "step-4")) == tmp_path / "step-4"
    with pytest.raises(CheckpointNotFound, match=r"complete steps in .*: 2, 4"):
        select_checkpoint(tmp_path, "6")
    with pytest.raises(CheckpointNotFound):
        select_checkpoint(tmp_path, str(tmp_path / "elsewhere"))


def test_resuming_from_an_earlier_step_sets_the_later_branch_aside(tmp_path: Path) -> None:
    fake_checkpoints(tmp_path, complete=[1, 2, 3], incomplete=[4])
    aside = set_aside_later(tmp_path, tmp_path / "step-2")
    assert aside == tmp_path / "abandoned-after-step-2"
    assert steps_in(tmp_path) == [1, 2] and steps_in(aside) == [3, 4]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"
    assert set_aside_later(tmp_path, tmp_path / "step-2") is None


def test_background_saves_are_on_for_gpus_by_default_and_as_set_otherwise() -> None:
    assert background_saves("auto", "cuda", 1, None)
    assert not background_saves("auto", "cpu", 1, None)
    assert background_saves("on", "cpu", 1, 1) and not background_saves("off", "cuda", 1, None)


def test_a_gpu_host_short_of_memory_for_the_copy_saves_synchronously() -> None:
    """The 8xH100 pod of deploy/k8s: ~170 GiB of a 7B policy's and critic's
    states against 128 GiB: the copy would get the pod evicted."""
    gib = 2**30
    assert not background_saves("auto", "cuda", 170 * gib, 128 * gib)
    assert background_saves("auto", "cuda", 64 * gib, 128 * gib)
    assert background_saves("on", "cuda", 170 * gib, 128 * gib)  # as asked


def test_the_host_s_memory_is_its_cgroup_s_limit_where_one_is_set(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:        1024 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert host_memory_bytes(cgroup, meminfo) == 16384 * 1024
    (cgroup / "memory.max").write_text("max\n")  # v2, no limit
    assert host_memory_bytes(cgroup, meminfo) == 16384 * 1024
    (cgroup / "memory.max").write_text("8388608\n")
    assert host_memory_bytes(cgroup, meminfo) == 8388608
    assert host_memory_bytes(tmp_path / "none", tmp_path / "none") is None
    assert host_memory_bytes() is not None  # this machine's


def test_a_background_save_stages_every_trained_parameter_s_weight_and_moments(
        tiny_model_dir: Path) -> None:
    trainer = fresh(tiny_model_dir)
    trained = sum(p.numel() for model in (trainer.policy, trainer.critic)
                  for p in model.parameters())
    assert staging_bytes(trainer, 2) == 2 * CHECKPOINT_BYTES_PER_PARAMETER * trained


def test_background_saves_copy_into_one_host_copy_for_the_run(tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    """DCP's default stager allocates a fresh copy of the state for every
    save; the writer's own keeps one, its storages reused save after save."""
    trainer = fresh(tiny_model_dir)
    run(trainer, range(1))
    writer = CheckpointWriter(tmp_path, asynchronous=True, keep_last=3, keep_every=0)
    copies = writer._stager._state_dict_stager._cached_storage_mapping
    writer.save(trainer, version=1, step=1)
    writer.finish()
    first = {id(copy) for copy in copies.values()}
    run(trainer, range(1, 2))
    writer.save(trainer, version=2, step=2)
    writer.finish()
    assert first and {id(copy) for copy in copies.values()} == first
    writer.close()
    assert [path.name for path in complete_checkpoints(tmp_path)] == ["step-1", "step-2"]
