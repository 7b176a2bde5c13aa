"""bench/gpu_check.py: its CPU dry run (the same code as on a GPU, with shared
memory for CUDA IPC and gloo for NCCL), its manifests and its checksum. The
GPU run itself happens only on a machine with a GPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.processes import run_command

SCRIPT = Path(__file__).parents[2] / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_bench", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_manifests_have_the_published_parameter_counts(gpu_check: ModuleType) -> None:
    """As Hugging Face counts them (a tied lm_head counted once)."""
    counts = {name: sum(gpu_check.numel(shape) for _, shape in gpu_check.manifest(model))
              for name, model in gpu_check.MODELS.items()}
    assert counts == {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304,
                      "qwen2.5-7b": 7_615_616_512}


def test_the_checksum_sees_a_changed_or_moved_element(gpu_check: ModuleType) -> None:
    specs = [("a", (3, 5)), ("b", (7,))]
    tensors = [gpu_check.deterministic(i, shape, "cpu") for i, (_, shape) in enumerate(specs)]
    original = gpu_check.digest(specs, tensors)
    assert gpu_check.digest(specs, [t.clone() for t in tensors]) == original
    changed = [t.clone() for t in tensors]
    changed[0][1, 2] += 1
    moved = [tensors[0], tensors[1].flip(0)]
    assert gpu_check.digest(specs, changed) != original
    assert gpu_check.digest(specs, moved) != original


def test_dry_run_pushes_every_model_intact(gpu_check: ModuleType) -> None:
    result = run_command([sys.executable, str(SCRIPT), "--dry-run", "--json", "--pushes", "2"],
                         timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert report["torch"] == torch.__version__
    assert [p["model"] for p in report["ipc_push"]] == list(gpu_check.MODELS)
    for push in report["ipc_push"]:
        specs = gpu_check.manifest(gpu_check.MODELS[push["model"]], gpu_check.DRY_RUN_DIVISOR)
        params = sum(gpu_check.numel(shape) for _, shape in specs)
        assert push["checksum_equal"] is True, push
        assert (push["tensors"], push["params"], push["bytes"]) == (len(specs), params,
                                                                     2 * params)
        assert push["seconds"] > 0 and push["gbps"] == pytest.approx(
            push["bytes"] / push["seconds"] / 1e9)
    shared = report["nccl_shared_gpu"]  # gloo on CPU: two ranks on one device are fine
    assert (shared["backend"], shared["refused"], shared["outcome"], shared["error"]) == (
        "gloo", False, "ran", None)
    assert [r["outcome"] for r in shared["ranks"]] == ["ok", "ok"]


def test_models_option_selects_a_subset() -> None:
    result = run_command([sys.executable, str(SCRIPT), "--dry-run", "--json", "--pushes", "1",
                          "--models", "qwen2.5-0.5b"], timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [p["model"] for p in report["ipc_push"]] == ["qwen2.5-0.5b"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_only_the_dry_run_runs() -> None:
    result = run_command([sys.executable, str(SCRIPT), "--json"], timeout=120)
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr and "--dry-run" in result.stderr
    assert result.stdout == ""
