"""Every process that may join an NCCL weight group starts with what the
group needs (protocol/weights_collective.py ``weight_member_environment``):
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
from protocol.weights_collective import weight_member_environment

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("on_cpu", [True, False])
def test_an_engine_starts_with_what_a_weight_member_needs(on_cpu: bool) -> None:
    started = engine_environment(EngineConfig(), on_cpu=on_cpu)
    assert weight_member_environment().items() <= started.items()


def test_the_learner_s_ranks_start_with_what_a_weight_member_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compactionrl learner`` hands its process to torchrun with the
    settings in torchrun's environment, which its ranks inherit (torchrun
    passes an error handling it finds on instead of its own default)."""
    for name in weight_member_environment():
        monkeypatch.setenv(name, "1")  # a parent's own setting is overridden
    started: dict[str, object] = {}

    def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        started.update(argv=argv, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", execve)
    with pytest.raises(SystemExit):
        main(["learner", "--config", str(ROOT / "deploy/configs/local-cpu.toml"),
              "--run.out_dir", str(tmp_path)])
    assert "torch.distributed.run" in started["argv"]
    # rank 0's communicator of a weight group is ready within the learner's deadline
    assert weight_member_environment(30.0).items() <= started["env"].items()
