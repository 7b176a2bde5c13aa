"""The configuration tree: TOML, dotted overrides, and rejection of incoherent settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.config import EngineConfig
from deploy.cli import main, torchrun_args
from deploy.config import ConfigError, JobConfig, describe_fields, load_config, to_toml
from learner.config import (
    AUTO_LOGPROB_CHUNK_TOKENS,
    AUTO_MAX_TOKENS_PER_MICROBATCH,
    LearnerConfig,
    memory_switches,
)

CONFIGS = Path(__file__).parents[2] / "deploy" / "configs"


def problems_of(overrides: list[str], path: str | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.problems


def test_embedded_default_loads_and_is_the_shipped_file() -> None:
    assert load_config() == load_config(CONFIGS / "local-cpu.toml")


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path: Path) -> None:
    assert isinstance(load_config(path), JobConfig)


def test_dotted_overrides_are_typed() -> None:
    config = load_config(None, ["--learner.lr", "1e-5", "--actors.count=4",
                                "--actors.compaction.enabled", "false", "--run.name", "my-run",
                                "--learner.advantage", "independent"])
    assert config.learner.lr == 1e-5
    assert config.actors.count == 4
    assert config.actors.compaction.enabled is False
    assert config.run.name == "my-run"
    assert config.learner.advantage == "independent"


def test_a_string_field_takes_a_number_like_override_as_text() -> None:
    config = load_config(None, ["--actors.engine.cpu_threads_bind", "0", "--run.name", "42"])
    assert config.actors.engine.cpu_threads_bind == "0"
    assert config.run.name == "42"


def test_integer_accepted_for_float_field() -> None:
    assert load_config(None, ["--learner.gamma", "1"]).learner.gamma == 1.0


def test_reserve_larger_than_context_names_field_and_fix() -> None:
    [problem] = problems_of(["--actors.compaction.reserve_tokens", "5000"])
    assert "actors.compaction.reserve_tokens" in problem and "smaller than the context" in problem


def test_reserve_must_cover_the_summary() -> None:
    [problem] = problems_of(["--actors.compaction.max_summary_tokens", "300"])
    assert "max_summary_tokens" in problem and "raise the reserve" in problem


def test_negative_k_and_staleness_are_rejected_together() -> None:
    problems = problems_of(["--actors.compaction.keep_steps", "-1",
                            "--replay.max_staleness", "-1"])
    assert any("actors.compaction.keep_steps" in p for p in problems)
    assert any("replay.max_staleness" in p and ">= 0" in p for p in problems)


def test_a_buffer_too_small_for_the_learners_batches_could_deadlock() -> None:
    [problem] = problems_of(["--replay.max_buffer_bytes", str(2 * 1024 * 1024),
                             "--replay.rollouts_per_batch", "64"])
    assert "replay.max_buffer_bytes" in problem and "wait forever" in problem


def test_services_beyond_loopback_need_curve_or_an_explicit_opt_in() -> None:
    public = ["--replay.actor_address", "tcp://0.0.0.0:5555",
              "--learner.control_address", "tcp://head-node:5557"]
    [problem] = problems_of(public)
    assert "replay.actor_address = 'tcp://0.0.0.0:5555'" in problem
    assert "learner.control_address = 'tcp://head-node:5557'" in problem
    assert "transport.allow_insecure_network = true" in problem
    assert load_config(None, [*public, "--transport.allow_insecure_network", "true"])
    for loopback in ("tcp://localhost:5555", "tcp://[::1]:5555", "tcp://127.0.0.2:5555",
                     "ipc:///tmp/replay"):
        assert load_config(None, ["--replay.actor_address", loopback])


def test_what_a_service_binds_is_what_is_exposed_not_what_it_advertises() -> None:
    """Behind a Service (or on a host with several interfaces) a service binds
    a wildcard and advertises a name: the bind decides the exposure, and the
    weight store, which hands out the weights, counts like every socket."""
    advertised = ["--replay.actor_address", "tcp://replay:5555",
                  "--replay.learner_address", "tcp://replay:5556",
                  "--learner.control_address", "tcp://learner-0.learner:5557",
                  "--learner.weight_store_address", "learner-0.learner:5558"]
    binds = ["--replay.actor_bind", "tcp://0.0.0.0:5555",
             "--replay.learner_bind", "tcp://127.0.0.1:5556",
             "--learner.control_bind", "tcp://0.0.0.0:5557",
             "--learner.weight_store_bind", "0.0.0.0:5558"]
    [problem] = problems_of([*advertised, *binds])
    for exposed in ("replay.actor_bind = 'tcp://0.0.0.0:5555'",
                    "learner.control_bind = 'tcp://0.0.0.0:5557'",
                    "learner.weight_store_bind = '0.0.0.0:5558'"):
        assert exposed in problem
    assert "replay.learner" not in problem  # bound on loopback, whatever it advertises
    assert "receive the weights" in problem
    [problem] = problems_of(["--learner.weight_store_address", "10.0.0.2:5558"])
    assert "learner.weight_store_address = '10.0.0.2:5558'" in problem
    config = load_config(None, [*advertised, *binds, "--transport.allow_insecure_network",
                                "true"])
    assert config.replay.actor_bind == "tcp://0.0.0.0:5555"
    [problem] = problems_of(["--learner.weight_store_bind", "5558",
                             "--transport.allow_insecure_network", "true"])
    assert "learner.weight_store_bind = '5558' must be HOST:PORT" in problem


def test_two_settings_on_one_port_are_rejected_by_name() -> None:
    """A second bind would fail, and `up` would restart the process into the
    same failure until it gave up."""
    [problem] = problems_of(["--learner.control_address", "tcp://127.0.0.1:7000",
                             "--learner.metrics_port", "7000"])
    assert "learner.metrics_port = 7000" in problem
    assert "learner.control_address = 'tcp://127.0.0.1:7000'" in problem
    # actor i serves on actors.metrics_port + i; a wildcard bind takes the port too
    [problem] = problems_of(["--actors.count", "3", "--actors.metrics_port", "7000",
                             "--learner.weight_store_bind", "0.0.0.0:7002",
                             "--transport.allow_insecure_network", "true"])
    assert "actor 2's metrics port" in problem and "weight_store_bind" in problem
    assert load_config(None, ["--replay.actor_address", "ipc:///tmp/actors",
                              "--replay.learner_address", "ipc:///tmp/learner"])
    [problem] = problems_of(["--replay.actor_address", "ipc:///tmp/replay",
                             "--learner.control_address", "ipc:///tmp/replay"])
    assert "learner.control_address = 'ipc:///tmp/replay'" in problem


def test_each_run_keeps_its_replay_log_in_its_own_folder() -> None:
    """A log shared by runs would hand one run's leftover rollouts to the next."""
    first = load_config(None, ["--run.name", "a", "--run.out_dir", "/tmp/runs"])
    second = load_config(None, ["--run.name", "b", "--run.out_dir", "/tmp/runs"])
    assert first.replay.log_path == "/tmp/runs/a/replay/segments.log"
    assert second.replay.log_path == "/tmp/runs/b/replay/segments.log"
    chosen = load_config(None, ["--replay.log_path", "/data/log"])
    assert chosen.replay.log_path == "/data/log"


def test_memory_budgets_must_not_be_negative() -> None:
    problems = problems_of(["--learner.logprob_chunk_tokens", "-1",
                            "--learner.max_tokens_per_microbatch", "-1"])
    assert any("learner.logprob_chunk_tokens must be >= 0" in p for p in problems)
    assert any("learner.max_tokens_per_microbatch must be >= 0" in p for p in problems)


def test_the_memory_switches_are_on_by_default_on_a_gpu_and_off_on_the_cpu() -> None:
    default = load_config(None, []).learner
    assert (default.logprob_chunk_tokens, default.max_tokens_per_microbatch) == ("auto", "auto")
    assert memory_switches(default, on_gpu=True) == (AUTO_LOGPROB_CHUNK_TOKENS,
                                                     AUTO_MAX_TOKENS_PER_MICROBATCH)
    assert memory_switches(default, on_gpu=False) == (0, 0)
    chosen = load_config(None, ["--learner.logprob_chunk_tokens", "512",
                                "--learner.max_tokens_per_microbatch", "0"]).learner
    assert memory_switches(chosen, on_gpu=True) == (512, 0)
    [problem] = problems_of(["--learner.logprob_chunk_tokens", "some"])
    assert "learner.logprob_chunk_tokens = 'some'" in problem


def test_literal_choices_are_listed() -> None:
    [problem] = problems_of(["--learner.is_mode", "clamp"])
    assert "'truncate', 'mask', 'off'" in problem


def test_wrong_type_and_unknown_field_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[learner]\nlr = "fast"\nlearning_rate = 1.0\n[nosuch]\nx = 1\n')
    problems = problems_of([], str(path))
    assert any("learner.lr" in p and "expected float" in p for p in problems)
    assert any("'learner.learning_rate'" in p and "valid here" in p for p in problems)
    assert any("'nosuch'" in p for p in problems)


def test_unknown_override_lists_the_fields() -> None:
    [problem] = problems_of(["--learner.lrr", "1"])
    assert "no field 'lrr'" in problem and "critic_lr" in problem


def test_unreadable_and_invalid_toml_are_clear(tmp_path: Path) -> None:
    assert "cannot read" in problems_of([], str(tmp_path / "missing.toml"))[0]
    broken = tmp_path / "broken.toml"
    broken.write_text("[learner\n")
    assert "not valid TOML" in problems_of([], str(broken))[0]


def test_shown_toml_reads_back_to_the_same_tree(tmp_path: Path) -> None:
    config = load_config(None, ["--learner.lr", "3e-06", "--run.name", 'we "quote"'])
    path = tmp_path / "shown.toml"
    path.write_text(to_toml(config))
    assert load_config(path) == config


def test_cli_config_show_and_its_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--replay.max_staleness", "7"]) == 0
    assert "max_staleness = 7" in capsys.readouterr().out
    assert main(["config", "show", "--replay.max_staleness", "-7"]) == 2
    assert "replay.max_staleness" in capsys.readouterr().err


def test_a_dotted_override_reaches_into_free_form_tables() -> None:
    config = load_config(None, ["--actors.environment.options.step_latency_s", "0.25",
                                "--actors.environment.options.rooms", "16"])
    options = config.actors.environment.options
    assert options["step_latency_s"] == 0.25 and options["rooms"] == 16
    assert options["codes"] == 1  # the rest of the table is kept


def test_an_option_may_be_any_toml_value_and_survives_the_run_s_config_file(
        tmp_path: Path) -> None:
    """A list (keyvault's size ranges) or a table (a Gymnasium environment's
    kwargs, a verifiers taskset's nested config): the factory checks them."""
    config = load_config(None, ["--actors.environment.options.rooms", "[6, 14]",
                                "--actors.environment.options.kwargs.size.width", "3"])
    options = config.actors.environment.options
    assert options["rooms"] == [6, 14] and options["kwargs"] == {"size": {"width": 3}}
    options["mixed"] = [[6], {"a": 1.5, "b": "x"}]
    saved = tmp_path / "config.toml"  # what each process of the run loads
    saved.write_text(to_toml(config))
    assert load_config([saved], []).actors.environment.options == options


def test_config_files_compose_later_over_earlier_then_overrides(tmp_path: Path) -> None:
    """``--config A --config B`` kept only B."""
    base, gpu = tmp_path / "base.toml", tmp_path / "gpu.toml"
    base.write_text('[run]\nname = "base"\nseed = 3\n[learner]\nlr = 2e-5\nmax_steps = 50\n')
    gpu.write_text('[learner]\nlr = 1e-6\n[actors]\ncount = 4\n')
    config = load_config([base, gpu], ["--learner.max_steps", "70"])
    assert (config.run.name, config.run.seed) == ("base", 3)  # A's, where B is silent
    assert config.learner.lr == 1e-6 and config.actors.count == 4  # B's over A's
    assert config.learner.max_steps == 70  # the override over both
    assert load_config([gpu, base]).learner.lr == 2e-5  # order decides


def test_the_cli_composes_repeated_config_files(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text('[replay]\nmax_staleness = 3\nrollouts_per_batch = 8\n')
    second.write_text('[replay]\nmax_staleness = 4\n')
    assert main(["config", "show", "--config", str(first), "--config", str(second)]) == 0
    shown = capsys.readouterr().out
    assert "max_staleness = 4" in shown and "rollouts_per_batch = 8" in shown


def test_a_file_of_one_field_layers_over_the_embedded_default(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What a run gets with ``--config mine.toml`` is the default it gets
    without, but for mine.toml's fields: the CPU window that makes the tiny
    model compact, KeyVault's options (issue 41: it was the dataclasses'
    defaults, a 1,024-token window in which nothing compacted)."""
    mine = tmp_path / "mine.toml"
    mine.write_text("[actors.environment]\nmax_steps = 20\n")
    assert main(["config", "show", "--config", str(mine)]) == 0
    shown = capsys.readouterr().out
    default = load_config(None)
    assert f"context_tokens = {default.actors.compaction.context_tokens}" in shown
    layered = load_config(mine)
    assert layered.actors.environment.max_steps == 20
    assert layered.actors.environment.options == default.actors.environment.options
    assert main(["config", "fields", "--config", str(mine), "actors.environment"]) == 0
    listed = capsys.readouterr().out
    assert "actors.environment.max_steps: int = 20  (field default: 64)" in listed


def test_a_file_that_names_another_factory_replaces_the_options_below_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """KeyVault's options (codes, rooms...) are never passed to the user's
    own factory; a file naming the factory again owns its options whole, so
    the configuration ``up`` writes reads back as it was."""
    mine = tmp_path / "mine.toml"
    mine.write_text('[actors.environment]\nfactory = "actors.envs.shell:Shell"\n')
    assert main(["config", "show", "--config", str(mine)]) == 0
    assert "options = {  }" in capsys.readouterr().out
    rooms = tmp_path / "rooms.toml"
    rooms.write_text("[actors.environment.options]\nrooms = 12\n")  # no factory: adds
    options = load_config(rooms).actors.environment.options
    assert options == {**load_config(None).actors.environment.options, "rooms": 12}
    written = tmp_path / "config.toml"
    written.write_text(to_toml(load_config([mine])))
    assert to_toml(load_config(written)) == to_toml(load_config(mine))


def test_a_factory_given_on_the_command_line_replaces_the_options_below_it() -> None:
    """As a file naming it does: KeyVault's options are not passed to the
    user's factory, and options given beside it are its own, in any order."""
    for overrides in (["--actors.environment.factory", "actors.envs.shell:Shell",
                       "--actors.environment.options.image", "alpine"],
                      ["--actors.environment.options.image", "alpine",
                       "--actors.environment.factory", "actors.envs.shell:Shell"]):
        assert load_config(None, overrides).actors.environment.options == {"image": "alpine"}
    same = load_config(None, ["--actors.environment.factory",
                              load_config(None).actors.environment.factory])
    assert same.actors.environment.options == load_config(None).actors.environment.options


def test_every_field_is_listed_with_its_meaning(capsys: pytest.CaptureFixture[str]) -> None:
    fields = describe_fields()
    assert {f.name for f in fields} >= {"learner.lr", "actors.engine.dtype", "run.max_minutes"}
    undocumented = [f.name for f in fields if not f.doc]
    assert undocumented == []
    assert main(["config", "fields", "actors.engine"]) == 0
    listed = capsys.readouterr().out
    assert "actors.engine.dtype: " in listed and "learner.lr" not in listed
    assert main(["config", "fields", "nonsense"]) == 2
    assert "sections: actors" in capsys.readouterr().err


def model_folder(tmp_path: Path, **config: object) -> str:
    """A model folder holding only a config.json (what the checks read)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_window_beyond_the_models_positions_is_refused_with_the_fix(tmp_path: Path) -> None:
    """vLLM refuses to start an engine whose max_model_len exceeds the
    model's max_position_embeddings; the run is refused before that."""
    model = model_folder(tmp_path, max_position_embeddings=32768, rope_theta=1e6)
    longer = ["--run.model", model, "--actors.engine.max_model_len", "65536"]
    [problem] = problems_of(longer)
    assert "max_model_len = 65536 exceeds" in problem
    assert "max_position_embeddings = 32768" in problem and "lower max_model_len" in problem
    assert "rope_scaling" in problem and "factor = 2.0" in problem
    assert load_config(None, ["--run.model", model, "--actors.engine.max_model_len", "32768"])
    # scaling set explicitly stretches the window, up to factor x original positions
    yarn = '{ rope_type = "yarn", factor = 2.0, original_max_position_embeddings = 32768 }'
    config = load_config(None, [*longer, "--actors.engine.rope_scaling", yarn])
    assert config.actors.engine.window(json.loads((tmp_path / "config.json").read_text())) == 65536
    [beyond] = problems_of([*longer[:-1], "70000", "--actors.engine.rope_scaling", yarn])
    assert "65536 positions" in beyond and "raise the scaling factor" in beyond
    [untyped] = problems_of([*longer, "--actors.engine.rope_scaling",
                             '{ type = "yarn", factor = 2 }'])
    assert "add rope_type" in untyped


def test_without_the_models_config_json_the_window_is_checked_where_the_engine_runs(
        tmp_path: Path) -> None:
    assert load_config(None, ["--run.model", str(tmp_path / "elsewhere"),
                              "--actors.engine.max_model_len", "1000000"])


def test_rope_scaling_reaches_vllm_as_hf_overrides() -> None:
    """vLLM 0.32 sets a dict override whole (rope_theta carried over) and
    reads a YaRN model's max_position_embeddings as already scaled."""
    qwen = {"max_position_embeddings": 32768, "rope_theta": 1000000.0}
    engine = load_config(None, ["--actors.engine.rope_scaling",
                                '{ rope_type = "yarn", factor = 4.0 }']).actors.engine
    assert engine.hf_overrides(qwen) == {
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 32768},
        "max_position_embeddings": 131072}
    assert load_config().actors.engine.hf_overrides(qwen) == {}


def test_enforce_eager_unset_is_off_on_gpu_and_on_on_cpu() -> None:
    engine = EngineConfig()
    assert engine.enforce_eager is None
    assert engine.eager(on_gpu=True) is False and engine.eager(on_gpu=False) is True
    assert EngineConfig(enforce_eager=False).eager(on_gpu=False) is False
    assert EngineConfig(enforce_eager=True).eager(on_gpu=True) is True
    # unset is left out of the TOML and reads back unset
    config = load_config(None, [])
    config.actors.engine.enforce_eager = None
    assert "enforce_eager" not in to_toml(config)


def test_a_learner_on_several_nodes_needs_node_0s_rendezvous_and_a_rank_within_them() -> None:
    assert LearnerConfig(nnodes=2, rdzv_endpoint="node0:29400").validate() == []
    assert "rdzv_endpoint" in " ".join(LearnerConfig(nnodes=2).validate())
    assert "rdzv_endpoint" in " ".join(LearnerConfig(nnodes=2, rdzv_endpoint="node0").validate())
    assert "node_rank = 2" in " ".join(LearnerConfig(nnodes=2, node_rank=2,
                                                     rdzv_endpoint="h:1").validate())
    assert "nnodes must be >= 1" in " ".join(LearnerConfig(nnodes=0).validate())


def test_torchrun_runs_one_node_standalone_and_several_on_node_0s_static_rendezvous() -> None:
    assert torchrun_args(LearnerConfig(nproc=4)) == ["--standalone", "--nproc_per_node=4"]
    assert torchrun_args(LearnerConfig(nproc=8, nnodes=2, node_rank=1,
                                       rdzv_endpoint="learner-0.learner:29400")) == [
        "--nnodes=2", "--node_rank=1", "--master_addr=learner-0.learner", "--master_port=29400",
        "--nproc_per_node=8"]
    assert "--master_addr=::1" in torchrun_args(LearnerConfig(nnodes=2, rdzv_endpoint="[::1]:5"))
