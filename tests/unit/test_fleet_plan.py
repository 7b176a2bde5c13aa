"""Plans for fleets of several GPU types (deploy/fleet.py, deploy/device_plan.py):
the learner on the type where a rank fits, actors on the rest, each
process's memory on its own type, refusals naming only the fixes the
configuration does not have; models' shapes from a config.json or a known
family (deploy/model_shapes.py). Plain arithmetic: no GPU, no weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from deploy.cli import main
from deploy.config import load_config
from deploy.device_plan import plan_devices
from deploy.fleet import Fleet, parse_fleet
from deploy.memory_plan import GIB
from deploy.model_shapes import FAMILIES, shape_of

CONFIGS = Path(__file__).parents[2] / "deploy" / "configs"
GPU_7B = CONFIGS / "gpu-7b.toml"
H100 = CONFIGS / "gpu-8xh100.toml"
#: 8 x H100 80GB and 8 x A100 40GB as torch reports them.
MIXED = "h100=8x79.6,a100-40=8x39.4"
QWEN_7B = FAMILIES["Qwen2.5-7B"]
#: One actor co-located with a learner whose share of the GPU is too small.
CO_LOCATED = ["--actors.count", "1", "--learner.critic", "value_head",
              "--learner.gpu_memory_fraction", "0.3"]
#: What a refusal's fix sets, as the user writes it: ``section.field = value``.
SETTING = re.compile(r'([a-z_]+(?:\.[a-z_]+)+) = (\[[^\]]*\]|"[^"]*"|[^,;()\s]+)')
#: Each family's parameters as its model card gives them.
PUBLISHED = {"Qwen2.5-0.5B": 0.49e9, "Qwen2.5-1.5B": 1.54e9, "Qwen2.5-3B": 3.09e9,
             "Qwen2.5-7B": 7.61e9, "Qwen2.5-14B": 14.7e9, "Qwen2.5-32B": 32.5e9,
             "Llama-3-8B": 8.03e9, "Llama-3.2-1B": 1.24e9, "Llama-3.2-3B": 3.21e9}


@pytest.fixture
def config_json(tmp_path: Path) -> Path:
    """Qwen2.5-7B-Instruct's config.json alone, without the weights."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "tie_word_embeddings": False, "max_position_embeddings": 32768}))
    return path


def test_a_fleet_is_its_types_in_order_and_a_wrong_one_is_told() -> None:
    fleet = parse_fleet(MIXED)
    h100, a100 = fleet.types
    assert (h100.name, h100.count, a100.name, a100.count) == ("h100", 8, "a100-40", 8)
    assert a100.memory_bytes == int(39.4 * GIB)
    assert fleet.indices(a100) == range(8, 16) and fleet.size == 16
    assert fleet.types_of((7, 8)) == [h100, a100]
    for wrong in ("h100=8", "h100=0x79.6", "h100=8x79.6,h100=8x79.6", "8x79.6"):
        with pytest.raises(ValueError, match="NAME=COUNTxGIB|twice"):
            parse_fleet(wrong)


def test_known_families_match_their_published_sizes_and_config_json_is_read(
        config_json: Path) -> None:
    for name, parameters in PUBLISHED.items():
        assert FAMILIES[name].parameters == pytest.approx(parameters, rel=0.01), name
    assert shape_of("Qwen/Qwen2.5-7B-Instruct") == shape_of("qwen2.5-7b")
    from_file, from_folder = shape_of(str(config_json)), shape_of(str(config_json.parent))
    assert from_file == from_folder and from_file is not None
    assert from_file.parameters == QWEN_7B.parameters and from_file.source == str(config_json)
    assert shape_of("Qwen9-7B") is None and shape_of(str(config_json.parent / "none")) is None


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("gpu-*.toml")), ids=lambda p: p.name)
def test_the_shipped_gpu_configs_plan_a_mixed_fleet_from_a_config_json_alone(
        path: Path, config_json: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--plan", "--json", "--fleet", MIXED, "--model-shape", str(config_json),
                 "--config", str(path)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["problems"] == [] and plan["model_shape"] == str(config_json)
    processes = {p["name"]: p for p in plan["processes"]}
    learner = processes["learner"]
    assert learner["gpu_type"] == "h100"  # the larger type holds a rank
    assert isinstance(learner["memory"]["total_bytes"], int)
    assert learner["memory"]["total_bytes"] <= learner["memory"]["budget_bytes"] \
        == int(79.6 * GIB)
    actors = [p for name, p in processes.items() if name.startswith("actor-")]
    assert all(isinstance(a["memory"]["kv_tokens"], int) for a in actors)
    lanes = {lane["gpu_type"]: lane for lane in plan["lanes"]}
    if path.name == "gpu-7b.toml":  # 8 ranks fill the H100s; the engines go on the A100s
        assert lanes["a100-40"]["processes"] == [f"actor-{i}" for i in range(8)]
        assert {a["gpu_type"] for a in actors} == {"a100-40"}
        assert actors[0]["env"] == {"CUDA_VISIBLE_DEVICES": "8"}
    else:  # gpu-8xh100.toml lists its GPUs: all H100s, the A100s left free
        assert lanes["a100-40"] == {"gpu_type": "a100-40", "processes": [], "free": 8}


def test_the_learner_goes_to_the_larger_type_in_any_order() -> None:
    plan = plan_devices(load_config(GPU_7B), parse_fleet("a100-40=8x39.4,h100=8x79.6"),
                        QWEN_7B)
    assert plan.problems == ()
    assert plan.process("learner").devices == tuple(range(8, 16))
    assert [plan.process(f"actor-{i}").devices for i in (0, 7)] == [(0,), (7,)]
    table = plan.table()
    assert "lane 8 x h100 (79.6 GiB): learner; 0 free" in table
    assert "memory, actor-0 to actor-7 on a100-40: weights 14.2 GiB" in table


def test_an_engine_s_gpus_are_of_one_type() -> None:
    config = load_config(None, ["--actors.count", "3", "--actors.engine.tensor_parallel", "2"])
    plan = plan_devices(config, parse_fleet("h100=3x79.6,a100-40=4x39.4"))
    assert plan.problems == ()
    assert [plan.process(f"actor-{i}").devices for i in range(3)] == [(1, 2), (3, 4), (5, 6)]
    spanning = load_config(None, ["--learner.nproc", "2", "--learner.gpus", "[2, 3]",
                                  "--actors.count", "1", "--actors.gpus", "[0]"])
    [problem] = plan_devices(spanning, parse_fleet("h100=3x79.6,a100-40=4x39.4")).problems
    assert "the learner's GPUs 2, 3 are of types h100 and a100-40" in problem


def test_a_rank_over_its_type_is_refused_with_only_the_fixes_the_config_lacks() -> None:
    # gpu-8xh100 already has the value head: its rank (53.6 GiB) on A100s of 40
    value_head = plan_devices(load_config(H100), parse_fleet("a100-40=8x39.4"), QWEN_7B)
    [problem] = value_head.problems
    assert "more than the 39.4 GiB it has" in problem
    assert "learner.critic" not in problem and "max_tokens_per_microbatch" not in problem
    # 8 ranks fit but take the engines' GPUs; 6 ranks with smaller chunks leave two
    assert "learner.nproc = 8, learner.gpus = [0, 1, 2, 3, 4, 5, 6, 7] (39.4 GiB a rank, but " \
           "no GPU is left for an engine)" in problem
    assert "these together: learner.logprob_chunk_tokens = 1024, learner.nproc = 6, " \
           "learner.gpus = [0, 1, 2, 3, 4, 5], actors.count = 2, actors.gpus = [6, 7] " \
           "(38.9 GiB a rank: fits)" in problem
    # gpu-7b's critic model listed onto the A100s: the H100s and the value head each fit
    listed = load_config(GPU_7B, ["--learner.gpus", str(list(range(8, 16))),
                                  "--actors.gpus", str(list(range(8)))])
    [problem] = plan_devices(listed, parse_fleet(MIXED), QWEN_7B).problems
    assert "the learner on h100: learner.gpus = [0, 1, 2, 3, 4, 5, 6, 7], actors.gpus = " \
           "[8, 9, 10, 11, 12, 13, 14, 15] (79.6 GiB a GPU: fits)" in problem
    assert 'learner.critic = "value_head" (39.4 GiB a rank: fits)' in problem


def test_with_nothing_left_to_switch_the_refusal_says_so() -> None:
    config = load_config(H100, ["--learner.logprob_chunk_tokens", "1024"])
    [problem] = plan_devices(config, parse_fleet("l4=8x22.0"), QWEN_7B).problems
    assert "all of these together" not in problem
    assert "learner.nproc = 8" in problem  # the one switch left, and not enough
    alone = load_config(H100, ["--learner.logprob_chunk_tokens", "1024", "--learner.nproc", "8",
                               "--learner.gpus", "[0, 1, 2, 3, 4, 5, 6, 7]", "--actors.count",
                               "0", "--actors.gpus", "[]"])
    [problem] = plan_devices(alone, parse_fleet("l4=8x22.0"), QWEN_7B).problems
    assert "no switch is left to turn in this configuration" in problem


def test_a_co_located_learner_over_its_share_is_offered_a_gpu_of_its_own() -> None:
    config = load_config(None, CO_LOCATED)
    [problem] = plan_devices(config, Fleet.uniform(1, int(79.6 * GIB)),
                             FAMILIES["Qwen2.5-1.5B"]).problems
    assert "more than the 23.9 GiB it has" in problem
    # one GPU: a GPU of its own would leave the engine none
    assert "the learner on GPUs of its own (79.6 GiB a GPU, but no GPU is left for an " \
           "engine)" in problem
    listed = load_config(None, [*CO_LOCATED, "--learner.gpus", "[0]", "--actors.gpus", "[0]"])
    [problem] = plan_devices(listed, Fleet.uniform(2, int(79.6 * GIB)),
                             FAMILIES["Qwen2.5-1.5B"]).problems
    assert "the learner on GPUs of its own: actors.gpus = [1] (79.6 GiB a GPU: fits)" in problem


def test_an_engine_whose_kv_cannot_hold_one_window_is_refused() -> None:
    config = load_config(GPU_7B, ["--actors.count", "2"])
    [problem] = plan_devices(config, parse_fleet("h100=8x79.6,t4=8x14.6"), QWEN_7B).problems
    assert problem.startswith("actor-0, actor-1 on t4: an engine holds 14.2 GiB of weights")
    assert "actors.engine.tensor_parallel = 2 (KV for" in problem


def test_a_refused_plan_lists_no_actor_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--plan", "--gpus", "8", "--config", str(GPU_7B)]) == 2
    shown = capsys.readouterr()
    assert "not placed: actor-0 to actor-7, for want of GPUs: the plan is refused" in shown.out
    assert not any(line.startswith("actor-") for line in shown.out.splitlines())
    assert "REFUSED: actors.count = 8 engines" in shown.out
    assert shown.err == "compactionrl: the plan is refused, for 1 reason: its REFUSED lines " \
                        "say which\n"


def fitting_fixes(problem: str) -> list[list[str]]:
    """The command-line overrides of each fix a refusal says fits."""
    fixes = problem.split("fixes the configuration does not have yet: ", 1)[1].split("; ")
    return [[item for key, value in SETTING.findall(fix) for item in (f"--{key}", value)]
            for fix in fixes if fix.endswith(": fits)")]


@pytest.mark.parametrize(("path", "overrides", "fleet", "family"), [
    (H100, [], "a100-40=8x39.4", "Qwen2.5-7B"),  # more ranks take the engines' GPUs
    (H100, ["--learner.critic", "model"], "h100=8x79.6", "Qwen2.5-7B"),
    (GPU_7B, ["--learner.gpus", str(list(range(8, 16))), "--actors.gpus", str(list(range(8)))],
     MIXED, "Qwen2.5-7B"),  # the learner moved to the other type, onto the engines' GPUs
    (None, [*CO_LOCATED, "--learner.gpus", "[0]", "--actors.gpus", "[0]"], "h100=2x79.6",
     "Qwen2.5-1.5B"),  # the learner on a GPU of its own: the engine moves
    (H100, ["--learner.gpus", "[]", "--actors.gpus", "[]"], "h100=6x79.6,t4=2x14.6",
     "Qwen2.5-7B"),  # an engine of twice the GPUs: fewer of them fit
], ids=["more-ranks", "critic-model", "other-type", "co-located", "engine-tp"])
def test_a_fix_a_refusal_says_fits_places_every_process_once_applied(
        path: Path | None, overrides: list[str], fleet: str, family: str) -> None:
    [problem] = plan_devices(load_config(path, overrides), parse_fleet(fleet),
                             FAMILIES[family]).problems
    fixes = fitting_fixes(problem)
    assert fixes, problem
    for fix in fixes:
        plan = plan_devices(load_config(path, [*overrides, *fix]), parse_fleet(fleet),
                            FAMILIES[family])
        assert plan.problems == () and plan.unplaced == (), (fix, plan.problems)


def test_a_refused_plan_says_refused_and_why_where_the_plan_is_printed(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--plan", "--fleet", "a100-40=8x39.4", "--model-shape", "Qwen2.5-7B",
                 "--config", str(H100)]) == 2
    shown = capsys.readouterr()
    lines = shown.out.splitlines()
    assert lines[0] == ("device plan for 8 x a100-40 (39.4 GiB): REFUSED (1 reason at the "
                        "end); weights over nccl")
    assert lines[-1].startswith("REFUSED: a learner rank needs about 53.6 GiB")
    # the engines' column is a share of each GPU, named as the setting
    assert lines[2].split()[5] == "gpu_memory_utilization"
    assert shown.err == "compactionrl: the plan is refused, for 1 reason: its REFUSED lines " \
                        "say which\n"
    assert main(["up", "--plan", "--gpus", "8", "--config", str(H100)]) == 0
    assert "REFUSED" not in capsys.readouterr().out


def test_a_fleet_s_refusal_speaks_of_the_fleet_not_this_machine() -> None:
    [engines] = plan_devices(load_config(GPU_7B), parse_fleet("a100-40=8x39.4")).problems
    assert "; the fleet has 0 left of 8: lower actors.count" in engines
    listed = load_config(H100, ["--learner.nproc", "2", "--learner.gpus", "[8, 9]"])
    problems = plan_devices(listed, parse_fleet("a100-40=8x39.4")).problems
    assert any("names GPU 8, 9, but the fleet has GPUs 0-7" in p for p in problems), problems
    assert not any("this machine" in p for p in problems)


def test_the_command_line_takes_one_size_or_a_fleet(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    with pytest.raises(SystemExit):
        main(["up", "--plan", "--gpus", "16", "--gpu-memory-gib", "79.6,39.4"])
    assert "--fleet NAME=COUNTxGIB" in capsys.readouterr().err
    assert main(["up", "--plan", "--gpus", "16", "--fleet", MIXED]) == 2
    assert "leave out --gpus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["up", "--plan", "--fleet", MIXED, "--model-shape", "Qwen9-7B"])
    assert "nor a known family (Qwen2.5-0.5B" in capsys.readouterr().err
    assert main(["up", "--fleet", MIXED]) == 2
    assert "only previews a plan" in capsys.readouterr().err
