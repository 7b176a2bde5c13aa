"""The memory arithmetic of a GPU plan (deploy/memory_plan.py), and the plan
that uses it: what a learner rank and an engine need, from a model's
``config.json``; a learner rank that does not fit its GPU refused with the
fixes named; the shipped 8-GPU configuration fitting an H100. Plain
arithmetic: no GPU is needed, and none was used."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from actors.config import ActorConfig
from deploy.cli import main
from deploy.config import load_config
from deploy.device_plan import plan_devices
from deploy.fleet import Fleet
from deploy.memory_plan import (
    GIB,
    engine_memory,
    learner_host_memory,
    learner_rank_memory,
    trained_parameters,
)
from deploy.model_shapes import ModelShape
from learner.config import LearnerConfig

CONFIGS = Path(__file__).parents[2] / "deploy" / "configs"
H100 = CONFIGS / "gpu-8xh100.toml"
#: An H100 80GB as torch reports it.
H100_BYTES = int(79.6 * GIB)
#: One machine of eight of them.
EIGHT_H100 = Fleet.uniform(8, H100_BYTES)
#: Qwen2.5-7B's and Qwen2.5-0.5B's config.json (the fields the arithmetic reads).
QWEN_7B = {"num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
           "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
           "tie_word_embeddings": False}
QWEN_05B = {"num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
            "tie_word_embeddings": True}


@pytest.fixture
def qwen_7b(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B))
    return tmp_path


def test_a_model_s_parameters_are_counted_from_its_config(tmp_path: Path) -> None:
    for config, published in ((QWEN_7B, 7.62e9), (QWEN_05B, 0.494e9)):
        (tmp_path / "config.json").write_text(json.dumps(config))
        shape = ModelShape.of(tmp_path)
        assert shape is not None
        assert shape.parameters == pytest.approx(published, rel=0.005)
    assert ModelShape.of(tmp_path / "missing") is None


def test_a_7b_policy_and_critic_model_on_4_ranks_keep_54_7_gib_of_states(qwen_7b: Path
                                                                          ) -> None:
    shape = ModelShape.of(qwen_7b)
    learner = dataclasses.replace(load_config(H100).learner, critic="model", nproc=4)
    memory = learner_rank_memory(shape, learner, tokens=32768, chunk_tokens=4096)
    assert memory.states / GIB == pytest.approx(54.7, abs=0.05)


def test_ranks_a_value_head_and_smaller_passes_each_lower_a_rank_s_need(qwen_7b: Path
                                                                        ) -> None:
    shape = ModelShape.of(qwen_7b)
    base = dataclasses.replace(load_config(H100).learner, critic="model", nproc=4)
    need = learner_rank_memory(shape, base, 32768, 4096).total
    assert learner_rank_memory(shape, dataclasses.replace(base, nproc=8), 32768, 4096).total \
        < need
    assert learner_rank_memory(shape, dataclasses.replace(base, critic="value_head"), 32768,
                               4096).total < need
    assert learner_rank_memory(shape, base, 8192, 4096).total < need
    assert learner_rank_memory(shape, base, 32768, 1024).total < need
    # without checkpointing every layer's working set is kept
    off = dataclasses.replace(base, activation_checkpointing="off")
    assert learner_rank_memory(shape, off, 32768, 4096).activations > 4 * \
        learner_rank_memory(shape, base, 32768, 4096).activations


def test_the_shipped_8_gpu_configuration_fits_an_h100_and_its_critic_model_would_not(
        qwen_7b: Path) -> None:
    fits = plan_devices(load_config(H100, ["--run.model", str(qwen_7b)]), EIGHT_H100)
    assert fits.problems == ()
    assert "(of 79.6 GiB)" in fits.process("learner").describe_memory()
    # the episodes' windows fit the KV
    assert "short" not in fits.process("actor-0").describe_memory()
    over = plan_devices(load_config(H100, ["--run.model", str(qwen_7b),
                                           "--learner.critic", "model"]), EIGHT_H100)
    [problem] = over.problems
    assert "more than the 79.6 GiB" in problem
    # the fewest ranks that fit (and the two engines left beside them), and
    # the critic; not the micro-batch budget, already at one segment's window
    assert 'learner.critic = "value_head" (53.6 GiB a rank: fits)' in problem
    assert "learner.nproc = 6, learner.gpus = [0, 1, 2, 3, 4, 5], actors.count = 2, " \
           "actors.gpus = [6, 7] (74.9 GiB a rank: fits)" in problem
    assert "max_tokens_per_microbatch" not in problem


def test_an_engine_short_of_kv_for_its_episodes_windows_says_how_many_fit(qwen_7b: Path
                                                                         ) -> None:
    actors = load_config(H100).actors
    crowded = dataclasses.replace(actors, concurrent_episodes=64)
    memory = engine_memory(ModelShape.of(qwen_7b), crowded, H100_BYTES, 0.85)
    assert memory.kv_tokens < memory.needed_tokens
    assert "short: 25 episodes' full windows fit" in memory.describe()


def test_a_learner_sharing_its_gpu_is_held_to_its_fraction(qwen_7b: Path) -> None:
    config = load_config(None, ["--run.model", str(qwen_7b), "--actors.count", "1",
                                "--learner.critic", "value_head",
                                "--learner.gpu_memory_fraction", "0.5"])
    [problem] = plan_devices(config, Fleet.uniform(1, H100_BYTES)).problems
    assert "more than the 39.8 GiB it has" in problem


def test_without_the_model_s_shape_or_the_gpus_size_the_plan_says_memory_was_not_checked(
        qwen_7b: Path, tmp_path: Path) -> None:
    unknown_size = plan_devices(load_config(H100, ["--run.model", str(qwen_7b)]), 8)
    assert "GPUs' size is unknown" in unknown_size.memory_note
    no_shape = plan_devices(load_config(H100, ["--run.model", str(tmp_path / "none")]),
                            EIGHT_H100)
    assert "no config.json" in no_shape.memory_note and no_shape.problems == ()
    assert "--model-shape" in no_shape.memory_note
    cpu = plan_devices(load_config(None, []), 0)
    assert all(p.memory is None for p in cpu.processes) and cpu.memory_note == ""


def test_up_plan_prints_each_process_s_memory_and_refuses_what_does_not_fit(
        qwen_7b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["up", "--plan", "--gpus", "8", "--gpu-memory-gib", "79.6", "--config", str(H100),
            "--run.model", str(qwen_7b)]
    assert main(args) == 0
    out = capsys.readouterr().out
    # four engines alike are one line
    assert "memory, learner: " in out and "memory, actor-0 to actor-3: weights 14.2 GiB" in out
    assert main([*args, "--learner.critic", "model"]) == 2
    assert "REFUSED: a learner rank needs about" in capsys.readouterr().out


def test_an_actor_tells_how_many_full_windows_its_kv_cache_holds_when_its_episodes_need_more(
) -> None:
    actors = ActorConfig(concurrent_episodes=4)
    window = actors.window_tokens()
    assert window == actors.compaction.context_tokens + actors.sampling.max_turn_tokens
    assert actors.kv_shortfall(4 * window) is None
    shortfall = actors.kv_shortfall(4 * window - 1)
    assert shortfall is not None and f"3 full windows of {window:,}" in shortfall
    assert "concurrent_episodes to 3" in shortfall


def test_a_learner_node_s_host_memory_holds_a_copy_of_its_states_for_background_saves(
        qwen_7b: Path) -> None:
    """Each trained parameter's weight and AdamW moments (12 bytes), the
    node's share; the node needs twice that for auto to save in the
    background; an export gathers the policy in bf16."""
    shape = ModelShape.of(qwen_7b)
    learner = LearnerConfig(nproc=8)
    policy, critic = trained_parameters(shape, learner)
    host = learner_host_memory(shape, learner)
    assert host.staging == 12 * (policy + critic)
    assert host.background == 2 * host.staging and host.export == 2 * policy
    assert 160 * GIB < host.staging < 170 * GIB  # a 7B policy and critic model
    two_nodes = learner_host_memory(shape, LearnerConfig(nproc=8, nnodes=2))
    assert two_nodes.staging == host.staging // 2
    value_head = learner_host_memory(shape, LearnerConfig(critic="value_head"))
    assert value_head.staging == 12 * (policy + shape.hidden + 1)  # one body
    config = load_config(H100, ["--run.model", str(qwen_7b)])
    plan = plan_devices(config, EIGHT_H100)
    assert plan.learner_host == learner_host_memory(shape, config.learner)
    assert "background checkpoints copy its states" in plan.table()
    assert plan.to_json()["learner_host"]["staging_bytes"] == plan.learner_host.staging
