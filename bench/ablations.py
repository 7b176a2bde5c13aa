"""The ablation table: what each part of CompactionRL buys, reproduced on CPU.

From the same bootstrapped base policy (``compactionrl bootstrap``), with the
same time budget and the same seeds, each variant trains with
``compactionrl up`` on the local default configuration, and its exported
policy is evaluated on the same held-out episodes (``compactionrl eval``):

- ``full``: CompactionRL as configured (summary tokens trained, token-level
  normalisation, cross-trajectory GAE);
- ``train_summary=false``: summary tokens masked out of the loss;
- ``loss_norm=segment``: per-segment loss normalisation;
- ``advantage=independent``: GAE within each segment alone;
- ``advantage=grpo``: group-relative outcome advantage (groups of
  ``GRPO_GROUP_SIZE`` episodes on one task);
- ``compaction=false``: RL in a single window, evaluated single-window and
  compacted.

The base is evaluated the same way. ``docs/results.md`` (generated, with
the command, the machine, wall time and every parameter), its raw JSON and a
plot are written at the end.

``--recipe paper`` runs the same table under the paper's recipe (over the
local default: :data:`RECIPES`) in its own run folder, results section and
JSON; ``--recipe blind-critic`` under the paper's lambda with the critic held
at V = 0 (when, if ever, cross-segment credit matters without a baseline).
``--recipe retries`` runs the table in the regime the paper's three claims
are about: keyvault with retries (deploy/configs/retries.toml), where one
task's rollouts compact 2, 5 or 8 times by what their summaries kept, under
the paper's recipe, with the normalisation and advantage modes the field
uses (:data:`RETRIES_VARIANTS`); each run's budget is a number of learner
steps of the same number of rollouts, not minutes, and evaluation plays
each held-out task 4 times to measure how unequally a group compacts.
``--variants`` trains only those (in that order): a long table can be made
in parts, each part reusing the finished runs of the others.

Each finished run (trained and evaluated) is recorded at once in
``docs/<results>-runs.json``, with the settings it was made under (budget,
episodes, configuration, the base policy's weights digest and the
environment module's source digest) and its commit: the record,
committed, is what a later invocation reuses, so a table longer than one
sitting is made over several, in fresh checkouts (run folders are not kept).
Records of other settings are refused, not mixed (``--fresh`` drops them).
The base they were made from is kept beside them (``docs/<results>-base``, a
few MB for the tiny model) and restored into a checkout that has none: a
fresh bootstrap elsewhere need not give the same weights.

    python bench/ablations.py [--quick] [--seeds 3] [--minutes 5] [--episodes 300] [--json]
                              [--recipe today|paper|blind-critic] [--variants full,...] [--fresh]
                              [--retrain-before COMMIT] [--dry-run] [--render]

``--retrain-before COMMIT`` trains the requested variants again where their
records predate a fix (records made since are kept: resuming is safe). A
configuration field added since the records, left at its default, does not
make other settings (:func:`same_settings`).

``--dry-run`` checks every command the table needs (the command line's parser
and the configuration loader, on each variant's overrides), prints them and
trains nothing: seconds, where the table takes hours.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from _options import BenchmarkParser  # bench/_options.py

from deploy.answer_credit import measure as answer_credit
from deploy.answer_lengths import measure as answer_lengths
from deploy.config import JobConfig, load_config, to_toml
from deploy.evaluate import wilson_interval
from ops.files import write_section
from ops.report import bar_chart, read_history
from ops.summary import COMPACTION_BUCKETS, cross_factors, weight_by_compactions
from starting_points.keyvault_bootstrap import base_digest

ROOT = Path(__file__).resolve().parent.parent
COMPACTIONRL = str(Path(sys.executable).with_name("compactionrl"))
#: Episodes per task in the GRPO variant: enough spread within a group for a
#: non-zero advantage, few enough that a group lands in one batch.
GRPO_GROUP_SIZE = 4
#: Variant name -> configuration overrides (over the local default).
VARIANTS: dict[str, list[str]] = {
    "full": [],
    "train_summary=false": ["--learner.train_summary", "false"],
    "loss_norm=segment": ["--learner.loss_norm", "segment"],
    "advantage=independent": ["--learner.advantage", "independent"],
    "advantage=grpo": ["--learner.advantage", "grpo",
                       "--actors.group_size", str(GRPO_GROUP_SIZE)],
    "compaction=false": ["--actors.compaction.enabled", "false"],
    # GRPO with the group statistics over segments, a rollout that compacted
    # k times counted once per segment, 2k + 1 times (as frameworks that train
    # segments as samples do), under the token normalisation of every other
    # variant: docs/learner.md.
    "advantage=grpo_segments": ["--learner.advantage", "grpo_segments",
                                "--actors.group_size", str(GRPO_GROUP_SIZE)],
    "loss_norm=rollout": ["--learner.loss_norm", "rollout"],
}
#: The variants of the first three tables (measured before the last two existed).
FIRST_VARIANTS = ["full", "train_summary=false", "loss_norm=segment", "advantage=independent",
                  "advantage=grpo", "compaction=false"]
#: The unequal-compaction table's rows (besides the base): the paper's recipe,
#: its three claims' alternatives, and the field's fixes of GRPO.
RETRIES_VARIANTS = ["full", "advantage=independent", "advantage=grpo",
                    "advantage=grpo_segments", "loss_norm=segment", "loss_norm=rollout",
                    "train_summary=false"]
#: The paper's length-adaptive lambda and gamma.
PAPER_LAMBDA = ["--learner.lam_mode", "adaptive", "--learner.lam_alpha", "1.5",
                "--learner.gamma", "1"]
#: Every table's ``full`` is PPO with cross-trajectory GAE, each task played
#: once, as the tables were measured (pinned: the local default trained GRPO
#: between the equal tables and the unequal one).
CROSS = ["--learner.advantage", "cross", "--actors.group_size", "1"]
#: Recipe name -> configuration overrides (over the local default) of every
#: variant. "paper": the length-adaptive lambda of the paper (gamma = 1,
#: lambda_s = 1 - 1/(1.5 n_s)) and a critic warm-up. The warm-up is GLM-5.2's
#: 10 value-only steps rather than the paper's reported 50: a 5-minute run
#: here makes about 170 learner steps, and 50 would hold the policy still
#: for a third of them. The critic's learning rate stays the local default's
#: (the reports give none to copy).
RECIPES: dict[str, list[str]] = {
    "today": CROSS,
    "paper": [*CROSS, *PAPER_LAMBDA, "--learner.critic_warmup_steps", "10"],
    # "blind-critic": the paper's lambda and gamma, where cross and independent
    # differ (today's lambda = 0.999 discounts a segment by about 0.98: the two
    # compute nearly the same advantages whatever the critic), with the critic
    # kept at its zero head and no warm-up: V = 0 at every token, so no
    # advantage has a baseline that knows what a summary kept. AdamW moves a
    # parameter by about the learning rate per step: 1e-9 leaves every value
    # within about 1e-6 of 0 over a table's few hundred steps
    # (tests/unit/test_results_doc.py), against rewards of order 1.
    "blind-critic": [*CROSS, *PAPER_LAMBDA, "--learner.critic_lr", "1e-9"],
}
RECIPES["retries"] = RECIPES["paper"]
#: A configuration file a recipe layers under its overrides.
RECIPE_CONFIGS = {"retries": "deploy/configs/retries.toml"}
#: Each recipe's variants, in the table's order.
RECIPE_VARIANTS = {"today": FIRST_VARIANTS, "paper": FIRST_VARIANTS,
                   "blind-critic": FIRST_VARIANTS, "retries": RETRIES_VARIANTS}
#: A recipe whose runs are budgeted in learner steps (each of
#: replay.rollouts_per_batch rollouts, whatever their segments: every variant
#: sees as many rollouts per step and as many steps), not minutes; its time
#: budget is then a guard only.
RECIPE_STEPS = {"retries": 100}
STEP_BUDGET_GUARD_MINUTES = 40.0
#: Episodes per held-out task in a recipe's evaluation (1 unless named).
RECIPE_GROUPS = {"retries": GRPO_GROUP_SIZE}
#: Where each recipe's table goes: run folder, results.md section, file stem.
RECIPE_OUTPUTS = {"today": ("runs/ablations", "ablations", "results"),
                  "paper": ("runs/ablations-paper", "ablations-paper", "results-paper"),
                  "blind-critic": ("runs/ablations-blind-critic", "ablations-blind-critic",
                                   "results-blind-critic"),
                  "retries": ("runs/ablations-retries", "ablations-retries", "results-retries")}
#: The base policy each recipe's records are made from, kept in docs/ (one
#: copy for the recipes that share it: the same digest).
KEPT_BASES = {"today": "results-base", "paper": "results-paper-base",
              "blind-critic": "results-paper-base", "retries": "results-retries-base"}
#: How each recipe's section is titled.
RECIPE_TITLES = {"today": "the ablation table", "paper": "the ablation table, the paper's recipe",
                 "blind-critic": "the ablation table, the paper's lambda with a blind critic "
                                 "(V = 0)",
                 "retries": "the ablation table, unequal compaction (keyvault with retries)"}
#: Learner steps are not the budget (time is): this only keeps max_steps out of the way.
UNBOUNDED_STEPS = 1_000_000
#: Each training run's wall-time budget, as the tables were measured (the
#: local default itself trains a fixed number of steps, its time a guard).
TABLE_MINUTES = 5.0
#: Final answers at each end of a run's replay log checked for padding
#: (``deploy.answer_lengths``: more digits than the codes have).
ANSWER_WINDOW = 500


def run(command: list[str], log: Path) -> None:
    print("  $ " + shlex.join(command), flush=True)
    with log.open("a") as out:
        completed = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    if completed.returncode not in (0, 130):
        raise SystemExit(f"command failed ({completed.returncode}); see {log}")


def check(command: list[str]) -> None:
    """What ``compactionrl`` would do with ``command`` before running
    anything: parse it and load its configuration (``ConfigError`` if an
    override names no field or a value is invalid)."""
    from deploy.cli import build_parser

    args, overrides = build_parser().parse_known_args(command[1:])
    load_config(getattr(args, "config", None), overrides)


def recipe_config(recipe: str, *overrides: str) -> JobConfig:
    """The configuration of a recipe's runs: its file over the local default,
    then its overrides and ``overrides``."""
    return load_config(RECIPE_CONFIGS.get(recipe), [*RECIPES[recipe], *overrides])


def config_args(recipe: str) -> list[str]:
    """The recipe's configuration file, as the command line takes it."""
    return ["--config", RECIPE_CONFIGS[recipe]] if recipe in RECIPE_CONFIGS else []


def eval_command(model: Path, episodes: int, compaction: bool, out: Path, recipe: str
                 ) -> list[str]:
    groups = RECIPE_GROUPS.get(recipe, 1)
    return [COMPACTIONRL, "eval", *config_args(recipe), "--model", str(model), "--episodes",
            str(episodes), "--compaction", "on" if compaction else "off", "--out", str(out),
            *(["--group-size", str(groups)] if groups > 1 else [])]


def run_name(variant: str, seed: int) -> str:
    return f"{variant.replace('=', '-')}-seed{seed}"


def budget_args(minutes: float, recipe: str) -> list[str]:
    """Time is the budget, or a recipe's learner steps with time a guard."""
    if recipe in RECIPE_STEPS:
        return ["--run.max_minutes", str(STEP_BUDGET_GUARD_MINUTES),
                "--learner.max_steps", str(RECIPE_STEPS[recipe])]
    return ["--run.max_minutes", str(minutes), "--learner.max_steps", str(UNBOUNDED_STEPS)]


def up_command(variant: str, seed: int, minutes: float, out_dir: Path, recipe: str
               ) -> list[str]:
    return [COMPACTIONRL, "up", *config_args(recipe), "--run.out_dir", str(out_dir),
            "--run.name", run_name(variant, seed), "--run.seed", str(seed),
            *budget_args(minutes, recipe), *RECIPES[recipe], *VARIANTS[variant]]


def evaluate(model: Path, episodes: int, compaction: bool, out: Path, log: Path, recipe: str
             ) -> dict[str, Any]:
    if not out.is_file():  # finished evaluations are kept: a rerun resumes
        run(eval_command(model, episodes, compaction, out, recipe), log)
    return json.loads(out.read_text())


def train(variant: str, seed: int, minutes: float, out_dir: Path, log: Path, recipe: str
          ) -> Path:
    """The run's folder, trained (a folder cut short is trained over)."""
    run_dir = out_dir / run_name(variant, seed)
    if not all((run_dir / name).is_file() for name in ("export/config.json", "wall_seconds")):
        shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short: start it over
        began, clean = time.perf_counter(), tree_clean()
        run(up_command(variant, seed, minutes, out_dir, recipe), log)
        (run_dir / "wall_seconds").write_text(f"{time.perf_counter() - began:.1f}\n")
        # the code it trained with is the commit's only if nothing changed meanwhile
        (run_dir / "tree_clean").write_text(json.dumps(clean and tree_clean()) + "\n")
    return run_dir


def record_run(run_dir: Path, variant: str, seed: int, episodes: int, log: Path, recipe: str
               ) -> dict[str, Any]:
    """A trained run's record: what the table needs of it, evaluated."""
    last = (read_history(run_dir / "metrics.jsonl") or [{}])[-1]
    export = run_dir / "export"
    record: dict[str, Any] = {
        "variant": variant, "seed": seed, "machine": machine(), "commit": commit(),
        "learner_steps": int(last.get("learner_step") or 0),
        "wall_seconds": float((run_dir / "wall_seconds").read_text()),
        "cross_factor": cross_factors(last),
        "loss_weight": weight_by_compactions(last),
        "tree_clean": (json.loads((run_dir / "tree_clean").read_text())
                       if (run_dir / "tree_clean").is_file() else None),
        "stale_rollouts": last.get("stale_rollouts"),
        "group_rollouts": {"complete": last.get("group_rollouts_complete"),
                           "broken": last.get("group_rollouts_broken")},
        "compacted": evaluate(export, episodes, True, run_dir / evaluation_name(True), log,
                              recipe)}
    if variant == "compaction=false":
        record["single_window"] = evaluate(export, episodes, False,
                                           run_dir / evaluation_name(False), log, recipe)
    answers = answer_lengths(run_dir, ANSWER_WINDOW)
    record["answers"] = {key: answers[key] for key in
                         ("answers", "code_digits", "over_long_first", "over_long_last")}
    record["answer_credit"] = credited_answers(run_dir)
    return record


def credited_answers(run_dir: Path) -> dict[str, Any]:
    """What the run's training gave the wrong answers of rollouts that
    ended right, against their right ones (``deploy.answer_credit``)."""
    return {key: value for key, value in answer_credit(run_dir).items() if key != "run"}


def environment_digest(factory: str) -> str:
    """The environment's identity: its module's source (a changed reward makes
    other runs, whatever the configuration says)."""
    spec = importlib.util.find_spec(factory.partition(":")[0])
    if spec is None or spec.origin is None:
        raise SystemExit(f"environment factory {factory!r}: no such module")
    return hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()


#: What the table itself writes into the checkout as it goes (records,
#: sections, their JSON and charts, kept bases): not code a run trains with.
OWN_OUTPUTS = (":(exclude)docs/results*", ":(exclude)docs/images/ablations*")


def tree_clean() -> bool | None:
    """Whether the checkout's tracked files are as committed, but for the
    table's own outputs (None outside git)."""
    found = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            *OWN_OUTPUTS], cwd=ROOT, capture_output=True, text=True,
                           check=False)
    return None if found.returncode else not found.stdout.strip()


def commit() -> str | None:
    """The checkout's commit, recorded with each run (None outside git)."""
    found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                           text=True, check=False)
    return found.stdout.strip() or None


def provide_base(base: Path, kept: Path, fresh: bool, bootstrap: Callable[[], None]) -> str:
    """Make sure ``base`` is there: the ``kept`` base restored, else
    bootstrapped; returns its digest. A base other than the kept one is
    refused (unless ``fresh``): the kept one is what the records were made from."""
    if not (base / "config.json").is_file():
        if kept.is_dir() and not fresh:
            shutil.copytree(kept, base)
        else:
            bootstrap()
    digest = base_digest(base)
    if kept.is_dir() and not fresh and digest != base_digest(kept):
        raise SystemExit(f"{base} is not the base the records were made from ({kept}): "
                         "move it aside to resume from the kept one, or pass --fresh")
    return digest


def load_records(path: Path, settings: dict[str, Any], fresh: bool) -> dict[str, Any]:
    """The runs recorded under ``settings`` (none yet: an empty record);
    records of other settings are refused unless ``fresh``."""
    empty = {"settings": settings, "base": {}, "runs": {}}
    if not path.is_file():
        return empty
    records = json.loads(path.read_text())
    if same_settings(records.get("settings", {}), settings):
        return records
    if not fresh:  # hours of runs: never dropped unasked
        changed = sorted(key for key in settings.keys() | records.get("settings", {}).keys()
                         if settings.get(key) != records.get("settings", {}).get(key))
        raise SystemExit(f"{path} records runs made with other settings ({', '.join(changed)}"
                         "): pass --fresh to drop them and start over")
    print(f"{path} records runs of other settings: starting over (--fresh)", flush=True)
    return empty


def same_settings(recorded: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether runs recorded under ``recorded`` are runs of ``current``: every
    setting equal, except that a configuration field added since the records
    were made (absent from theirs) is taken as theirs where it holds its
    default. A field is added with the default that keeps what runs did
    before it existed (docs/design.md, section 5); one set otherwise
    makes other runs."""
    if recorded.keys() != current.keys() or any(
            recorded[key] != current[key] for key in recorded if key != "config"):
        return False
    if recorded["config"] == current["config"]:
        return True
    old, new = tomllib.loads(recorded["config"]), tomllib.loads(current["config"])
    return _added_at_default(old, new, tomllib.loads(to_toml(JobConfig())))


def _added_at_default(old: dict[str, Any], new: dict[str, Any], default: dict[str, Any]
                      ) -> bool:
    """``new`` is ``old`` with fields added at their values in ``default``."""
    if old.keys() - new.keys():
        return False  # a field since removed: the records' runs had something else
    for key, value in new.items():
        if key not in old:
            if value != default.get(key):
                return False
        elif isinstance(value, dict) and isinstance(old[key], dict):
            if not _added_at_default(old[key], value, default.get(key, {})):
                return False
        elif value != old[key]:
            return False
    return True


def drop_records_before(records: dict[str, Any], records_path: Path, fix: str,
                        variants: list[str], seeds: list[int], out_dir: Path) -> None:
    """Drop the records (and run folders) of ``variants`` made at a commit
    that does not contain ``fix``, for :func:`train_missing` to make again."""
    for variant in variants:
        for seed in seeds:
            name = run_name(variant, seed)
            made_at = records["runs"].get(name, {}).get("commit")
            if name in records["runs"] and not contains(made_at, fix):
                print(f"{name}: recorded at {made_at}, before {fix}: training it again",
                      flush=True)
                del records["runs"][name]
                shutil.rmtree(out_dir / name, ignore_errors=True)
    save_records(records_path, records)


def contains(commit_id: str | None, fix: str) -> bool:
    """Whether ``commit_id`` has ``fix`` in its history (a record without a
    commit has not); a commit git does not know is refused, not guessed."""
    if commit_id is None:
        return False
    found = subprocess.run(["git", "merge-base", "--is-ancestor", fix, commit_id], cwd=ROOT,
                           capture_output=True, text=True, check=False)
    if found.returncode not in (0, 1):
        raise SystemExit(f"--retrain-before: git cannot compare {fix} with {commit_id}: "
                         f"{found.stderr.strip()}")
    return found.returncode == 0


def save_records(path: Path, records: dict[str, Any]) -> None:
    """Written whole, then renamed: a run cut short never leaves half a file."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(records, indent=2) + "\n")
    partial.replace(path)


def evaluation_name(compaction: bool) -> str:
    return "eval-compacted.json" if compaction else "eval-single.json"


def pooled(evaluations: list[dict[str, Any]]) -> dict[str, Any]:
    """Success pooled over seeds (Wilson CI over all episodes) and the spread across seeds."""
    episodes = sum(e["episodes"] for e in evaluations)
    successes = round(sum(e["success"] * e["episodes"] for e in evaluations))
    rates = [e["success"] for e in evaluations]
    return {"success": successes / episodes, "ci95": wilson_interval(successes, episodes),
            "per_seed": rates, "std": statistics.pstdev(rates) if len(rates) > 1 else 0.0,
            "episodes": episodes,
            "mean_reward": statistics.fmean(e["mean_reward"] for e in evaluations),
            "compactions_per_episode": statistics.fmean(
                e["compactions_per_episode"] for e in evaluations),
            "summary_tokens": statistics.fmean(
                e["summary_tokens_per_compaction"] for e in evaluations),
            "success_by_compactions": pooled_by_compactions(evaluations),
            "compaction_spread": dict(sum((Counter(e.get("compaction_spread") or {})
                                           for e in evaluations), Counter())),
            "successes_by_task": pooled_by_task(evaluations)}


def pooled_by_task(evaluations: list[dict[str, Any]]) -> list[int] | None:
    """Successes per held-out task summed over the evaluations (every seed
    plays the same tasks); None where one predates the count."""
    counts = [e.get("successes_by_task") for e in evaluations]
    if not counts or any(c is None for c in counts) or len({len(c) for c in counts}) != 1:
        return None
    return [sum(column) for column in zip(*counts, strict=True)]


#: Resamples of the held-out tasks behind an interval clustered by task.
BOOTSTRAP_RESAMPLES = 10_000


def task_interval(first: dict[str, Any], second: dict[str, Any]) -> tuple[float, float] | None:
    """95 % percentile-bootstrap interval of the difference of two success
    rates, resampling the held-out tasks (each seed's and row's episodes of a
    task move together: they share the task, and every row plays the same
    tasks), None where either row lacks per-task counts. Fixed seed: the
    page renders the same interval every time."""
    a, b = first.get("successes_by_task"), second.get("successes_by_task")
    if not a or not b or len(a) != len(b):
        return None
    per_task = [first["episodes"] / len(a), second["episodes"] / len(b)]
    differences = [x / per_task[0] - y / per_task[1] for x, y in zip(a, b, strict=True)]
    draw = random.Random(0)
    means = sorted(statistics.fmean(draw.choices(differences, k=len(differences)))
                   for _ in range(BOOTSTRAP_RESAMPLES))
    return means[int(0.025 * BOOTSTRAP_RESAMPLES)], means[int(0.975 * BOOTSTRAP_RESAMPLES) - 1]


def pooled_by_compactions(evaluations: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Success by the number of compactions, over every evaluation's episodes."""
    episodes: Counter[str] = Counter()
    successes: Counter[str] = Counter()
    for evaluation in evaluations:
        for count, entry in (evaluation.get("success_by_compactions") or {}).items():
            episodes[str(count)] += entry["episodes"]
            successes[str(count)] += entry["success"] * entry["episodes"]
    return {count: {"episodes": episodes[count], "success": successes[count] / episodes[count]}
            for count in sorted(episodes, key=int)}


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{os.cpu_count()} CPU cores ({model}), {platform.system()} {platform.release()}"


def point(value: float) -> str:
    return f"{100 * value:.1f}"


def mean_factors(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each segment type's cross-trajectory factor, averaged over the runs that measured it."""
    measured = [run.get("cross_factor") or {} for run in runs]
    return {kind: statistics.fmean(values) for kind in ("summary", "execution")
            if (values := [m[kind] for m in measured if kind in m])}


def factor_cell(factors: dict[str, float], kind: str) -> str:
    return f"{factors[kind]:.3f}" if kind in factors else "-"


def padded_cell(runs: list[dict[str, Any]]) -> str:
    """The most any run's last answers padded (more digits than the codes
    have); "-" where the runs were not checked."""
    fractions = [run["answers"]["over_long_last"] for run in runs
                 if (run.get("answers") or {}).get("over_long_last") is not None]
    return point(max(fractions)) if fractions else "-"


def write_results(results: dict[str, Any], docs: Path) -> None:
    recipe = results.get("recipe_name", "today")
    _, section, stem = RECIPE_OUTPUTS[recipe]
    table = {"base": results["base"], **results["variants"]}
    rows = table_rows(table)
    chart = bar_chart("compacted success after training (pooled over seeds)",
                      {name: entry["compacted"]["success"] for name, entry in table.items()},
                      "variant", "compacted success")
    (docs / "images").mkdir(parents=True, exist_ok=True)
    (docs / "images" / f"{section}.svg").write_text(chart[chart.index("<svg"):])
    params = results["parameters"]
    runs = [run for entry in results["variants"].values() for run in entry["runs"]]
    training_minutes = sum(run["wall_seconds"] for run in runs) / 60
    title = RECIPE_TITLES[recipe]
    missing = [name for name in RECIPE_VARIANTS[recipe] if name not in results["variants"]]
    text = f"""# Results: {title}

Generated by `bench/ablations.py` — do not edit by hand; rerun:

```sh
{results['command']}
```

Machine: {results['machine']}. Wall time of the last invocation:
{results['wall_minutes']:.0f} min (it reuses finished runs of the same settings, so
a resumed table took less); the {len(runs)} training runs alone took
{training_minutes:.0f} min of `compactionrl up`, plus one evaluation each.
{budget_text(params)}

{chr(10).join(rows)}
{unequal_table(table, params)}
![compacted success by variant](images/{section}.svg)

{key_figures(table)}{"Not run yet: " + ", ".join(f"`{m}`" for m in missing) + "." + chr(10)
                     if missing else ""}
Success (the exact answer) is pooled over seeds (Wilson interval over all
evaluated episodes); mean reward is the fraction of digits right (the local
default trains on partial credit);
"per seed" lists each training seed's evaluation. A difference of two rows has
two 95 % intervals: over episodes (Newcombe's, from the two Wilson intervals),
which says how sure the evaluation is of these runs, and over seeds (Student's t
over the per-seed differences, from two seeds on), which says what another
seed's runs may differ by; where the evaluations counted successes per task,
a third, clustered by task (a bootstrap over the held-out tasks: each task's
episodes, of every seed and row, move together, since every row plays the
same tasks), and with it the paired p over seeds and whether the claim holds
under Holm's correction over the claims listed. `compaction=false` trains in
one window (an episode ends when it is full) and is evaluated both in one window
and with compaction. The cross factor is the learner's mean over the segments it
trained of `(γλ)^N_{{>s}}` (adaptive λ: the product of the later segments'
`(γλ_j)^{{n_j}}`) under the recipe's λ, whatever `advantage` applied
(`crl_learner_cross_factor_sum_total` over `crl_learner_trained_segments_total`;
"-" where the runs predate the counter or trained no segment of that type).
Padded answers: the most any seed's last {ANSWER_WINDOW} trained-on final answers listed
more digits than the codes have (`deploy.answer_lengths`; "-" for runs not checked).
{CREDIT_NOTE if params.get("group_size", 1) > 1 else ""}
{every_parameter(results, recipe, stem)}"""
    write_section(docs / "results.md", section, text)
    (docs / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")


def budget_text(params: dict[str, Any]) -> str:
    """How each run was budgeted, seeded and evaluated."""
    if "steps" in params:
        budget = (f"Budget per training run: {params['steps']} learner steps of "
                  f"{params['rollouts_per_batch']} rollouts each, whatever their segments (the "
                  "same rollouts per step and steps in every variant; the learning rate is "
                  "constant)")
    else:
        budget = (f"Budget per training run: {params['minutes']} min of `compactionrl up` "
                  "(engine start included)")
    groups = params.get("group_size", 1)
    played = (f", each held-out task played {groups} times (other samples)" if groups > 1
              else "")
    return (f"{budget}, seeds {params['seeds']}; every policy evaluated on the same "
            f"{params['episodes']} held-out episodes (seeds from 2^31, never trained on"
            f"{played}) at the sampling temperature it trains at ({params['temperature']:g}).")


#: What the unequal table's last columns are, under the table.
CREDIT_NOTE = """Wrong / right answers: over the rollouts each run kept as trained
(`RUN/samples`, about 100 per run) that answered wrong, walked again and then
answered right, the mean advantage the loss gave the tokens of their wrong
answers and of their right ones, both from those rollouts, averaged over seeds
(`deploy.answer_credit`; "-" for runs that kept none): a ratio near 0 leaves the
wrong answer alone, 1 reinforces it as much as the right one. Pooled over
tokens, the ratio weighs each rollout by its answers' lengths, so GRPO's one
advantage per rollout gives near 1, not exactly; "per rollout" is each
rollout's wrong answers' mean advantage less its right answers', averaged
(exactly 0 under one advantage per rollout; below 0 where training told the
wrong answer from the right one). † Measured before that was
fixed: the right answers came from every successful rollout, first-try
successes included, so the ratio compared hard-task recoveries with easy
first-try successes, not the two answers of one rollout. Grouped rollouts
trained with their whole group: the share, over the runs that counted it
(`crl_learner_group_rollouts_total`), of the trained rollouts with a group whose
G members were all in the same batch, which group-relative advantages assume
("-": not counted, the runs predate the counter, or no groups).
"""


def unequal_table(table: dict[str, Any], params: dict[str, Any]) -> str:
    """With groups in the evaluation: how unequally each policy's groups
    compacted, its success by compaction count, and the share of the loss
    weight its training gave rollouts by compaction count (against their
    share of the rollouts), and the advantage it gave the wrong answers of
    rollouts that ended right (against their right answers')."""
    if params.get("group_size", 1) < 2:
        return ""
    rows = [f"| policy | groups of {params['group_size']} with a compaction spread >= 2 % "
            "| success % by compactions (episodes) | loss weight % / rollouts % by "
            "compactions (training) | advantage of wrong / right answers in rollouts "
            "answered wrong, then right (training) | grouped rollouts trained with their "
            "whole group % (training) |", "|---|---|---|---|---|---|"]
    for name, entry in table.items():
        compacted = entry["compacted"]
        spread = compacted.get("compaction_spread") or {}
        groups = sum(spread.values())
        wide = sum(n for k, n in spread.items() if int(k) >= 2)
        by_count = ", ".join(f"{k}: {point(v['success'])} ({v['episodes']:.0f})"
                             for k, v in compacted.get("success_by_compactions", {}).items())
        weight = mean_weights(entry.get("runs", []))
        shares = ", ".join(f"{k}: {100 * v['weight']:.0f} / {100 * v['rollouts']:.0f}"
                           for k, v in weight.items()) or "-"
        rows.append(f"| {name} | {point(wide / groups) if groups else '-'} "
                    f"| {by_count or '-'} | {shares} | {credit_cell(entry.get('runs', []))} "
                    f"| {whole_group_cell(entry.get('runs', []))} |")
    return "\n" + "\n".join(rows) + "\n"


def whole_group_cell(runs: list[dict[str, Any]]) -> str:
    """The share of the grouped rollouts trained that had their whole group
    in their batch, over the runs that counted them (``crl_learner_group_rollouts_total``;
    "-": none did, or none trained in groups)."""
    counted = [run["group_rollouts"] for run in runs
               if (run.get("group_rollouts") or {}).get("complete") is not None]
    complete = sum(c["complete"] for c in counted)
    total = complete + sum(c["broken"] or 0 for c in counted)
    return point(complete / total) if total else "-"


def credit_cell(runs: list[dict[str, Any]]) -> str:
    """The wrong and right answers' mean advantage over the runs that
    measured both, their ratio, and how many kept rollouts they came from."""
    measured = [run["answer_credit"] for run in runs
                if (run.get("answer_credit") or {}).get("ratio") is not None]
    if not measured:
        return "-"
    wrong = statistics.fmean(m["wrong_answer_advantage"] for m in measured)
    right = statistics.fmean(m["right_answer_advantage"] for m in measured)
    rollouts = sum(m["retried_right_rollouts"] for m in measured)
    ratio = f"{wrong / right:.2f}" if right else "-"
    before_fix = "" if all("first_try_right_advantage" in m for m in measured) else " †"
    paired = [m["paired_difference"] for m in measured if m.get("paired_difference") is not None]
    pairs = (f"; per rollout {statistics.fmean(paired):+.3f}"
             if paired and len(paired) == len(measured) else "")
    return (f"{wrong:+.3f} / {right:+.3f} (ratio {ratio}{pairs}; {rollouts} rollouts)"
            f"{before_fix}")


def mean_weights(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each compaction bucket's loss-weight and rollout shares, averaged over
    the runs that measured them (a run without a bucket counts 0 there)."""
    measured = [run["loss_weight"] for run in runs if run.get("loss_weight")]
    buckets = sorted({k for m in measured for k in m}, key=COMPACTION_BUCKETS.index)
    return {k: {share: statistics.fmean(m.get(k, {}).get(share, 0.0) for m in measured)
                for share in ("weight", "rollouts")} for k in buckets}


def table_rows(table: dict[str, Any]) -> list[str]:
    """The results table in Markdown: its header, then a row per policy."""
    rows = ["| variant | runs | learner steps | compacted success % (95% CI) | per seed % "
            "| mean reward | single-window success % | compactions/episode | summary tokens "
            "| cross factor: summary / execution | padded answers % |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in table.items():
        compacted, single = entry["compacted"], entry.get("single_window")
        low, high = compacted["ci95"]
        steps = entry.get("learner_steps") or [0]
        runs = len(entry.get("runs", [])) or "-"
        rows.append(f"| {name} | {runs} | {statistics.fmean(steps):.0f} "
                    f"| {point(compacted['success'])} ({point(low)}-{point(high)}) "
                    f"| {', '.join(point(r) for r in compacted['per_seed'])} "
                    f"| {compacted['mean_reward']:.3f} "
                    f"| {point(single['success']) if single else '-'} "
                    f"| {compacted['compactions_per_episode']:.2f} "
                    f"| {compacted['summary_tokens']:.1f} "
                    f"| {factor_cell(factors := mean_factors(entry.get('runs', [])), 'summary')}"
                    f" / {factor_cell(factors, 'execution')} "
                    f"| {padded_cell(entry.get('runs', []))} |")
    return rows


def every_parameter(results: dict[str, Any], recipe: str, stem: str) -> str:
    """The results section's second half: the recipe, the base policy's
    recipe and measurements, the variants and the whole configuration."""
    records = (f"; each run's record: [{results['records']}]({results['records']})"
               if "records" in results else "")
    return f"""Recipe overrides (over the configuration below, in every variant):

```json
{json.dumps(RECIPES[recipe])}
```

## The base policy's recipe

```json
{json.dumps(results['recipe'], indent=2)}
```

What `compactionrl bootstrap` measured (the demonstrations' own success, and
the base's copy accuracy, teacher-forced on held-out demonstrations):

```json
{json.dumps(results['bootstrap'], indent=2)}
```

## Every parameter

Variant overrides (over the configuration below):

```json
{json.dumps({name: VARIANTS[name] for name in RECIPE_VARIANTS[recipe]}, indent=2)}
```

The effective configuration of the `full` runs (seed 0):

```toml
{results['config_toml']}```

Raw numbers: [{stem}.json]({stem}.json){records}.
"""


def key_figures(table: dict[str, Any]) -> str:
    """The table's headline comparisons, those its variants allow."""
    base = table["base"]["compacted"]
    lines = []
    if "full" in table:
        full = table["full"]["compacted"]
        gain = full["success"] - base["success"]
        lines.append(f"- Full CompactionRL vs the base: **{100 * gain:+.1f} points** of "
                     "compacted success (target: at least +40).")
    if "full" in table and "train_summary=false" in table:
        masked = table["train_summary=false"]["compacted"]
        half = [(c["ci95"][1] - c["ci95"][0]) / 2 for c in (full, masked)]
        lines += [
            f"- Full vs `train_summary=false`: **{100 * (full['success'] - masked['success']):+.1f}"
            f" points**; the 95 % CI half-widths are {100 * half[0]:.1f} and {100 * half[1]:.1f}"
            " points (target: a margin larger than both).",
            "- What the summaries became (tokens per compaction; a kept fact, `alpha seven .`, "
            f"is 3): base {base['summary_tokens']:.1f}, full {full['summary_tokens']:.1f}, "
            f"`train_summary=false` {masked['summary_tokens']:.1f}. Mean reward (fraction of "
            f"digits right): base {base['mean_reward']:.3f}, full {full['mean_reward']:.3f}, "
            f"`train_summary=false` {masked['mean_reward']:.3f}."]
    claims = [(claim, other) for claim, other in PAPER_CLAIMS if "full" in table and other in table]
    p_values = {other: p for _, other in claims
                if (p := seed_p_value(table["full"]["compacted"], table[other]["compacted"]))
                is not None}
    holding = holm(p_values)
    for claim, other in claims:
        verdict = ("" if other not in p_values else
                   f"; paired over seeds p = {p_values[other]:.3f}, "
                   f"{'holds' if other in holding else 'does not hold'} under Holm's "
                   f"correction over the {len(p_values)} claims")
        difference = difference_text(table["full"]["compacted"], table[other]["compacted"])
        lines.append(f"- {claim}: {difference}{verdict}")
    return "\n".join(lines) + "\n\n"


def seed_p_value(first: dict[str, Any], second: dict[str, Any]) -> float | None:
    """Two-sided p of the paired t test over the per-seed differences (None
    under two seeds, where the rows' seeds differ in number, or where every
    seed differs alike)."""
    if len(first["per_seed"]) != len(second["per_seed"]) or len(first["per_seed"]) < 2:
        return None
    differences = [a - b for a, b in zip(first["per_seed"], second["per_seed"], strict=True)]
    spread = statistics.stdev(differences)
    if spread == 0:
        return None
    return t_tail(abs(statistics.fmean(differences)) / (spread / len(differences) ** 0.5),
                  len(differences) - 1)


def t_tail(t: float, df: int) -> float:
    """P(|T| > t) for Student's t with ``df`` degrees of freedom: one less
    the density's integral over [-t, t] (Simpson's rule, 2,000 intervals),
    where scipy is not installed for one number."""
    scale = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))

    def density(x: float) -> float:
        return scale * (1 + x * x / df) ** (-(df + 1) / 2)

    steps, width = 2000, t / 2000
    total = density(0.0) + density(t) + sum((4 if i % 2 else 2) * density(i * width)
                                            for i in range(1, steps))
    return max(0.0, 1 - 2 * total * width / 3)


def holm(p_values: dict[str, float], level: float = 0.05) -> set[str]:
    """The claims that hold under Holm's step-down correction: the k-th
    smallest p (from 0) against ``level / (m - k)``, until the first that fails."""
    holding: set[str] = set()
    for rank, (name, p) in enumerate(sorted(p_values.items(), key=lambda item: item[1])):
        if p > level / (len(p_values) - rank):
            break
        holding.add(name)
    return holding


#: The paper's claims as comparisons of the table's rows: its recipe (``full``)
#: against each alternative.
PAPER_CLAIMS = [("Token-level over segment normalisation (`loss_norm=segment`)",
                 "loss_norm=segment"),
                ("Token-level over rollout normalisation (`loss_norm=rollout`)",
                 "loss_norm=rollout"),
                ("Cross-trajectory over independent GAE (`advantage=independent`)",
                 "advantage=independent"),
                ("PPO with a critic over GRPO (`advantage=grpo`)", "advantage=grpo"),
                ("PPO with a critic over GRPO with segment statistics "
                 "(`advantage=grpo_segments`)", "advantage=grpo_segments"),
                ("Training the summaries (`train_summary=false`)", "train_summary=false")]


def difference_interval(first: dict[str, Any], second: dict[str, Any]) -> tuple[float, float]:
    """95 % interval of the difference of two pooled success rates from their
    Wilson intervals (Newcombe's hybrid score method): over episodes, not
    seeds (:func:`seed_interval` is the seeds')."""
    p1, (l1, u1) = first["success"], first["ci95"]
    p2, (l2, u2) = second["success"], second["ci95"]
    difference = p1 - p2
    return (difference - ((p1 - l1) ** 2 + (u2 - p2) ** 2) ** 0.5,
            difference + ((u1 - p1) ** 2 + (p2 - l2) ** 2) ** 0.5)


#: Student's t, two-sided 95 %, by degrees of freedom (a table rather than
#: scipy, which the project does not install for two numbers).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262}


def seed_interval(first: dict[str, Any], second: dict[str, Any]
                  ) -> tuple[float, float] | None:
    """95 % t interval of the mean of the per-seed differences (both rows
    trained at the same seeds): what a new seed's run may differ by, which
    the pooled interval over episodes does not hold. None under two seeds,
    or where the rows' seeds differ in number."""
    if len(first["per_seed"]) != len(second["per_seed"]):
        return None
    differences = [a - b for a, b in zip(first["per_seed"], second["per_seed"], strict=True)]
    if not 1 < len(differences) <= len(T_975) + 1:
        return None
    mean = statistics.fmean(differences)
    half = T_975[len(differences) - 1] * statistics.stdev(differences) / len(differences) ** 0.5
    return mean - half, mean + half


def difference_text(first: dict[str, Any], second: dict[str, Any]) -> str:
    """The difference in points, its intervals over episodes and over
    seeds, and each seed's difference."""
    low, high = difference_interval(first, second)
    seeds = ", ".join(f"{100 * (a - b):+.1f}" for a, b in
                      zip(first["per_seed"], second["per_seed"], strict=False))
    over_seeds, over_tasks = seed_interval(first, second), task_interval(first, second)
    seed_text = ("" if over_seeds is None else
                 f"; over seeds {100 * over_seeds[0]:+.1f} to {100 * over_seeds[1]:+.1f}")
    if over_tasks is not None:
        seed_text += (f"; clustered by task {100 * over_tasks[0]:+.1f} to "
                      f"{100 * over_tasks[1]:+.1f}")
    return (f"**{100 * (first['success'] - second['success']):+.1f} points** (95 % CI over "
            f"episodes {100 * low:+.1f} to {100 * high:+.1f}{seed_text}; per seed {seeds})")


def dry_run(seeds: list[int], minutes: float, episodes: int, base: Path, out_dir: Path,
            recipe: str, variants: list[str]) -> list[str]:
    """Check and print every command the table would run; run none."""
    commands = ([] if (base / "config.json").is_file()
                else [[COMPACTIONRL, "bootstrap", *config_args(recipe)]])
    commands += [eval_command(base, episodes, compaction, out_dir / f"base-{name}.json", recipe)
                 for compaction, name in ((True, "compacted"), (False, "single"))]
    for variant in variants:
        for seed in seeds:
            run_dir = out_dir / run_name(variant, seed)
            commands += [up_command(variant, seed, minutes, out_dir, recipe),
                         eval_command(run_dir / "export", episodes, True,
                                      run_dir / evaluation_name(True), recipe)]
            if variant == "compaction=false":
                commands.append(eval_command(run_dir / "export", episodes, False,
                                             run_dir / evaluation_name(False), recipe))
    for command in commands:
        check(command)
        print("  $ " + shlex.join(command), flush=True)
    print(f"dry run: {len(commands)} commands checked, none run")
    return [shlex.join(command) for command in commands]


def parse_arguments() -> argparse.Namespace:
    parser = BenchmarkParser(__doc__.split("\n\n")[0], quick="one seed per variant")
    parser.add_size("--seeds", 3, 1, "seeds per variant", type=int)
    parser.add_argument("--minutes", type=float, default=TABLE_MINUTES,
                        help=f"wall-time budget of each training run (default {TABLE_MINUTES:g})")
    parser.add_argument("--episodes", type=int, default=300, help="evaluation episodes")
    parser.add_argument("--recipe", choices=list(RECIPES), default="today",
                        help="overrides of every variant (RECIPES); its own folder and section")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variants to train, in that order (default: "
                             "the recipe's, RECIPE_VARIANTS); the table also shows the "
                             "others whose runs are all finished")
    parser.add_argument("--out", default=None,
                        help="run folders (default: runs/ablations, runs/ablations-paper)")
    parser.add_argument("--docs", default="docs", help="where results.md goes")
    parser.add_argument("--render", action="store_true",
                        help="only write results.md again from the recipe's JSON in DOCS")
    parser.add_argument("--fresh", action="store_true",
                        help="drop the records and run folders made with other settings")
    parser.add_argument("--retrain-before", metavar="COMMIT", default=None,
                        help="train the requested variants again where their records were "
                             "made at a commit without COMMIT (a fix that changes what they "
                             "measure); runs made since are kept, so a resumed invocation "
                             "does not train them twice")
    parser.add_argument("--dry-run", action="store_true",
                        help="check and print the commands the table needs; train nothing")
    args = parser.parse_args()
    allowed = RECIPE_VARIANTS[args.recipe]
    args.requested = ([name.strip() for name in args.variants.split(",") if name.strip()]
                      if args.variants is not None else list(allowed))
    unknown = sorted(set(args.requested) - set(allowed))
    if unknown or not args.requested:
        parser.error(f"--variants: {', '.join(unknown) or 'none given'}; the recipe "
                     f"{args.recipe} has {', '.join(allowed)}")
    return args


def claim_folder(out_dir: Path, log: Path, settings: dict[str, Any], fresh: bool) -> None:
    """Make ``out_dir`` the folder of runs made with ``settings``: runs made
    with others are deleted only with ``fresh``, never unasked (a run not
    recorded yet, one cut short, say, would be lost)."""
    made_with = out_dir / "settings.json"
    kept = [path for path in out_dir.iterdir() if path != log]
    if kept and (not made_with.is_file() or made_with.read_text() != json.dumps(settings)):
        if not fresh:
            raise SystemExit(f"{out_dir} holds runs made with other settings (base, budget "
                             "or configuration): pass --fresh to delete them and start over, "
                             "or --out another folder")
        print(f"{out_dir} holds runs of other settings: starting over (--fresh)", flush=True)
        shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
    made_with.write_text(json.dumps(settings))


def train_missing(records: dict[str, Any], records_path: Path, args: argparse.Namespace,
                  seeds: list[int], base: Path, out_dir: Path, log: Path) -> None:
    """Evaluate the base and train and evaluate every requested run that no
    record holds yet (or none made since ``--retrain-before``'s fix), saving
    the records after each."""
    if args.retrain_before:
        drop_records_before(records, records_path, args.retrain_before, args.requested, seeds,
                            out_dir)
    print("evaluating the base policy", flush=True)
    if not records["base"]:
        records["base"] = {
            "compacted": evaluate(base, args.episodes, True, out_dir / "base-compacted.json",
                                  log, args.recipe),
            "single_window": evaluate(base, args.episodes, False, out_dir / "base-single.json",
                                      log, args.recipe)}
        save_records(records_path, records)
    for variant in args.requested:
        for seed in seeds:
            name = run_name(variant, seed)
            print(f"{variant}, seed {seed}", flush=True)
            if name not in records["runs"]:
                run_dir = train(variant, seed, args.minutes, out_dir, log, args.recipe)
                records["runs"][name] = record_run(run_dir, variant, seed, args.episodes, log,
                                                   args.recipe)
                save_records(records_path, records)
            recorded = records["runs"][name]
            if ("paired_difference" not in (recorded.get("answer_credit") or {})
                    and (out_dir / name / "export").is_dir()):
                # a measure added after the run was recorded, from its folder
                recorded["answer_credit"] = credited_answers(out_dir / name)
                save_records(records_path, records)
            print(f"  {recorded['learner_steps']} learner steps; compacted success "
                  f"{recorded['compacted']['success']:.1%}", flush=True)


def tabulate(records: dict[str, Any], seeds: list[int], recipe: str) -> dict[str, Any]:
    """The base and every variant whose runs are all recorded, pooled over seeds."""
    results: dict[str, Any] = {
        "base": {kind: pooled([evaluation]) for kind, evaluation in records["base"].items()},
        "variants": {}}
    for variant in RECIPE_VARIANTS[recipe]:
        runs = [records["runs"].get(run_name(variant, seed)) for seed in seeds]
        if None in runs:
            continue
        results["variants"][variant] = {
            "runs": runs, "learner_steps": [r["learner_steps"] for r in runs],
            "compacted": pooled([r["compacted"] for r in runs]),
            **({"single_window": pooled([r["single_window"] for r in runs])}
               if variant == "compaction=false" else {})}
    return results


def key_numbers(results: dict[str, Any]) -> dict[str, float]:
    """The figures the ``--json`` line and the printout give."""
    success = {name: entry["compacted"]["success"]
               for name, entry in results["variants"].items()}
    base_success = results["base"]["compacted"]["success"]
    return {
        "base_compacted_success": base_success,
        **({"full_compacted_success": success["full"],
            "full_minus_base": success["full"] - base_success} if "full" in success else {}),
        **({"full_minus_masked_summary": success["full"] - success["train_summary=false"]}
           if {"full", "train_summary=false"} <= success.keys() else {}),
        **{f"success[{name}]": value for name, value in success.items()},
        **{f"cross_factor_{kind}[{name}]": value
           for name, entry in results["variants"].items()
           for kind, value in mean_factors(entry["runs"]).items()},
        "wall_minutes": results["wall_minutes"],
    }


def parameters(args: argparse.Namespace, seeds: list[int], config: JobConfig
               ) -> dict[str, Any]:
    """How the table's runs were budgeted, seeded and evaluated."""
    return {"seeds": seeds, "minutes": args.minutes, "episodes": args.episodes,
            "temperature": config.actors.sampling.temperature,
            **({"steps": RECIPE_STEPS[args.recipe]} if args.recipe in RECIPE_STEPS else {}),
            "group_size": RECIPE_GROUPS.get(args.recipe, 1),
            "rollouts_per_batch": config.replay.rollouts_per_batch}


def main() -> int:
    args = parse_arguments()
    default_out, _, stem = RECIPE_OUTPUTS[args.recipe]
    if args.render:
        write_results(json.loads((Path(args.docs) / f"{stem}.json").read_text()),
                      Path(args.docs))
        return 0
    seeds = list(range(args.seeds))
    out_dir = Path(args.out or default_out)
    began = time.perf_counter()
    config = recipe_config(args.recipe)
    base = Path(config.run.model)
    if args.dry_run:
        commands = dry_run(seeds, args.minutes, args.episodes, base, out_dir, args.recipe,
                           args.requested)
        if args.json:
            print(json.dumps({"dry_run": True, "commands": commands}))
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "ablations.log"
    # The base the records were made from is kept beside them: a fresh
    # checkout's bootstrap need not give the same weights (another CPU model,
    # another summation order), and the records hold only for that base.
    kept_base = Path(args.docs) / KEPT_BASES[args.recipe]
    digest = provide_base(base, kept_base, args.fresh,
                          lambda: run([COMPACTIONRL, "bootstrap", *config_args(args.recipe)],
                                      log))
    # Finished runs are reused only if made from this base, budget and configuration.
    settings = {"minutes": args.minutes, "episodes": args.episodes, "base": digest,
                **({"steps": RECIPE_STEPS[args.recipe]} if args.recipe in RECIPE_STEPS else {}),
                "environment": environment_digest(config.actors.environment.factory),
                "config": to_toml(config)}
    records_path = Path(args.docs) / f"{stem}-runs.json"
    records = load_records(records_path, settings, args.fresh)
    if not kept_base.is_dir() or args.fresh:
        shutil.rmtree(kept_base, ignore_errors=True)
        shutil.copytree(base, kept_base)
    claim_folder(out_dir, log, settings, args.fresh)
    train_missing(records, records_path, args, seeds, base, out_dir, log)
    results = tabulate(records, seeds, args.recipe)
    machines = {run["machine"] for entry in results["variants"].values()
                for run in entry["runs"]}
    results.update(
        command="python " + shlex.join(["bench/ablations.py", *sys.argv[1:]]),
        machine="; ".join(sorted(machines or {machine()})),
        wall_minutes=(time.perf_counter() - began) / 60,
        parameters=parameters(args, seeds, config), recipe_name=args.recipe,
        records=records_path.name, recipe=asdict(config.bootstrap),
        bootstrap={key: value for key, value in
                   json.loads((base / "bootstrap.json").read_text()).items()
                   if key in ("demonstrations", "copy_accuracy", "seconds")},
        config_toml=to_toml(recipe_config(args.recipe, "--run.seed", "0")))
    write_results(results, Path(args.docs))
    summary = key_numbers(results)
    for key, value in summary.items():
        print(f"{key:40s} {value:.3f}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
