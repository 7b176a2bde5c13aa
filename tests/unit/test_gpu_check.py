"""bench/gpu_check.py: its CPU dry run (the same code as on a GPU, with shared
memory for CUDA IPC, gloo for NCCL and a tiny model for the learner part),
its manifests, its checksum, its models and FLOP count. The GPU run itself
happens only on a machine with a GPU."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.processes import run_command
from tests.scripts import import_script

SCRIPT = Path(__file__).parents[2] / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    return import_script(SCRIPT, "gpu_check_bench")


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


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, Path]]:
    """The whole dry run, once: its report (stdout's last line) and --out folder."""
    out = tmp_path_factory.mktemp("gpu_check")
    result = run_command([sys.executable, str(SCRIPT), "--dry-run", "--json", "--pushes", "2",
                          "--out", str(out)], timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    yield json.loads(result.stdout.strip().splitlines()[-1]), out


def test_dry_run_pushes_every_model_intact(gpu_check: ModuleType,
                                           dry_run: tuple[dict, Path]) -> None:
    report, _ = dry_run
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


def test_learner_models_have_the_published_shapes(gpu_check: ModuleType) -> None:
    """The policy written in the script has, name for name, the shapes of the
    manifest (so its parameter count is Hugging Face's); the critic is the
    same body plus a scalar head. Built on the meta device: nothing allocated."""
    for name in gpu_check.LEARNER_MODELS:
        shape = gpu_check.MODELS[name]
        with torch.device("meta"):
            policy, critic = gpu_check.Policy(shape), gpu_check.Critic(shape)
        expected = dict(gpu_check.manifest(shape))
        assert {k: tuple(p.shape) for k, p in policy.named_parameters()} == expected
        assert {k: tuple(p.shape) for k, p in critic.named_parameters()} == {
            **{k.replace("model.", "body.", 1): v for k, v in expected.items()},
            "head.weight": (1, shape.hidden), "head.bias": (1,)}


def test_flop_count_is_written_out(gpu_check: ModuleType) -> None:
    """6 FLOPs per matmul parameter and token for both models, the critic's
    embedding (a lookup) left out, and 12*layers*hidden*seq per model for
    attention; for 0.5B at 2k tokens, ~5.1 + 2 x 0.53 GFLOP per token."""
    counts = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304}
    for name, n_policy in counts.items():
        shape = gpu_check.MODELS[name]
        flops = gpu_check.flop_count(shape, (2048, 16384))
        n_critic = n_policy + shape.hidden + 1
        assert (flops["n_policy"], flops["n_critic"]) == (n_policy, n_critic)
        dense = 6 * (n_policy + n_critic - shape.vocab * shape.hidden)
        assert flops["dense_per_token"] == dense
        for seq in (2048, 16384):
            attention = 12 * shape.layers * shape.hidden * seq
            assert flops["attention_per_token_per_model"][str(seq)] == attention
            assert flops["per_token"][str(seq)] == dense + 2 * attention
    small = gpu_check.flop_count(gpu_check.MODELS["qwen2.5-0.5b"], (2048,))
    assert small["dense_per_token"] == pytest.approx(5.11e9, rel=0.01)
    assert small["attention_per_token_per_model"]["2048"] == pytest.approx(5.28e8, rel=0.01)
    assert "6*(N_policy + N_critic - vocab*hidden)" in small["formula"]
    assert "12*layers*hidden*seq" in small["formula"]


def test_chunked_logprobs_match_the_whole_pass(gpu_check: ModuleType) -> None:
    """The script's copy of the learner's chunked log-softmax: the same
    values and gradients as log_softmax over whole logits (float32)."""
    shape = gpu_check.DRY_RUN_LEARNER_SHAPE
    ids = torch.randint(shape.vocab, (2, 37), generator=torch.Generator().manual_seed(0))
    results = []
    for chunk in (0, 16):
        policy = gpu_check.build(gpu_check.Policy, shape, "cpu")
        logprobs = gpu_check.token_logprobs(policy, ids, chunk)
        logprobs.sum().backward()
        results.append((logprobs.detach(), [p.grad for p in policy.parameters()]))
    (whole, whole_grads), (chunked, chunked_grads) = results
    assert whole.shape == (2, 36)
    torch.testing.assert_close(chunked, whole)
    for chunked_grad, whole_grad in zip(chunked_grads, whole_grads, strict=True):
        torch.testing.assert_close(chunked_grad, whole_grad)


def test_dry_run_learner_part(gpu_check: ModuleType, dry_run: tuple[dict, Path]) -> None:
    report, out = dry_run
    assert json.loads((out / "gpu_check.json").read_text()) == report
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json"]  # the export is gone
    learner = report["learner"]
    plan = gpu_check.DRY_RUN_PLAN
    assert learner["errors"] == 0 and learner["peak_flops"] is None
    assert learner["plan"]["lengths"] == [64, 128, 256] == list(plan.lengths)
    assert learner["switch_sets"] == {k: sorted(v) for k, v in gpu_check.SWITCH_SETS.items()}
    shape = gpu_check.DRY_RUN_LEARNER_SHAPE
    expected_flops = json.loads(json.dumps(gpu_check.flop_count(shape, plan.lengths)))
    assert [m["model"] for m in learner["models"]] == list(gpu_check.LEARNER_MODELS)
    for model in learner["models"]:
        assert model["error"] is None
        assert model["flops"] == expected_flops
        error = model["logprob_error"]
        assert (error["sequences"], error["length"]) == (plan.precision_sequences, 64)
        assert 0 <= error["mean_abs"] <= error["max_abs"] < 0.1
        assert error["chunked_vs_whole_bf16_max_abs"] < 0.1
        export = model["export"]
        assert export["tensors"] == len(gpu_check.manifest(shape))
        assert export["bytes"] > 2 * model["flops"]["n_policy"]  # bf16, plus pickle framing
        assert export["gather_seconds"] > 0 and export["export_seconds"] > 0
        assert model["fit"] == {name: {"fits": [64, 128, 256], "does_not_fit": [],
                                       "first_unfit_length": None}
                                for name in gpu_check.SWITCH_SETS}
    cases = learner["cases"]
    assert [(c["switches"], c["model"], c["length"]) for c in cases] == [
        (s, m, n) for s in gpu_check.SWITCH_SETS for m in gpu_check.LEARNER_MODELS
        for n in plan.lengths]
    for case in cases:
        assert case["outcome"] == "ok", case
        assert case["on"] == sorted(gpu_check.SWITCH_SETS[case["switches"]])
        assert case["tokens_per_step"] == 2 * case["length"]
        assert case["passes"] == (2 if "microbatches" in case["on"] else 1)
        assert len(case["step_seconds_each"]) == plan.steps and case["step_seconds"] > 0
        assert case["tokens_per_second"] == pytest.approx(
            case["tokens_per_step"] / case["step_seconds"])
        # on a CPU: no MFU (the peak is a GPU's) and no CUDA memory figures
        assert case["mfu"] is None
        assert case["peak_allocated_bytes"] is None and case["peak_reserved_bytes"] is None


def test_out_of_memory_is_recorded_as_does_not_fit(gpu_check: ModuleType,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU would raise, raised here: the case does not fit, the first
    such length per switch set is reported, and other failures are errors."""
    def run_case(shape: object, length: int, *args: object) -> dict:
        if length >= 128:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB\nmore")
        if length == 100:
            raise RuntimeError("something else")
        return {"outcome": "ok"}

    monkeypatch.setattr(gpu_check, "run_case", run_case)
    plan, switches = gpu_check.DRY_RUN_PLAN, gpu_check.SWITCH_SETS["none"]
    cases = [{"model": "m", "switches": "none", "length": length,
              **gpu_check.learner_case(gpu_check.DRY_RUN_LEARNER_SHAPE, length, switches, plan,
                                       "cpu", deadline=float("inf"))}
             for length in (64, 100, 128, 256)]
    assert [c["outcome"] for c in cases] == ["ok", "error", "does_not_fit", "does_not_fit"]
    assert cases[2]["error"] == "CUDA out of memory. Tried to allocate 2 GiB"
    assert cases[1]["error"] == "RuntimeError: something else"
    assert gpu_check.fit(cases, "m")["none"] == {"fits": [64], "does_not_fit": [128, 256],
                                                 "first_unfit_length": 128}
    assert gpu_check.fit(cases, "m")["all"] == {"fits": [], "does_not_fit": [],
                                                "first_unfit_length": None}


def test_budget_skips_the_learner_cases(gpu_check: ModuleType) -> None:
    result = run_command([sys.executable, str(SCRIPT), "--dry-run", "--json", "--parts",
                          "learner", "--budget-s", "0"], timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ipc_push"] is None and report["nccl_shared_gpu"] is None
    learner = report["learner"]
    assert learner["budget_s"] == 0 and learner["errors"] == 0
    assert len(learner["cases"]) == len(gpu_check.SWITCH_SETS) * 2 * 3
    assert {(c["outcome"], c["error"]) for c in learner["cases"]} == {
        ("skipped", "past --budget-s")}
    for model in learner["models"]:
        assert model["error"] == "skipped: past --budget-s" and model["export"] is None
        assert all(f["first_unfit_length"] is None for f in model["fit"].values())


def test_parts_and_models_options_select_a_subset() -> None:
    result = run_command([sys.executable, str(SCRIPT), "--dry-run", "--json", "--pushes", "1",
                          "--parts", "ipc", "--models", "qwen2.5-0.5b"], timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [p["model"] for p in report["ipc_push"]] == ["qwen2.5-0.5b"]
    assert report["nccl_shared_gpu"] is None and report["learner"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_only_the_dry_run_runs() -> None:
    result = run_command([sys.executable, str(SCRIPT), "--json"], timeout=120)
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr and "--dry-run" in result.stderr
    assert result.stdout == ""
