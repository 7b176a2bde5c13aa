"""``compactionrl up``'s device plan: which GPUs each process gets, the weight
transport ``auto`` stands for, co-location, and the plans it refuses. Pure
arithmetic, checked for machines of 0, 1, 2 and 8 GPUs without any."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import main
from deploy.config import ConfigError, load_config
from deploy.device_plan import cuda_visible_devices, plan_devices
from deploy.up import Up
from learner.config import SHARED_GPU_RANKS_ENV

CONFIGS = Path(__file__).parents[2] / "deploy" / "configs"
H100 = CONFIGS / "gpu-8xh100.toml"


def plan_for(gpus: int, overrides: list[str], path: Path | None = None):
    return plan_devices(load_config(path, overrides), gpus)


def test_without_gpus_the_plan_is_the_cpu_one_with_gloo() -> None:
    plan = plan_for(0, ["--actors.count", "2"])
    assert plan.problems == ()
    assert plan.weight_transport == "gloo"
    assert all(p.devices == () and p.env() == {} for p in plan.processes)
    assert all(not p.waits_for for p in plan.processes)
    assert plan.process("actor-1").gpu_memory_utilization is None


def test_eight_gpus_put_the_learner_on_four_and_an_actor_on_each_other() -> None:
    plan = plan_devices(load_config(H100), 8)
    assert plan.problems == ()
    assert plan.weight_transport == "nccl" and plan.colocated == ()
    assert plan.process("learner").devices == (0, 1, 2, 3)
    assert plan.process("learner").env() == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}  # no cap
    assert [plan.process(f"actor-{i}").env() for i in range(4)] == [
        {"CUDA_VISIBLE_DEVICES": str(gpu)} for gpu in (4, 5, 6, 7)]
    assert plan.process("actor-3").ports == (9113,)
    assert plan.process("learner").ports == (5557, 5558, 9102)
    assert not plan.process("learner").waits_for


def test_automatic_assignment_follows_the_learner_and_tensor_parallel() -> None:
    plan = plan_for(8, ["--learner.nproc", "2", "--actors.count", "3",
                        "--actors.engine.tensor_parallel", "2"])
    assert plan.problems == ()
    assert plan.process("learner").devices == (0, 1)
    assert [plan.process(f"actor-{i}").devices for i in range(3)] == [(2, 3), (4, 5), (6, 7)]


@pytest.mark.parametrize("overrides", [
    [],  # automatic: one GPU, one actor
    ["--learner.gpus", "[0]", "--actors.gpus", "[0]"],  # explicit
])
def test_one_gpu_shared_is_ipc_with_the_engine_first_and_its_memory_lowered(
        overrides: list[str]) -> None:
    plan = plan_for(1, ["--actors.count", "1", *overrides])
    assert plan.problems == ()
    assert plan.weight_transport == "ipc" and plan.colocated == ("actor-0",)
    assert plan.process("learner").waits_for == ("actor-0",)
    assert plan.process("actor-0").devices == plan.process("learner").devices == (0,)
    assert plan.process("actor-0").gpu_memory_utilization == 0.5  # 1 - learner's 0.5
    # and the learner rank there caps its own allocator at its share
    assert plan.process("learner").env()[SHARED_GPU_RANKS_ENV] == "0"
    lower = plan_for(1, ["--actors.count", "1", "--learner.gpu_memory_fraction", "0.7"])
    assert lower.process("actor-0").gpu_memory_utilization == pytest.approx(0.3)
    # the engine's own setting wins where it asks for less
    modest = plan_for(1, ["--actors.count", "1", "--actors.engine.gpu_memory_utilization", "0.2"])
    assert modest.process("actor-0").gpu_memory_utilization == 0.2


def test_more_gpus_than_present_is_refused() -> None:
    [learner, actors] = plan_devices(load_config(H100), 2).problems
    assert "learner.gpus = [0, 1, 2, 3] names GPU 2, 3" in learner and "below 2" in learner
    assert "actors.gpus" in actors
    [ranks] = plan_for(2, ["--learner.nproc", "4", "--actors.count", "0"]).problems
    assert "learner.nproc = 4" in ranks and "lower learner.nproc" in ranks
    [engines] = plan_for(2, ["--actors.count", "3"]).problems
    assert "need 3 GPUs" in engines and "lower actors.count" in engines
    on_cpu = plan_devices(load_config(H100), 0).problems
    assert any("empty learner.gpus to run on the CPU" in p for p in on_cpu)
    [cpu] = plan_for(0, ["--learner.device", "cuda"]).problems
    assert "no GPU" in cpu and "learner.device = \"auto\"" in cpu


def test_a_gpu_under_two_nccl_ranks_is_refused_at_load_time() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["--actors.count", "1", "--learner.gpus", "[0]", "--actors.gpus", "[0]",
                           "--learner.weight_transport", "nccl"])
    [problem] = refused.value.problems
    assert "GPU 0" in problem and "NCCL refuses" in problem
    assert "weight_transport = \"auto\"" in problem and "actors.gpus" in problem
    # automatic co-location is only known to the plan: refused there
    [planned] = plan_for(1, ["--actors.count", "1", "--learner.weight_transport", "nccl"]).problems
    assert "NCCL refuses" in planned
    with pytest.raises(ConfigError) as twice:
        load_config(None, ["--learner.nproc", "2", "--learner.gpus", "[1, 1]"])
    assert "lists GPU 1 twice" in twice.value.problems[0]


def test_tensor_parallel_must_divide_an_actors_gpus() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["--actors.count", "2", "--actors.engine.tensor_parallel", "2",
                           "--actors.gpus", "[2, 3, 4]"])
    [problem] = refused.value.problems
    assert "not a whole number of engines" in problem and "multiple of 2" in problem
    with pytest.raises(ConfigError) as count:
        load_config(None, ["--actors.count", "2", "--actors.gpus", "[2, 3, 4]"])
    assert "count x tensor_parallel = 2" in count.value.problems[0]


def test_transports_the_plan_cannot_carry_are_refused() -> None:
    [ipc] = plan_for(8, ["--learner.weight_transport", "ipc"]).problems
    assert "no actor shares" in ipc and "\"auto\"" in ipc
    [cpu] = plan_for(0, ["--learner.weight_transport", "nccl"]).problems
    assert "runs on the CPU" in cpu
    # co-location under ipc is one engine on rank 0's GPU, and no other actor
    [mixed] = plan_for(2, ["--actors.count", "2", "--actors.gpus", "[0, 1]"]).problems
    assert "one weight transport" in mixed
    gloo = plan_for(2, ["--actors.count", "2", "--actors.gpus", "[0, 1]",
                        "--learner.weight_transport", "gloo"])
    assert gloo.problems == () and gloo.weight_transport == "gloo"


def test_indices_count_within_the_launchers_own_visible_devices() -> None:
    assert cuda_visible_devices((0, 1)) == "0,1"
    assert cuda_visible_devices((0, 1), "4,5,6") == "4,5"
    assert cuda_visible_devices((1,), "GPU-aa, GPU-bb") == "GPU-bb"


def test_cli_plan_prints_json_and_starts_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--plan", "--json", "--gpus", "8", "--config", str(H100)]) == 0
    shown = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert shown["weight_transport"] == "nccl" and shown["problems"] == []
    assert {p["name"]: p["env"].get("CUDA_VISIBLE_DEVICES") for p in shown["processes"]} == {
        "replay": None, "learner": "0,1,2,3", "actor-0": "4", "actor-1": "5", "actor-2": "6",
        "actor-3": "7"}
    assert main(["up", "--plan", "--gpus", "1"]) == 0
    shown = capsys.readouterr()
    assert "weights over ipc" in shown.out and "after actor-0 ready" in shown.out
    assert shown.err == ""
    assert main(["up", "--plan", "--gpus", "2", "--config", str(H100)]) == 2
    refused = capsys.readouterr().out
    assert "REFUSED: learner.gpus = [0, 1, 2, 3] names GPU 2, 3, but this machine" in refused
    assert main(["up", "--plan", "--json", "--gpus", "2", "--config", str(H100)]) == 2
    assert "compactionrl: refused: learner.gpus = [0, 1, 2, 3]" in capsys.readouterr().err


def test_gpus_other_than_present_only_preview(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("deploy.placement.on_gpu", lambda: False)
    assert main(["up", "--gpus", "2"]) == 2
    assert "only previews a plan" in capsys.readouterr().err


def test_up_gives_children_their_devices_and_holds_the_learner_for_the_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = load_config(None, ["--actors.count", "1"])
    up = Up(config, tmp_path, interactive=False, plan=plan_devices(config, 1))
    assert up.actors[0].env == {"CUDA_VISIBLE_DEVICES": "0"}
    # the learner rank on the shared GPU caps its memory (learner.gpu_memory_fraction)
    assert up.learner.env == {"CUDA_VISIBLE_DEVICES": "0", SHARED_GPU_RANKS_ENV: "0"}
    assert not up.actors[0].cores  # no CPU pinning on a GPU plan
    args = up.actors[0].args
    assert args[args.index("--actors.engine.gpu_memory_utilization") + 1] == "0.5"
    for learner_args in (up.learner.args, up.learner.restart_args):
        assert learner_args[learner_args.index("--learner.weight_transport") + 1] == "ipc"
    started: list[str] = []
    for child in (up.replay, up.learner, *up.actors):
        child.start = lambda child=child: started.append(child.name)  # type: ignore[method-assign]
    monkeypatch.setattr(up, "_write_state", lambda: None)
    up._start_first()
    assert started == ["replay", "actor-0"]
    ready = {"actor-0": False}
    monkeypatch.setattr(up, "_engine_ready", lambda actor: ready[actor])
    up._start_waiting(now=100.0)
    assert started == ["replay", "actor-0"]
    ready["actor-0"] = True
    up._start_waiting(now=101.0)  # asked again only after READY_POLL_S
    assert "learner" not in started
    up._start_waiting(now=103.0)
    assert started == ["replay", "actor-0", "learner"]


def test_up_refuses_a_plan_with_problems(tmp_path: Path) -> None:
    config = load_config(None, ["--actors.count", "3"])
    with pytest.raises(ConfigError) as refused:
        Up(config, tmp_path, interactive=False, plan=plan_devices(config, 2))
    assert "lower actors.count" in refused.value.problems[0]


async def _no_check(model: str, config: object) -> None:
    """Stands in for the episode check of a model that is not there."""


def test_up_starts_node_0_of_a_learner_on_several_nodes_and_names_the_others_command(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    import actors.preflight
    import deploy.up

    started: list[Up] = []
    monkeypatch.setattr("deploy.placement.on_gpu", lambda: False)
    monkeypatch.setattr(deploy.up, "prepare_model", lambda config: None)
    # no model is bootstrapped here, so the episode check has none to load
    monkeypatch.setattr(actors.preflight, "check_episode_setup", _no_check)
    monkeypatch.setattr(Up, "run", lambda self: started.append(self) or 0)
    assert main(["up", "--run.out_dir", str(tmp_path), "--learner.nnodes", "2",
                 "--learner.rdzv_endpoint", "10.0.0.1:29400"]) == 0
    [up] = started
    assert up.config.learner.node_rank == 0 and up.config.learner.nnodes == 2
    told = capsys.readouterr().err
    assert "spans 2 nodes" in told
    assert f"compactionrl learner --config {tmp_path}/" in told
    assert "--learner.node_rank K" in told
