"""bench/horizons.py's ``--train``: a recipe's seeds trained, evaluated and
recorded one at a time, and reused by a later invocation (the training and
the evaluation themselves are the bench's: minutes each, replaced here by
functions that say what they were asked)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.scripts import import_script

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "deploy" / "configs" / "size-range.toml"


@pytest.fixture()
def horizons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The bench in a working directory of its own (``up`` restores the
    recipe's kept base there, as a run would), training and evaluating nothing."""
    module = import_script(ROOT / "bench" / "horizons.py", "horizons_trained")
    monkeypatch.chdir(tmp_path)
    module.trained, module.measured, module.failing_seeds = [], [], ()

    def train_seed(config_file: Path, name: str, seed: int) -> tuple[str, dict[str, Any]]:
        if seed in module.failing_seeds:
            raise SystemExit(f"command failed (1); see {name}.log")
        module.trained.append(name)
        return f"runs/horizons/{name}/export", {"learner_steps": 180, "wall_seconds": 450.0}

    def measure_policy(name: str, model: str, sizes: dict, episodes: int) -> tuple[dict, dict]:
        module.measured.append(name)
        return ({size: {"success": 0.5, "success_ci95": [0.4, 0.6]} for size in sizes},
                dict.fromkeys(sizes, {"causes": {}}))

    monkeypatch.setattr(module, "train_seed", train_seed)
    monkeypatch.setattr(module, "measure_policy", measure_policy)
    return module


def test_a_recipes_base_and_seeds_are_recorded_each_when_it_finishes(horizons,
                                                                     tmp_path: Path) -> None:
    records = tmp_path / "horizons-runs.json"
    horizons.failing_seeds = (1,)  # the table is cut short at seed 1
    with pytest.raises(SystemExit, match="command failed"):
        horizons.train_recipe("size-range", RECIPE, 3, 100, records, fresh=False)
    settings = horizons.recipe_settings(horizons.load_config([str(RECIPE)], []), 100)
    kept = horizons.load_records(records, settings, fresh=False)
    assert list(kept["runs"]) == ["size-range-base", "size-range-seed0"]
    assert kept["runs"]["size-range-base"]["model"] == "runs/base-size-range"
    assert kept["runs"]["size-range-seed0"]["learner_steps"] == 180

    horizons.failing_seeds = ()
    horizons.trained.clear()
    horizons.measured.clear()
    recorded = horizons.train_recipe("size-range", RECIPE, 3, 100, records, fresh=False)
    assert horizons.trained == ["size-range-seed1", "size-range-seed2"]
    assert horizons.measured == ["size-range-seed1", "size-range-seed2"]
    assert list(recorded) == ["size-range-base", *(f"size-range-seed{n}" for n in range(3))]

    horizons.trained.clear()
    again = horizons.train_recipe("size-range", RECIPE, 3, 100, records, fresh=False)
    assert horizons.trained == [] and again == recorded
    report = horizons.with_recorded(horizons.measure({}, horizons.SIZES, 100), again)
    assert list(report["policies"]) == list(recorded)
    assert report["policies"]["size-range-seed2"] == "runs/horizons/size-range-seed2/export"


def test_records_of_another_episode_count_are_not_reused(horizons, tmp_path: Path) -> None:
    records = tmp_path / "horizons-runs.json"
    horizons.train_recipe("size-range", RECIPE, 1, 100, records, fresh=False)
    with pytest.raises(SystemExit, match=r"other settings \(episodes\)"):
        horizons.train_recipe("size-range", RECIPE, 1, 200, records, fresh=False)
    horizons.trained.clear()
    horizons.train_recipe("size-range", RECIPE, 1, 200, records, fresh=True)
    assert horizons.trained == ["size-range-seed0"]
