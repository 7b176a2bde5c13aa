"""The base policy's demonstrations: a scripted player that reads only its
context, the imperfection recipe, and the sequences fine-tuning sees."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest

from actors.chat import ChatFormat
from actors.envs.base import EVALUATION_SEEDS_FROM
from deploy.config import ConfigError, load_config
from starting_points.config import BootstrapConfig
from starting_points.keyvault_bootstrap import (
    KEPT_BASES,
    Demonstrator,
    KeptBase,
    base_digest,
    copy_accuracy,
    demonstrate,
    demonstration_seed,
    differences,
    facts_in,
    made_for,
    restore_kept_base,
    training_sequences,
)

#: Each trains the tiny model for steps (seconds to a minute): make check leaves
#: them to make test.
pytestmark = pytest.mark.trains


def play(tokenizer, drop: float, episodes: int = 40, ordered: bool = False):
    actors = load_config(None, []).actors
    options = {**actors.environment.options, "ordered": ordered}
    actors.environment = dataclasses.replace(actors.environment, options=options)
    chat = ChatFormat(tokenizer, actors.compaction, actors.environment)
    recipe = BootstrapConfig(demonstrations=episodes, drop_fact_probability=drop, seed=1)
    return asyncio.run(demonstrate(chat, actors, recipe))


def test_perfect_summaries_solve_every_episode_through_two_compactions(tokenizer) -> None:
    segments, results = play(tokenizer, drop=0.0)
    assert all(r.stats.success for r in results)
    assert all(r.stats.compactions == 2 for r in results)  # the local default's difficulty
    assert {s.segment_type for s in segments} == {"execution", "summary"}


def test_summaries_that_keep_nothing_leave_only_guesses(tokenizer) -> None:
    segments, results = play(tokenizer, drop=1.0)
    summaries = [tokenizer.decode(s.tokens[-s.num_trainable:]) for s in segments
                 if s.segment_type == "summary"]
    assert all("no facts kept" in text for text in summaries)
    # Three distinct digits guessed (1 in 120) unless a note sits in the kept step.
    assert sum(r.stats.success for r in results) <= 2


def test_the_recipe_drops_facts_at_its_rate(tokenizer) -> None:
    segments, results = play(tokenizer, drop=0.3, episodes=120)
    success = sum(r.stats.success for r in results) / len(results)
    assert 0.1 < success < 0.5  # well below the perfect player, well above guessing


def test_the_player_answers_with_the_facts_in_view_and_guesses_the_rest(tokenizer) -> None:
    actors = load_config(None, []).actors
    chat = ChatFormat(tokenizer, actors.compaction, actors.environment)
    player = Demonstrator(chat, ("alpha",), 3, 0.0, random.Random(0), ordered=True)
    text = ("summary : alpha first four . alpha third nine . "
            "tool no more rooms . say answer now")
    words = player.answer(text).split()
    assert words[:3] == ["answer", "alpha", "four"] and words[4] == "nine"
    assert facts_in(text, ordered=True) == {("alpha", "first"): "four",
                                            ("alpha", "third"): "nine"}


def test_unordered_the_player_lists_facts_by_value_and_guesses_other_digits(tokenizer) -> None:
    actors = load_config(None, []).actors
    chat = ChatFormat(tokenizer, actors.compaction, actors.environment)
    player = Demonstrator(chat, ("alpha",), 3, 0.0, random.Random(0), ordered=False)
    text = "summary : alpha nine . note : alpha four . note : alpha nine ."
    assert facts_in(text, ordered=False) == {("alpha", "nine"): "nine",
                                             ("alpha", "four"): "four"}
    assert player.summary(text) == "alpha four . alpha nine ."  # by value
    for seed in range(20):
        player.rng = random.Random(seed)
        words = player.answer(text).split()
        assert words[:4] == ["answer", "alpha", "four", "nine"]
        assert words[4] not in ("nine", "four")  # a guess is never a digit already given


def test_a_wrong_answer_in_view_is_no_fact_on_the_next_attempt() -> None:
    """With retries the player's last answer stays in the window: its
    guesses must not be read back as found facts."""
    text = ("note : alpha seven . assistant answer alpha seven two 5 tool answer wrong . "
            "1 of 3 digits right . try again : say next . assistant next tool room 1 : red .")
    assert facts_in(text, ordered=False) == {("alpha", "seven"): "seven"}


def test_fine_tuning_trains_each_summary_with_the_window_it_summarises(tokenizer) -> None:
    segments, _ = play(tokenizer, drop=0.3, episodes=5)
    sequences = training_sequences(segments)
    assert len(sequences) == 5 * 3  # per episode: 2 (window + summary) pairs, the last window
    assert sum(sum(mask) for _, mask in sequences) == sum(s.num_trainable for s in segments)
    for tokens, mask in sequences:
        assert len(tokens) == len(mask)


def test_demonstration_seeds_never_reach_the_evaluation_range() -> None:
    seeds = {demonstration_seed(run_seed, n) for run_seed in range(3) for n in range(2000)}
    assert max(seeds) < EVALUATION_SEEDS_FROM
    assert len(seeds) == 6000


def test_an_incoherent_recipe_is_refused() -> None:
    with pytest.raises(ConfigError, match="drop_fact_probability"):
        load_config(None, ["--bootstrap.drop_fact_probability", "1.5"])
    with pytest.raises(ConfigError, match="group_size"):
        load_config(None, ["--learner.advantage", "grpo", "--actors.group_size", "1"])


@pytest.mark.parametrize("ordered", [False, True])
def test_copy_accuracy_counts_every_copied_value_and_no_guess(tokenizer, tiny_model_dir: Path,
                                                                ordered: bool) -> None:
    actors = load_config(None, []).actors
    chat = ChatFormat(tokenizer, actors.compaction, actors.environment)
    perfect, _ = play(tokenizer, drop=0.0, episodes=6, ordered=ordered)
    report = copy_accuracy(tiny_model_dir, chat, perfect, ordered=ordered)
    # perfect summaries: every answer value is in view, and every summary
    # value is a copy of a fact in the window
    assert report["answer_values"] == 6 * 3
    summary_values = sum(len(facts_in(tokenizer.decode(s.tokens[-s.num_trainable:]), ordered))
                         for s in perfect if s.segment_type == "summary")
    assert report["summary_values"] == summary_values > 0
    assert 0.0 <= report["summary"] <= 1.0 and 0.0 <= report["answer"] <= 1.0
    forgetful, _ = play(tokenizer, drop=1.0, episodes=6, ordered=ordered)
    # nothing kept: only notes of the last window are in view, the rest are guesses
    assert copy_accuracy(tiny_model_dir, chat, forgetful, ordered)["answer_values"] < 6 * 3


def test_a_base_made_with_other_settings_is_told_apart_by_the_settings_that_differ(
        tmp_path: Path) -> None:
    config = load_config(None, [])
    assert differences(tmp_path, config.actors, config.bootstrap) == []  # no bootstrap.json
    (tmp_path / "bootstrap.json").write_text(
        json.dumps({"seconds": 1.0, **made_for(config.actors, config.bootstrap)}))
    assert differences(tmp_path, config.actors, config.bootstrap) == []
    other = load_config(None, ["--actors.environment.options.rooms", "12",
                               "--bootstrap.drop_fact_probability", "0.5"])
    rooms = config.actors.environment.options["rooms"]
    assert differences(tmp_path, other.actors, other.bootstrap) == [
        f"environment.options.rooms: {rooms!r} -> 12",
        f"recipe.drop_fact_probability: {config.bootstrap.drop_fact_probability!r} -> 0.5"]


#: The configurations that name a kept base: the embedded default, and the
#: size-range and retries recipes one switch away.
KEPT_BASE_CONFIGURATIONS = [[], *([str(Path(__file__).parents[2] / "deploy" / "configs" / name)]
                                  for name in ("size-range.toml", "retries.toml"))]


@pytest.mark.parametrize("files", KEPT_BASE_CONFIGURATIONS,
                         ids=["default", "size-range", "retries"])
def test_a_kept_base_is_restored_only_whole_and_made_with_these_settings(
        files: list[str], tmp_path: Path) -> None:
    """``up`` starts a configuration that names a kept base from the
    checkout's copy: the recorded one (digest) and made for the run's
    settings, else it bootstraps."""
    config = load_config(files or None, [])
    kept = KEPT_BASES[config.run.model]
    restored = tmp_path / "base-model"
    assert restore_kept_base(restored, config.actors, config.bootstrap, kept) is None
    assert base_digest(restored) == kept.digest
    assert (restored / "config.json").is_file()

    tampered = tmp_path / "tampered"
    shutil.copytree(kept.folder, tampered)
    with (tampered / "model.safetensors").open("r+b") as weights:
        weights.seek(-1, 2)
        weights.write(b"\x00" if weights.read(1) != b"\x00" else b"\x01")
    why = restore_kept_base(tmp_path / "a", config.actors, config.bootstrap,
                            KeptBase(tampered, kept.digest))
    assert why is not None and "not the recorded one" in why
    assert not (tmp_path / "a").exists()

    other = load_config(files or None, ["--bootstrap.drop_fact_probability", "0.5"])
    why = restore_kept_base(tmp_path / "b", other.actors, other.bootstrap, kept)
    assert why is not None and "drop_fact_probability" in why
    assert not (tmp_path / "b").exists()


def test_up_restores_a_kept_base_where_its_folder_is_missing_and_refuses_any_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deploy.up import prepare_model

    monkeypatch.chdir(tmp_path)  # run.model is relative to the working directory
    config = load_config(KEPT_BASE_CONFIGURATIONS[1], [])
    prepare_model(config)
    assert base_digest(tmp_path / config.run.model) == KEPT_BASES[config.run.model].digest
    elsewhere = load_config(KEPT_BASE_CONFIGURATIONS[1], ["--run.model", "runs/my-model"])
    with pytest.raises(SystemExit, match="runs/my-model' has no config.json"):
        prepare_model(elsewhere)
