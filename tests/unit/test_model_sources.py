"""Where run.model comes from and what reaches the engine and the learner:
a folder, or a Hugging Face model id in the local cache (laid out as the hub
lays it out; nothing is downloaded); vLLM engine arguments passed through;
a model with its own code loaded only when trusted."""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest

from actors.config import EngineConfig
from actors.engine import engine_environment, engine_kwargs, engine_process_started
from tests.processes import VENV_BIN, run_command

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLDER = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(scope="module")
def hub_cache(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``acme/tiny`` in a Hugging Face cache: blobs, two snapshots of links
    to them, ``refs/main`` naming the newer."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--acme--tiny"
    (repo / "blobs").mkdir(parents=True)
    for commit in (COMMIT, OLDER):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for file in tiny_model_dir.iterdir():
            blob = repo / "blobs" / f"{commit[:8]}-{file.name}"
            shutil.copy(file, blob)
            (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def shown_model(cache: Path, model: str) -> str:
    """run.model as ``compactionrl config show`` resolves it, offline."""
    shown = run_command([str(VENV_BIN / "compactionrl"), "config", "show", "--run.model", model],
                        timeout=120, env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert shown.returncode == 0, shown.stderr[-2000:]
    return tomllib.loads(shown.stdout)["run"]["model"]


def test_a_model_id_resolves_to_its_snapshot_in_the_local_cache(hub_cache: Path) -> None:
    model = hub_cache / "models--acme--tiny" / "snapshots"
    assert shown_model(hub_cache, "acme/tiny") == str(model / COMMIT)
    assert shown_model(hub_cache, f"acme/tiny@{OLDER}") == str(model / OLDER)


def test_a_model_absent_from_the_cache_is_left_for_its_loader_to_report(
        hub_cache: Path) -> None:
    assert shown_model(hub_cache, "acme/absent") == "acme/absent"


def test_a_folder_is_taken_as_it_is(hub_cache: Path, tiny_model_dir: Path) -> None:
    assert shown_model(hub_cache, str(tiny_model_dir)) == str(tiny_model_dir)


def test_engine_arguments_pass_through_and_collisions_are_refused(tiny_model_dir: Path) -> None:
    config = EngineConfig(trust_remote_code=True, extra_args={"max_num_seqs": 4})
    kwargs = engine_kwargs(str(tiny_model_dir), config)
    assert kwargs["max_num_seqs"] == 4 and kwargs["trust_remote_code"] is True
    with pytest.raises(ValueError, match="'max_num_sequences' is not one of vLLM's"):
        engine_kwargs(str(tiny_model_dir), EngineConfig(extra_args={"max_num_sequences": 4}))
    with pytest.raises(ValueError, match="'dtype' is set by the engine config's own fields"):
        engine_kwargs(str(tiny_model_dir), EngineConfig(extra_args={"dtype": "float16"}))


def test_an_eager_cpu_engine_is_started_without_compilation_unless_asked(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM compiles sampler helpers even when eager; an eager engine on CPU
    is started with torch.compile off (an explicit setting wins), and only
    while it starts: building its arguments changes nothing."""
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    before = dict(os.environ)
    engine_kwargs(str(tiny_model_dir), EngineConfig())
    assert dict(os.environ) == before
    assert "TORCH_COMPILE_DISABLE" not in engine_environment(EngineConfig(enforce_eager=False),
                                                             on_cpu=True)
    assert engine_environment(EngineConfig(), on_cpu=True)["TORCH_COMPILE_DISABLE"] == "1"
    with engine_process_started(EngineConfig()):
        assert os.environ["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in os.environ
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    assert "TORCH_COMPILE_DISABLE" not in engine_environment(EngineConfig(), on_cpu=True)


REMOTE_CONFIG = '''
from transformers import Qwen2Config


class RemoteTinyConfig(Qwen2Config):
    model_type = "remote_tiny"
'''

REMOTE_MODEL = '''
from transformers import Qwen2ForCausalLM

from .configuration_remote_tiny import RemoteTinyConfig


class RemoteTinyForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteTinyConfig
'''


def test_a_model_with_its_own_code_loads_only_when_trusted(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from learner.models import load_policy

    folder = tmp_path / "remote-tiny"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "configuration_remote_tiny.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_remote_tiny.py").write_text(REMOTE_MODEL)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="remote_tiny", architectures=["RemoteTinyForCausalLM"], auto_map={
        "AutoConfig": "configuration_remote_tiny.RemoteTinyConfig",
        "AutoModelForCausalLM": "modeling_remote_tiny.RemoteTinyForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_policy(str(folder))
    policy = load_policy(str(folder), trust_remote_code=True)
    assert type(policy).__name__ == "RemoteTinyForCausalLM"
