"""bench/learner_memory.py: its model shapes, batch, paths, the estimate that
skips a case too large for the machine, and the ratios. The benchmark itself
runs (``--quick``) in tests/integration/test_documented_commands.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType

import pytest
import torch

from learner.config import LearnerConfig
from tests.scripts import import_script

SCRIPT = Path(__file__).parents[2] / "bench" / "learner_memory.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return import_script(SCRIPT, "learner_memory_bench")


def test_the_models_have_the_documented_sizes(bench: ModuleType) -> None:
    from transformers import Qwen2ForCausalLM

    counts = {}
    for name, sizes in (("full", bench.FULL), ("quick", bench.QUICK)):
        with torch.device("meta"):  # shapes only, no memory
            model = Qwen2ForCausalLM(bench.qwen2_config(sizes.model))
        counts[name] = sum(p.numel() for p in model.parameters())
        assert sizes.reference in sizes.lengths
    assert 20e6 <= counts["full"] <= 50e6 and 4e6 <= counts["quick"] <= 8e6, counts
    assert bench.FULL.lengths == (2048, 8192, 16_384) and bench.FULL.reference == 8192


def test_the_batch_is_one_sequence_of_the_length(bench: ModuleType) -> None:
    (sequence,) = bench.one_sequence_batch(300).sequences
    assert len(sequence.tokens) == 300 and int(sequence.trainable.sum()) == 150


def changed(a: LearnerConfig, b: LearnerConfig) -> set[str]:
    return {field.name for field in dataclasses.fields(LearnerConfig)
            if getattr(a, field.name) != getattr(b, field.name)}


def test_the_paths_differ_in_the_memory_switches_and_the_critic_only(bench: ModuleType
                                                                     ) -> None:
    today, switches, value_head = (bench.learner_config(path, bench.FULL) for path in bench.PATHS)
    assert not today.validate() and not switches.validate() and not value_head.validate()
    assert changed(today, switches) == {"activation_checkpointing", "logprob_chunk_tokens",
                                        "max_tokens_per_microbatch"}
    assert changed(switches, value_head) == {"critic"}
    assert (switches.critic, value_head.critic) == ("model", "value_head")
    assert (today.activation_checkpointing, today.logprob_chunk_tokens,
            today.max_tokens_per_microbatch) == ("off", 0, 0)
    assert (switches.activation_checkpointing, switches.logprob_chunk_tokens,
            switches.max_tokens_per_microbatch) == ("on", 1024, 4096)


def test_a_case_is_estimated_from_its_path_s_longest_run(bench: ModuleType) -> None:
    assert bench.estimate_mib({}, 8192) is None
    done = {1024: {"loaded_mib": 1000.0, "step_mib": 400.0},
            2048: {"loaded_mib": 1000.0, "step_mib": 500.0}}
    assert bench.estimate_mib(done, 8192) == pytest.approx(1.1 * (1000 + 4 * 500))


def test_a_case_that_would_not_fit_is_skipped(bench: ModuleType,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Today's path needs 2 MiB per token, the switches' 0.1, the value
    head's 0.05 with less loaded: with 3,000 MiB available, today's runs at
    2k only."""
    ran = []

    def run(target: object, folder: str, tokens: int, config: LearnerConfig
            ) -> tuple[dict, str]:
        ran.append((tokens, config.activation_checkpointing, config.critic))
        loaded = 300.0 if config.critic == "value_head" else 500.0
        per_token = {"off": 2.0, "on": 0.1}[config.activation_checkpointing]
        step = tokens * (0.05 if config.critic == "value_head" else per_token)
        return {"loaded_mib": loaded, "peak_mib": loaded + step, "step_mib": step,
                "seconds": 1.0, "cpu_seconds": 2.0, "tokens_per_s": float(tokens)}, ""

    monkeypatch.setattr(bench, "spawned", run)
    monkeypatch.setattr(bench, "proc_mib", lambda path, field: 3000.0)
    rows = bench.measure(bench.FULL, "unused")
    assert ran == [(2048, "off", "model"), (2048, "on", "model"), (2048, "on", "value_head"),
                   (8192, "on", "model"), (8192, "on", "value_head"),
                   (16_384, "on", "model"), (16_384, "on", "value_head")]
    assert [row["status"] for row in rows] == ["ok", "ok", "ok", "skipped", "ok", "ok",
                                               "skipped", "ok", "ok"]
    assert "linear from 2048 tokens" in rows[3]["reason"]
    assert bench.ratio(rows, 2048, "step_mib") == 0.05
    assert bench.ratio(rows, 8192, "step_mib") is None  # today's did not run
    assert bench.ratio(rows, 8192, "loaded_mib", "value_head", "switches") == 0.6
    assert bench.ratio(rows, 8192, "step_mib", "value_head", "switches") == 0.5
    assert bench.table_line(rows[6]).endswith(rows[6]["reason"])
