"""Every process that may join an NCCL weight group starts with what the
group needs for the run's deadline (protocol/weights_collective.py
``start_environments``):
torch reads it as each group is built, so it cannot be set later without
writing the environment of a running process (docs/weights.md "NCCL error
handling")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from actors.config import EngineConfig
from actors.engine import engine_environment
from deploy.cli import main
from protocol.weights_collective import start_environments

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("on_cpu", [True, False])
def test_an_engine_that_takes_weights_starts_with_the_run_s_member_environment(
        on_cpu: bool) -> None:
    started = engine_environment(EngineConfig(), on_cpu=on_cpu, weight_timeout_s=120.0)
    assert start_environments(120.0).engine.items() <= started.items()
    # an engine that never joins a weight group (evaluation, play) starts as it is
    assert not start_environments(120.0).engine.keys() & engine_environment(
        EngineConfig(), on_cpu=on_cpu).keys()


def test_the_learner_s_ranks_start_with_what_a_weight_member_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compactionrl learner`` hands its process to torchrun with the
    settings in torchrun's environment, which its ranks inherit (torchrun
    passes an error handling it finds on instead of its own default)."""
    for name in start_environments(30.0).learner:
        monkeypatch.setenv(name, "1")  # a parent's own setting is overridden
    started: dict[str, object] = {}

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        started.update(argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", execve)
    with pytest.raises(SystemExit):
        main(["learner", "--config", str(ROOT / "deploy/configs/local-cpu.toml"),
              "--run.out_dir", str(tmp_path), "--learner.weight_timeout_s", "45"])
    assert "torch.distributed.run" in started["argv"]
    # rank 0's communicator of a weight group is ready within the run's deadline
    assert start_environments(45.0).learner.items() <= started["env"].items()
