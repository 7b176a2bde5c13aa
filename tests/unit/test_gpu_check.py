"""bench/gpu_check.py and its parts (bench/gpu_parts/): its CPU dry run (the
same code as on a GPU, with shared memory for CUDA IPC, the project's ipc
channel on its CPU twin, gloo for NCCL and a tiny model for the learner
part), its manifests, its checksum, its models and FLOP count, the weight
group's trials. The GPU run itself happens only on a machine with a GPU."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.processes import run_command
from tests.scripts import import_script

#: The tests that run the script (its dry run starts process groups; ~30 s in
#: all) are slow, so that this module starts early on its xdist worker
#: (tests/conftest.py); the rest are plain unit tests.

SCRIPT = Path(__file__).parents[2] / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    return import_script(SCRIPT, "gpu_check_bench")


@pytest.fixture(scope="module")
def common(gpu_check: ModuleType) -> ModuleType:
    return sys.modules["gpu_parts.common"]  # imported by the script


@pytest.fixture(scope="module")
def learner_part(gpu_check: ModuleType) -> ModuleType:
    return sys.modules["gpu_parts.learner_part"]


@pytest.fixture(scope="module")
def weight_group(gpu_check: ModuleType) -> ModuleType:
    return sys.modules["gpu_parts.weight_group"]


def test_manifests_have_the_published_parameter_counts(common: ModuleType) -> None:
    """As Hugging Face counts them (a tied lm_head counted once)."""
    counts = {name: sum(common.numel(shape) for _, shape in common.manifest(model))
              for name, model in common.MODELS.items()}
    assert counts == {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304,
                      "qwen2.5-7b": 7_615_616_512}


def test_the_checksum_sees_a_changed_or_moved_element(common: ModuleType) -> None:
    specs = [("a", (3, 5)), ("b", (7,))]
    tensors = [common.deterministic(i, shape, "cpu") for i, (_, shape) in enumerate(specs)]
    original = common.digest(specs, tensors)
    assert common.digest(specs, [t.clone() for t in tensors]) == original
    changed = [t.clone() for t in tensors]
    changed[0][1, 2] += 1
    moved = [tensors[0], tensors[1].flip(0)]
    assert common.digest(specs, changed) != original
    assert common.digest(specs, moved) != original


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, Path]]:
    """The whole dry run, once: its report (stdout's last line) and --out folder."""
    out = tmp_path_factory.mktemp("gpu_check")
    result = run_command([sys.executable, str(SCRIPT), "--dry-run", "--json", "--pushes", "2",
                          "--out", str(out)], timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    yield json.loads(result.stdout.strip().splitlines()[-1]), out


@pytest.mark.slow
def test_dry_run_pushes_every_model_intact(common: ModuleType,
                                           dry_run: tuple[dict, Path]) -> None:
    report, _ = dry_run
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert report["torch"] == torch.__version__
    assert [p["model"] for p in report["ipc_push"]] == list(common.MODELS)
    for push in report["ipc_push"]:
        specs = common.manifest(common.MODELS[push["model"]], common.DRY_RUN_DIVISOR)
        params = sum(common.numel(shape) for _, shape in specs)
        assert push["checksum_equal"] is True, push
        assert (push["tensors"], push["params"], push["bytes"]) == (len(specs), params,
                                                                     2 * params)
        assert push["seconds"] > 0 and push["gbps"] == pytest.approx(
            push["bytes"] / push["seconds"] / 1e9)
    shared = report["nccl_shared_gpu"]  # gloo on CPU: two ranks on one device are fine
    assert (shared["backend"], shared["refused"], shared["outcome"], shared["error"]) == (
        "gloo", False, "ran", None)
    assert [r["outcome"] for r in shared["ranks"]] == ["ok", "ok"]


@pytest.mark.slow
def test_dry_run_moves_every_publication_through_the_project_s_ipc_channel_intact(
        common: ModuleType, dry_run: tuple[dict, Path]) -> None:
    """protocol/weights_ipc.py between two processes, loaded as the
    publications come and, through the receive-ahead thread, on a loader of
    its own: every tensor of every publication has the sender's checksum."""
    report, _ = dry_run
    specs = common.manifest(common.MODELS["qwen2.5-0.5b"], common.DRY_RUN_DIVISOR)
    nbytes = 2 * sum(common.numel(shape) for _, shape in specs)
    plans = common.DRY_RUN_TRANSFER
    expected = {"project_ipc": (3, 0, False),  # --pushes 2 after a warm-up
                "receive_ahead_streams": (plans["receive_ahead_streams"].pushes + 1,
                                          common.RECEIVE_AHEAD, True)}
    for part, (pushes, ahead, side_stream) in expected.items():
        result = report[part]
        assert result["error"] is None and result["checksums_match"] is True, result
        assert result["mismatched"] == {}
        assert (result["pushes"], result["ahead"], result["side_stream"]) == (
            pushes, ahead, side_stream)
        assert (result["tensors"], result["bytes"]) == (len(specs), nbytes)
        assert result["bucket_bytes"] == plans[part].bucket_bytes < nbytes  # several buckets
        assert result["push_s"] > 0 and result["load_s"] > 0


@pytest.mark.slow
def test_dry_run_sender_survives_a_receiver_killed_mid_broadcast_and_reaches_the_survivor(
        dry_run: tuple[dict, Path]) -> None:
    """The weight group on gloo, every member with a first group of its own:
    the receiver dies in the second publication; the sender fails within its
    deadline (that one, or the next if every byte had left it), lives, and
    publishes intact to the survivor in a new generation; both still answer
    after the window."""
    report, _ = dry_run
    group = report["weight_group"]
    killed = group["receiver_killed"]
    assert killed["error"] is None and group["backend"] == "gloo"
    assert killed["receiver_died"] is True and killed["sender_survived"] is True
    assert killed["sender_exitcode"] is None
    assert killed["first_publication_checksums_match"] is True
    assert killed["failed_in_publication"] in (2, 3), killed
    assert killed["failure"].startswith("TransferFailed")
    assert 0 <= killed["failed_within_s"] < group["deadline_s"]
    assert killed["republished"] is True and killed["republish_generation"] == 2
    assert killed["republish_checksums_match"] is True
    assert killed["alive_after_window"] == {"sender": True, "survivor": True}
    first, killed_in, last = (killed["publications"][i] for i in (0, 1, -1))
    assert first == {"number": 1, "generation": 1, "world_size": 3, "sender": "ok",
                     "survivor": "ok", "doomed": "ok"}
    assert killed_in["doomed"] == "died"
    assert last == {"number": last["number"], "generation": 2, "world_size": 2,
                    "sender": "ok", "survivor": "ok"}
    assert group["before_fix"] == {"skipped": "gloo: no heartbeat monitor to end a process"}


@pytest.mark.slow
def test_dry_run_fails_publications_on_both_sides_and_keeps_no_bucket_without_the_collector(
        weight_group: ModuleType, dry_run: tuple[dict, Path]) -> None:
    """Each failed round leaves a broadcast in flight on both sides (the
    sender's times out on a stalled receiver, the receiver's on the
    abandoned generation); the publication after them arrives whole. Both
    processes never collect garbage: the broadcast buffers still alive after
    the failures are at most one bucket more than before (a bucket kept per
    failure would be two). GPU memory is measured on a GPU only."""
    report, _ = dry_run
    failed = report["weight_group"]["failed_publications"]
    plan = weight_group.DRY_RUN_PLAN
    assert failed["error"] is None and failed["every_round_failed_on_both"] is True, failed
    assert failed["rounds"] == plan.rounds >= 2
    assert "did not complete by its deadline" in failed["first_failures"]["sender"]
    assert failed["warm_and_final_intact"] and failed["final_checksums_match"]
    assert failed["bucket_bytes"] == plan.memory_bucket_bytes
    assert failed["publication_bytes"] > 3 * failed["bucket_bytes"]  # a bucket in flight
    assert failed["within_one_bucket"] is True
    for kept in failed["retained"].values():
        assert kept["buffers"] <= 1 and kept["buffer_bytes"] <= failed["bucket_bytes"]
        assert kept["allocated_bytes"] is None
    assert failed["collections"] == {"sender": 0, "receiver": 0}
    assert failed["seconds"] > 0


@pytest.mark.slow
def test_dry_run_a_late_rank_0_reaches_a_member_whose_deadline_is_longer(
        weight_group: ModuleType, dry_run: tuple[dict, Path]) -> None:
    """Rank 0 starts to broadcast ``late_s`` after the join, within the
    member's announced deadline: the publication arrives intact. The member
    started as an engine (start_environments' init timeout); on gloo the
    variants before the fixes deliver too (no NCCL init timeout, no
    environment check, no GPU worker), and only rank 0's outcome with the
    fix is waited for."""
    from protocol.weights_collective import (
        MAX_LANES,
        NCCL_INIT_TIMEOUT,
        member_timeout_s,
        start_environments,
    )

    report, _ = dry_run
    unequal = report["weight_group"]["unequal_deadlines"]
    plan = weight_group.DRY_RUN_PLAN
    assert unequal["error"] is None, unequal
    deadline = plan.unequal_deadline_s
    assert (unequal["weight_timeout_s"], unequal["late_s"]) == (deadline, plan.late_s)
    assert unequal["member_deadline_s"] == member_timeout_s(deadline,
                                                            weight_group.UNEQUAL_LANES)
    assert unequal["init_timeout_before_s"] == 30
    fixed = unequal["fixed"]
    assert fixed["member"] == fixed["sender"] == "ok" and fixed["publication_intact"] is True
    assert fixed["rank0_late_s"] >= plan.late_s
    assert plan.late_s / 2 < fixed["member_waited_s"] < unequal["member_deadline_s"]
    assert fixed["nccl_check"] is None
    engine = start_environments(deadline).engine
    assert fixed["member_environment"][NCCL_INIT_TIMEOUT] == engine[NCCL_INIT_TIMEOUT]
    assert float(engine[NCCL_INIT_TIMEOUT]) == member_timeout_s(deadline, MAX_LANES) > (
        unequal["member_deadline_s"])
    assert fixed["member_environment"]["NCCL_ASYNC_ERROR_HANDLING"] is None
    before = unequal["init_timeout_before"]
    assert before["member_environment"][NCCL_INIT_TIMEOUT] == "30"
    old = unequal["environment_before"]
    assert old["member_environment"]["NCCL_ASYNC_ERROR_HANDLING"] == "2"  # no GPU worker here
    for variant in (before, old):
        assert variant["member"] == "ok" and variant["nccl_check"] is None
        assert "sender" not in variant and "publication_intact" not in variant
    assert unequal["seconds"] > plan.late_s


@pytest.mark.slow
def test_dry_run_a_receiver_dead_after_its_join_fails_the_sender_within_its_deadline(
        dry_run: tuple[dict, Path]) -> None:
    report, _ = dry_run
    joined = report["weight_group"]["killed_after_join"]
    assert joined["error"] is None and joined["receiver_died"] is True, joined
    assert joined["sender_failure"].startswith("TransferFailed")
    assert 0 <= joined["failed_within_s"] <= joined["deadline_s"]
    assert joined["sender_alive"] is True


def test_members_start_as_a_run_starts_them_and_as_before_each_fix(
        weight_group: ModuleType) -> None:
    """Rank 0 starts as a learner rank, the members as engines; on CUDA a
    member then holds what vLLM's GPU worker leaves: the project's check
    accepts that, the check before f0952a3 refused it (the GPU check would
    have failed on that code). Before issue 62's fix: no dump setting, no
    check. The unequal deadlines' plan puts rank 0 past the engines' init
    timeout before, within the member's deadline."""
    from protocol.weights_collective import (
        NCCL_DUMP_ON_TIMEOUT,
        NCCL_INIT_TIMEOUT,
        VLLM_GPU_WORKER_REMOVES,
        member_timeout_s,
        nccl_environment_problem,
        start_environments,
    )

    def on_cuda(start: Any) -> dict[str, str]:
        """What the member holds once started on CUDA (group_member's removal)."""
        return {name: value for name, value in start.environment.items()
                if not (start.engine and name in VLLM_GPU_WORKER_REMOVES)}

    learner, engine = weight_group.starts("fixed", 36.0)
    now = start_environments(36.0)
    assert now.learner.items() <= learner.environment.items()
    assert now.engine.items() <= engine.environment.items()
    assert (learner.engine, engine.engine, learner.check, engine.check) == (
        False, True, "project", "project")
    assert learner.collector and engine.collector
    for start in (learner, engine):
        assert nccl_environment_problem(on_cuda(start)) is None
        assert start.environment["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == str(
            weight_group.HEARTBEAT_TIMEOUT_S)
    old_learner, old_engine = weight_group.starts("environment_before", 36.0)
    check = weight_group.CHECKS[old_engine.check]
    assert check is weight_group.problem_before_f0952a3
    assert check(old_learner.environment) is None and check(old_engine.environment) is None
    assert check(on_cuda(old_learner)) is None  # a learner rank has no GPU worker
    assert "NCCL_ASYNC_ERROR_HANDLING" in check(on_cuda(old_engine))
    assert old_engine.environment[NCCL_INIT_TIMEOUT] == "30"
    _, late = weight_group.starts("init_timeout_before", 36.0)
    assert late.environment[NCCL_INIT_TIMEOUT] == "30"
    assert nccl_environment_problem(on_cuda(late)) is None
    for start in weight_group.starts("before_fix", 10.0):
        assert start.check == "none" and NCCL_DUMP_ON_TIMEOUT not in start.environment
        assert weight_group.CHECKS[start.check](on_cuda(start)) is None
        assert nccl_environment_problem(start.environment)
    assert weight_group.role_starts({"a": 0, "b": 1}, "fixed", 10.0, collector=False) == {
        "a": replace(weight_group.starts("fixed", 10.0)[0], collector=False),
        "b": replace(weight_group.starts("fixed", 10.0)[1], collector=False)}
    plan, before = weight_group.GPU_PLAN, weight_group.ENGINE_INIT_TIMEOUT_BEFORE_S
    assert plan.window_s > weight_group.HEARTBEAT_TIMEOUT_S
    assert plan.unequal_deadline_s > before and before + 5 <= plan.late_s
    assert plan.late_s + 5 <= member_timeout_s(plan.unequal_deadline_s,
                                               weight_group.UNEQUAL_LANES)
    assert plan.rounds == 5 and plan.memory_bucket_bytes >= 256 << 20


def test_without_pyzmq_the_transfer_parts_say_so_and_count_as_intact(
        gpu_check: ModuleType, common: ModuleType, weight_group: ModuleType,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU machine without the carried wheels: no part of the project's
    transfer runs, each says why, and the check's exit status ignores them."""
    # the modules that import pyzmq, imported afresh (and failing) in here
    for name in ("protocol.transport", "protocol.endpoint", "protocol.weights",
                 "protocol.weights_store", "protocol.weights_ipc", "protocol.weights_collective"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "zmq", None)  # its import fails as if not installed
    plans, group = common.DRY_RUN_TRANSFER, weight_group.DRY_RUN_PLAN
    reports = gpu_check.transfer_parts("cpu", list(gpu_check.PARTS), plans, group)
    assert list(reports) == list(gpu_check.TRANSFER_PARTS)
    for report in reports.values():
        assert report["error"].startswith("skipped: pyzmq/msgspec not installed"), report
    assert gpu_check.transfers_intact(reports) is True
    assert gpu_check.transfer_parts("cpu", ["learner"], plans, group) == dict.fromkeys(
        gpu_check.TRANSFER_PARTS)


def test_a_dead_sender_or_a_differing_checksum_fails_the_check(gpu_check: ModuleType) -> None:
    held = {"receiver_killed": {"error": None, "sender_survived": True,
                                "first_publication_checksums_match": True,
                                "republish_checksums_match": True,
                                "alive_after_window": {"sender": True, "survivor": True}},
            "before_fix": {"skipped": "gloo"},
            "failed_publications": {"error": None, "every_round_failed_on_both": True,
                                    "within_one_bucket": True, "final_checksums_match": True,
                                    "collections": {"sender": 0, "receiver": 0}},
            "killed_after_join": {"error": None, "sender_alive": True, "failed_within_s": 3.0,
                                  "deadline_s": 10.0},
            "unequal_deadlines": {"error": None, "fixed": {"publication_intact": True}}}
    intact = {"project_ipc": {"error": None, "checksums_match": True},
              "receive_ahead_streams": None, "weight_group": held}
    assert gpu_check.transfers_intact(intact) is True
    broken = [("receiver_killed", "sender_survived", False),
              ("receiver_killed", "republish_checksums_match", False),
              ("receiver_killed", "alive_after_window", {"sender": False, "survivor": True}),
              ("failed_publications", "within_one_bucket", False),
              ("killed_after_join", "failed_within_s", 30.0),
              ("failed_publications", "collections", {"sender": 1, "receiver": 0}),
              ("killed_after_join", "sender_alive", False),
              ("unequal_deadlines", "fixed", {"publication_intact": False}),
              ("unequal_deadlines", "error", "TimeoutError")]
    for trial, key, value in broken:
        group = {**held, trial: {**held[trial], key: value}}
        assert gpu_check.transfers_intact({**intact, "weight_group": group}) is False, key
    assert gpu_check.transfers_intact(
        {**intact, "project_ipc": {"error": None, "checksums_match": False}}) is False
    assert gpu_check.transfers_intact({**intact, "project_ipc": {"error": "Timeout"}}) is False


def test_learner_models_have_the_published_shapes(common: ModuleType,
                                                  learner_part: ModuleType) -> None:
    """The policy written in the script has, name for name, the shapes of the
    manifest (so its parameter count is Hugging Face's); the critic, the
    learner's, is the same body plus a scalar head. Built on the meta device:
    nothing allocated."""
    for name in learner_part.LEARNER_MODELS:
        shape = common.MODELS[name]
        with torch.device("meta"):
            policy = learner_part.Qwen2ForCausalLM(shape)
            critic = learner_part.critic_model(shape)
        expected = dict(common.manifest(shape))
        assert {k: tuple(p.shape) for k, p in policy.named_parameters()} == expected
        assert {k: tuple(p.shape) for k, p in critic.named_parameters()} == {
            **{k.replace("model.", "body.", 1): v for k, v in expected.items()},
            "head.weight": (1, shape.hidden), "head.bias": (1,)}


def test_flop_count_is_written_out(common: ModuleType, learner_part: ModuleType) -> None:
    """6 FLOPs per matmul parameter and token for both models, the critic's
    embedding (a lookup) left out, and 6*layers*hidden*seq per model for
    causal attention (half the full score matrix); for 0.5B at 2k tokens,
    ~5.1 + 2 x 0.26 GFLOP per token."""
    counts = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304}
    for name, n_policy in counts.items():
        shape = common.MODELS[name]
        flops = learner_part.flop_count(shape, (2048, 16384))
        n_critic = n_policy + shape.hidden + 1
        assert (flops["n_policy"], flops["n_critic"]) == (n_policy, n_critic)
        # everything but the embedding and the final norm is in the layers
        assert flops["n_layers"] == n_policy - shape.vocab * shape.hidden - shape.hidden
        dense = 6 * (n_policy + n_critic - shape.vocab * shape.hidden)
        assert flops["dense_per_token"] == dense
        for seq in (2048, 16384):
            attention = 6 * shape.layers * shape.hidden * seq
            assert flops["attention_per_token_per_model"][str(seq)] == attention
            assert flops["per_token"][str(seq)] == dense + 2 * attention
            assert flops["per_token_value_head"][str(seq)] == (
                6 * (n_policy + shape.hidden + 1) + attention)
    small = learner_part.flop_count(common.MODELS["qwen2.5-0.5b"], (2048,))
    assert small["dense_per_token"] == pytest.approx(5.11e9, rel=0.01)
    assert small["attention_per_token_per_model"]["2048"] == pytest.approx(2.64e8, rel=0.01)
    assert "6*(N_policy + N_critic - vocab*hidden)" in small["formula"]
    assert "2*6*layers*hidden*seq" in small["formula"]


def test_hardware_flops_add_what_the_switches_compute_again(common: ModuleType,
                                                            learner_part: ModuleType) -> None:
    """HFU's count: checkpointing runs every layer's forward again (the
    layers' matmuls and causal attention, per body), the chunked log-softmax
    the output layer, and micro-batches a forward for the old values before
    the passes (the critic's, or the policy's with its value head); MFU's
    count is the same whatever the switches."""
    shape = common.MODELS["qwen2.5-0.5b"]
    flops = learner_part.flop_count(shape, (2048,))
    model, model_value_head = flops["per_token"]["2048"], flops["per_token_value_head"]["2048"]
    attention_forward = 2 * shape.layers * shape.hidden * 2048
    layer_forward = 2 * flops["n_layers"] + attention_forward
    output_layer = 2 * shape.vocab * shape.hidden
    critic_forward = 2 * (flops["n_critic"] - shape.vocab * shape.hidden) + attention_forward
    value_head_forward = 2 * (flops["n_policy"] + shape.hidden + 1) + attention_forward
    expected = {
        frozenset(): (model, model),
        frozenset({"microbatches"}): (model, model + critic_forward),
        frozenset({"checkpointing"}): (model, model + 2 * layer_forward),
        frozenset({"chunked_logprobs"}): (model, model + output_layer),
        frozenset(learner_part.SWITCHES): (
            model, model + 2 * layer_forward + output_layer + critic_forward),
        learner_part.SWITCH_SETS["all_value_head"]: (
            model_value_head,
            model_value_head + layer_forward + output_layer + value_head_forward),
    }
    for switches, (model_flops, hardware_flops) in expected.items():
        assert learner_part.flops_per_token(flops, 2048, switches) == {
            "model": model_flops, "hardware": hardware_flops}, switches
    assert "2*N_layers + 2*layers*hidden*seq" in flops["formula"]
    assert "2*vocab*hidden" in flops["formula"]
    assert "2*(N_critic - vocab*hidden) + 2*layers*hidden*seq" in flops["formula"]


def test_the_learner_s_log_probabilities_take_the_script_s_model_with_and_without_chunks(
        learner_part: ModuleType) -> None:
    """The plain-torch policy answers the learner's log-probability function
    as a loaded policy does: [B, L] rows, 0 at token 0, the same values and
    gradients whether the output layer runs in chunks or at once."""
    shape = learner_part.DRY_RUN_LEARNER_SHAPE
    ids = torch.randint(shape.vocab, (2, 37), generator=torch.Generator().manual_seed(0))
    results = []
    for chunk in (0, 16):
        policy = learner_part.build(learner_part.Qwen2ForCausalLM, shape, "cpu")
        logprobs = learner_part.token_logprobs(policy, ids, chunk)
        logprobs.sum().backward()
        results.append((logprobs.detach(), [p.grad for p in policy.parameters()]))
    (whole, whole_grads), (chunked, chunked_grads) = results
    assert whole.shape == (2, 37) and not whole[:, 0].any()
    torch.testing.assert_close(chunked, whole)
    for chunked_grad, whole_grad in zip(chunked_grads, whole_grads, strict=True):
        torch.testing.assert_close(chunked_grad, whole_grad)


def test_the_learner_part_runs_the_learner_s_own_sharding_log_probabilities_and_step(
        learner_part: ModuleType) -> None:
    """The script imports the learner's functions from the checkout instead
    of keeping copies that drift (they did: the output layer's bf16 gradient
    summed in bf16, one log-probability fewer per row, both losses
    backpropagated together where the learner frees the critic's
    activations before the policy's forward)."""
    from learner import models, ppo

    assert learner_part.shard is models.shard
    assert learner_part.token_logprobs is models.token_logprobs
    assert learner_part.Critic is models.Critic
    assert learner_part.PPOTrainer is ppo.PPOTrainer



def test_without_a_learner_dependency_the_learner_part_says_which_to_carry() -> None:
    """The GPU machine without a wheel the learner package needs (here
    prometheus_client, which learner/ppo.py reaches through ops): the part
    is skipped, naming the missing package."""
    result = run_command([sys.executable, "-c", (
        "import sys; sys.modules['prometheus_client'] = None; "
        f"sys.path.insert(0, {str(SCRIPT.parent)!r}); "
        "from gpu_parts.learner_part import LEARNER_UNAVAILABLE; print(LEARNER_UNAVAILABLE)")],
        timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.startswith(
        "skipped: prometheus_client, which the learner package needs, is not installed")

@pytest.mark.slow
def test_dry_run_learner_part(common: ModuleType, learner_part: ModuleType,
                              dry_run: tuple[dict, Path]) -> None:
    report, out = dry_run
    assert json.loads((out / "gpu_check.json").read_text()) == report
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json"]  # the export is gone
    learner = report["learner"]
    plan = learner_part.DRY_RUN_PLAN
    assert learner["errors"] == 0 and learner["peak_flops"] is None
    assert learner["plan"]["lengths"] == [64, 128, 256] == list(plan.lengths)
    assert learner["switch_sets"] == {k: sorted(v) for k, v in learner_part.SWITCH_SETS.items()}
    shape = learner_part.DRY_RUN_LEARNER_SHAPE
    expected_flops = json.loads(json.dumps(learner_part.flop_count(shape, plan.lengths)))
    assert [m["model"] for m in learner["models"]] == list(learner_part.LEARNER_MODELS)
    for model in learner["models"]:
        assert model["error"] is None
        assert model["flops"] == expected_flops
        error = model["logprob_error"]
        assert (error["sequences"], error["length"]) == (plan.precision_sequences, 64)
        assert 0 <= error["mean_abs"] <= error["max_abs"] < 0.1
        assert error["chunked_vs_whole_bf16_max_abs"] < 0.1
        export = model["export"]
        assert export["tensors"] == len(common.manifest(shape))
        assert export["bytes"] > 2 * model["flops"]["n_policy"]  # bf16, plus pickle framing
        assert export["gather_seconds"] > 0 and export["export_seconds"] > 0
        assert model["fit"] == {name: {"fits": [64, 128, 256], "does_not_fit": [],
                                       "first_unfit_length": None}
                                for name in learner_part.SWITCH_SETS}
    cases = learner["cases"]
    assert [(c["switches"], c["model"], c["length"]) for c in cases] == [
        (s, m, n) for s in learner_part.SWITCH_SETS for m in learner_part.LEARNER_MODELS
        for n in plan.lengths]
    for case in cases:
        assert case["outcome"] == "ok", case
        assert case["on"] == sorted(learner_part.SWITCH_SETS[case["switches"]])
        assert case["tokens_per_step"] == 2 * case["length"]
        assert case["passes"] == (2 if "microbatches" in case["on"] else 1)
        assert len(case["step_seconds_each"]) == plan.steps and case["step_seconds"] > 0
        assert case["tokens_per_second"] == pytest.approx(
            case["tokens_per_step"] / case["step_seconds"])
        switches = learner_part.SWITCH_SETS[case["switches"]]
        assert case["flops_per_token"] == learner_part.flops_per_token(
            expected_flops, case["length"], switches)
        # on a CPU: no MFU or HFU (the peak is a GPU's) and no CUDA memory figures
        assert case["mfu"] is None and case["hfu"] is None
        assert case["peak_allocated_bytes"] is None and case["peak_reserved_bytes"] is None


def test_out_of_memory_is_recorded_as_does_not_fit(learner_part: ModuleType,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU would raise, raised here: the case does not fit, the first
    such length per switch set is reported, and other failures are errors."""
    def run_case(shape: object, length: int, *args: object) -> dict:
        if length >= 128:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB\nmore")
        if length == 100:
            raise RuntimeError("something else")
        return {"outcome": "ok"}

    monkeypatch.setattr(learner_part, "run_case", run_case)
    plan, switches = learner_part.DRY_RUN_PLAN, learner_part.SWITCH_SETS["none"]
    cases = [{"model": "m", "switches": "none", "length": length,
              **learner_part.learner_case(learner_part.DRY_RUN_LEARNER_SHAPE, length,
                                          switches, plan, "cpu", deadline=float("inf"))}
             for length in (64, 100, 128, 256)]
    assert [c["outcome"] for c in cases] == ["ok", "error", "does_not_fit", "does_not_fit"]
    assert cases[2]["error"] == "CUDA out of memory. Tried to allocate 2 GiB"
    assert cases[1]["error"] == "RuntimeError: something else"
    assert learner_part.fit(cases, "m")["none"] == {"fits": [64], "does_not_fit": [128, 256],
                                                    "first_unfit_length": 128}
    assert learner_part.fit(cases, "m")["all"] == {"fits": [], "does_not_fit": [],
                                                   "first_unfit_length": None}


@pytest.mark.slow
def test_budget_skips_the_learner_cases(gpu_check: ModuleType, learner_part: ModuleType) -> None:
    result = run_command([sys.executable, str(SCRIPT), "--dry-run", "--json", "--parts",
                          "learner", "--budget-s", "0"], timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ipc_push"] is None and report["nccl_shared_gpu"] is None
    assert all(report[part] is None for part in gpu_check.TRANSFER_PARTS)
    learner = report["learner"]
    assert learner["budget_s"] == 0 and learner["errors"] == 0
    assert len(learner["cases"]) == len(learner_part.SWITCH_SETS) * 2 * 3
    assert {(c["outcome"], c["error"]) for c in learner["cases"]} == {
        ("skipped", "past --budget-s")}
    for model in learner["models"]:
        assert model["error"] == "skipped: past --budget-s" and model["export"] is None
        assert all(f["first_unfit_length"] is None for f in model["fit"].values())


@pytest.mark.slow
def test_parts_and_models_options_select_a_subset() -> None:
    result = run_command([sys.executable, str(SCRIPT), "--dry-run", "--json", "--pushes", "1",
                          "--parts", "ipc", "--models", "qwen2.5-0.5b"], timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [p["model"] for p in report["ipc_push"]] == ["qwen2.5-0.5b"]
    assert report["nccl_shared_gpu"] is None and report["learner"] is None
    assert report["project_ipc"] is None and report["weight_group"] is None


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_only_the_dry_run_runs() -> None:
    result = run_command([sys.executable, str(SCRIPT), "--json"], timeout=120)
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr and "--dry-run" in result.stderr
    assert result.stdout == ""
