"""Success inside and outside the training range of task sizes.

Each policy plays the same held-out keyvault episodes of the local default
at each size of :data:`SIZES` (more rooms and distractor words: longer
horizons, more windows, more compactions than any training episode had;
more digits: more facts to keep), with up to :data:`MAX_COMPACTIONS`
compactions so that a long episode is not cut by the training limit. The
table gives success, compactions per episode and the outcomes that ended
episodes; which sizes a policy trained on is the reader's to say
(``--policy NAME=MODEL``, the name can say it).

    python bench/horizons.py [--json] [--quick] [--episodes 200] [--docs DIR]
        [--policy base=runs/base-model --policy trained=runs/local-cpu/export ...]

``--docs DIR``: also write ``DIR/horizons.json`` and the table's section of
``DIR/results.md``. ``--quick``: a fresh tiny model, 4 episodes, two sizes
(a smoke test of the same code).

``--train NAME=CONFIG [--seeds 3]``: also train that many seeds of a recipe
file (``compactionrl up --config CONFIG --run.seed N``, its base restored
or bootstrapped by ``up``) and evaluate them and the recipe's base as
policies ``NAME-seedN`` and ``NAME-base``. As ``bench/ablations.py`` does,
each finished run is recorded at once in ``DIR/horizons-runs.json`` (with
the recipe's whole configuration, its base's digest, the environment's
source digest, the episodes and sizes, the machine and the commit), and a
later invocation under the same settings reuses it instead of training
again; records of other settings are refused (``--fresh`` drops them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shlex
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _options import BenchmarkParser  # bench/_options.py
from ablations import (  # bench/ablations.py: its records, kept the same way here
    COMPACTIONRL,
    commit,
    environment_digest,
    load_records,
    machine,
    run,
    save_records,
)

from actors.config import ActorConfig
from actors.context import ClosedSegment
from actors.engine import Engine, quiet_vllm_logging
from actors.envs.base import EVALUATION_SEEDS_FROM
from deploy.config import JobConfig, load_config, to_toml
from deploy.evaluate import EvalReport, play_held_out, require_model_folders, summarise
from deploy.fact_survival import CAUSES, account, layout_of, summarise_facts
from ops.files import write_section
from ops.report import line_chart, read_history
from starting_points.keyvault_bootstrap import base_digest
from starting_points.tiny_model import temporary_tiny_model

#: Size name -> keyvault options over the local default's (codes 1, digits 3,
#: rooms 10, distractor words 3).
SIZES: dict[str, dict[str, int]] = {
    "rooms 6": {"rooms": 6},
    "rooms 10 (the local default)": {},
    "rooms 14": {"rooms": 14},
    "rooms 20": {"rooms": 20},
    "rooms 28": {"rooms": 28},
    "distractor words 8": {"distractor_words": 8},
    "digits 4": {"digits": 4},
}
MAX_COMPACTIONS = 8
#: Columns of the answers' table by actions since the last compaction (the last: or more).
LAYOUT_COLUMNS = ("0", "1", "2", "3+")


def actors_at(size: dict[str, int]) -> ActorConfig:
    actors = load_config(None, []).actors
    return dataclasses.replace(
        actors,
        environment=dataclasses.replace(actors.environment,
                                        options=actors.environment.options | size),
        compaction=dataclasses.replace(actors.compaction, max_compactions=MAX_COMPACTIONS))


async def evaluate_sizes(model: str, sizes: dict[str, dict[str, int]], episodes: int
                         ) -> dict[str, tuple[EvalReport, dict[str, Any]]]:
    """Every size on one engine (the engine does not depend on the size):
    its report, and where its episodes lost their facts
    (:func:`deploy.fact_survival.summarise_facts`)."""
    engine_config = load_config(None, []).actors
    engine = await Engine.start(model, engine_config.engine, engine_config.sampling)

    def decode(ids: list[int]) -> str:
        return engine.tokenizer.decode(ids, skip_special_tokens=True)

    reports = {}
    try:
        for size, options in sizes.items():
            actors = actors_at(options)
            segments: dict[int, list[ClosedSegment]] = defaultdict(list)
            began = time.perf_counter()
            results = await play_held_out(
                engine, actors, episodes, show_progress=False,
                keep=lambda n, segment, kept=segments: kept[n].append(segment))
            seconds = time.perf_counter() - began
            accounts = [account(segments[n], result, await layout_of(
                actors.environment.options, EVALUATION_SEEDS_FROM + n), decode)
                for n, result in enumerate(results)]
            reports[size] = summarise(model, actors, results, seconds), summarise_facts(accounts)
    finally:
        await engine.shutdown()
    return reports


def measure_policy(name: str, model: str, sizes: dict[str, dict[str, int]], episodes: int
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One policy's success and where its episodes lost their facts, by size."""
    success: dict[str, Any] = {}
    facts: dict[str, Any] = {}
    for size, (report, survival) in asyncio.run(evaluate_sizes(model, sizes, episodes)).items():
        facts[size] = survival
        success[size] = {"success": report.success, "success_ci95": report.success_ci95,
                         "mean_reward": report.mean_reward,
                         "compactions_per_episode": report.compactions_per_episode,
                         "outcomes": report.outcomes}
        print(f"{name} at {size}: success {report.success:.3f}, "
              f"{report.compactions_per_episode:.2f} compactions/episode, "
              f"outcomes {report.outcomes}, causes {survival['causes']}", flush=True)
    return success, facts


def measure(policies: dict[str, str], sizes: dict[str, dict[str, int]], episodes: int
            ) -> dict[str, Any]:
    table: dict[str, dict[str, Any]] = {}
    facts: dict[str, dict[str, Any]] = {}
    for name, model in policies.items():
        table[name], facts[name] = measure_policy(name, model, sizes, episodes)
    return {"episodes": episodes, "max_compactions": MAX_COMPACTIONS, "policies": policies,
            "sizes": sizes, "success": table, "facts": facts}


#: Where ``--train`` trains its runs (the folders are not kept: the records are).
TRAIN_OUT_DIR = Path("runs/horizons")


def recipe_settings(config: JobConfig, episodes: int) -> dict[str, Any]:
    """What a recorded run of a recipe was made under; its base is made
    ready first (``up`` restores a kept base, else bootstraps one), so that
    its digest is the base's the runs start from."""
    from deploy.up import prepare_model

    prepare_model(config)
    return {"config": to_toml(config), "base": base_digest(Path(config.run.model)),
            "environment": environment_digest(config.actors.environment.factory),
            "episodes": episodes, "sizes": SIZES, "max_compactions": MAX_COMPACTIONS}


def train_seed(config_file: Path, name: str, seed: int) -> tuple[str, dict[str, Any]]:
    """One seed of the recipe trained by ``up`` (a folder left by a run cut
    short is trained over): its export, its learner steps and wall time."""
    run_dir = TRAIN_OUT_DIR / name
    shutil.rmtree(run_dir, ignore_errors=True)
    TRAIN_OUT_DIR.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    run([COMPACTIONRL, "up", "--config", str(config_file), "--run.seed", str(seed),
         "--run.name", name, "--run.out_dir", str(TRAIN_OUT_DIR)], TRAIN_OUT_DIR / f"{name}.log")
    last = (read_history(run_dir / "metrics.jsonl") or [{}])[-1]
    return str(run_dir / "export"), {"learner_steps": int(last.get("learner_step") or 0),
                                      "wall_seconds": round(time.perf_counter() - began, 1)}


def train_recipe(name: str, config_file: Path, seeds: int, episodes: int, records_path: Path,
                 fresh: bool) -> dict[str, dict[str, Any]]:
    """The recipe's base (``NAME-base``) and seeds (``NAME-seedN``), each
    evaluated at every size: from the records where they were made under the
    same settings, else trained and evaluated now and recorded at once."""
    config = load_config([str(config_file)], [])
    records = load_records(records_path, recipe_settings(config, episodes), fresh)
    wanted: dict[str, int | None] = {f"{name}-base": None,
                                     **{f"{name}-seed{seed}": seed for seed in range(seeds)}}
    for policy, seed in wanted.items():
        if policy in records["runs"]:
            print(f"{policy}: recorded at {records['runs'][policy]['commit']}, reused",
                  flush=True)
            continue
        model, made = ((config.run.model, {}) if seed is None
                       else train_seed(config_file, policy, seed))
        success, facts = measure_policy(policy, model, SIZES, episodes)
        records["runs"][policy] = {"model": model, "seed": seed, **made, "machine": machine(),
                                   "commit": commit(), "success": success, "facts": facts}
        save_records(records_path, records)
    return {policy: records["runs"][policy] for policy in wanted}


def with_recorded(report: dict[str, Any], recorded: dict[str, dict[str, Any]]
                  ) -> dict[str, Any]:
    """The report with the recorded policies as columns of their own."""
    for policy, record in recorded.items():
        report["policies"][policy] = record["model"]
        report["success"][policy] = record["success"]
        report["facts"][policy] = record["facts"]
    return report


def write_docs(report: dict[str, Any], docs: Path, command: str) -> None:
    (docs / "horizons.json").write_text(json.dumps(report, indent=2) + "\n")
    names = list(report["policies"])
    lines = [
        "## Outside the training range",
        "",
        f"Generated by `{command}` (raw numbers: [horizons.json](horizons.json)). "
        f"Compacted success % (95 % CI) on the same {report['episodes']} held-out episodes "
        f"per size, up to {report['max_compactions']} compactions; under each, the "
        "compactions per episode. Models: "
        + ", ".join(f"{n} = `{m}`" for n, m in report["policies"].items()) + ".",
        "",
        "| size | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names)]
    for size in report["sizes"]:
        cells = []
        for name in names:
            row = report["success"][name][size]
            low, high = row["success_ci95"]
            cells.append(f"{100 * row['success']:.1f} ({100 * low:.0f}-{100 * high:.0f}); "
                         f"{row['compactions_per_episode']:.2f}")
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    (docs / "images").mkdir(parents=True, exist_ok=True)
    lines += ["", *fact_rows(report), "", *layout_rows(report), ""]
    for stem, (title, chart) in fact_charts(report).items():
        (docs / "images" / f"{stem}.svg").write_text(chart)
        lines.append(f"![{title}](images/{stem}.svg)")
    write_section(docs / "results.md", "horizons", "\n".join(lines) + "\n")


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}"


def fact_rows(report: dict[str, Any]) -> list[str]:
    """The table of where the same episodes lost their facts
    (:mod:`deploy.fact_survival`)."""
    lines = [
        "### Where the facts are lost",
        "",
        "The same episodes, each given the first cause that applies "
        "(`deploy/fact_survival.py`): no answer, a note never read, a read fact "
        "missing from the window the answer was written from (lost in compaction), "
        "or every fact there and the answer wrong. *Kept at k*: of the read facts in "
        "the window before compaction k, the % in the window rebuilt after it "
        "(summary and kept step). *Kept to the answer*: of the facts read by the "
        "episodes that answered, the % in the answer's window. *Wrong with every "
        "fact*: of the answers written with every fact in the window, the % wrong.",
        "",
        "| size | policy | " + " | ".join(f"{c} %" for c in CAUSES)
        + " | facts read % | kept at k = 1, 2, ... % | kept to the answer % "
        "| wrong with every fact % |",
        "|---|---|" + "---|" * (len(CAUSES) + 4)]
    for size in report["sizes"]:
        for name in report["policies"]:
            row = report["facts"][name][size]
            kept = " / ".join(percent(v) for v in row["kept_by_compaction"].values())
            lines.append(f"| {size} | {name} | "
                         + " | ".join(percent(row["causes"][c]) for c in CAUSES)
                         + f" | {percent(row['read'])} | {kept or '-'} | "
                         f"{percent(row['in_answer_window'])} | "
                         f"{percent(row['wrong_with_every_fact'])} |")
    return lines


def layout_rows(report: dict[str, Any]) -> list[str]:
    """Of the answers written with every fact in the window, the % wrong,
    by the actions between the last compaction and the answer (0, 1, 2, 3 or more)."""
    lines = ["Answers written with every fact in the window: % wrong (of how many answers), "
             "by the actions between the last compaction and the answer.", "",
             "| size | policy | " + " | ".join(f"{k} actions" for k in LAYOUT_COLUMNS) + " |",
             "|---|---|" + "---|" * len(LAYOUT_COLUMNS)]
    for size in report["sizes"]:
        for name in report["policies"]:
            pooled: dict[str, list[float]] = {k: [0, 0] for k in LAYOUT_COLUMNS}
            for steps, row in report["facts"][name][size][
                    "wrong_with_every_fact_by_steps_since_compaction"].items():
                column = pooled[LAYOUT_COLUMNS[min(int(steps), len(LAYOUT_COLUMNS) - 1)]]
                column[0] += row["answers"]
                column[1] += row["answers"] * row["wrong"]
            cells = [f"{percent(wrong / answers)} ({answers})" if answers else "-"
                     for answers, wrong in pooled.values()]
            lines.append(f"| {size} | {name} | " + " | ".join(cells) + " |")
    return lines


def fact_charts(report: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Two charts by rooms, a line per recipe (a policy's name without its
    ``-seedN``, seeds averaged): the read facts kept to the answer, and the
    answers right when every fact was kept. File stem -> (title, SVG)."""
    default_rooms = load_config(None, []).actors.environment.options["rooms"]
    rooms = {size: options.get("rooms", default_rooms) for size, options in
             report["sizes"].items() if set(options) <= {"rooms"}}
    recipes: dict[str, list[str]] = defaultdict(list)
    for name in report["policies"]:
        recipes[re.sub(r"-seed\d+$", "", name)].append(name)

    def mean_by_rooms(names: list[str], value: Callable[[dict[str, Any]], float | None]
                      ) -> list[float | None]:
        means: list[float | None] = []
        for size in rooms:
            values = [v for name in names
                      if (v := value(report["facts"][name][size])) is not None]
            means.append(statistics.mean(values) if values else None)
        return means

    charts = {}
    for stem, title, value in (
            ("fact_survival", "read facts kept to the answer, by rooms",
             lambda row: row["in_answer_window"]),
            ("answers_with_every_fact", "answers right with every fact in the window, by rooms",
             lambda row: None if row["wrong_with_every_fact"] is None
             else 1 - row["wrong_with_every_fact"])):
        chart = line_chart(title, list(rooms.values()),
                           {recipe: mean_by_rooms(names, value)
                            for recipe, names in recipes.items()}, "rooms", "fraction")
        if "<svg" in chart:  # a chart without data is left out
            charts[stem] = title, chart[chart.index("<svg"):]
    return charts


def main() -> None:
    parser = BenchmarkParser(__doc__.splitlines()[0],
                             quick="a fresh tiny model, 4 episodes, two sizes (smoke test)")
    parser.add_size("--episodes", 200, 4, "episodes per size and policy", type=int)
    parser.add_argument("--policy", action="append", default=None, metavar="NAME=MODEL",
                        help="a policy to evaluate (repeatable; default: base=runs/base-model "
                             "trained=runs/local-cpu/export)")
    parser.add_argument("--docs", default=None,
                        help="also write DIR/horizons.json and its part of results.md")
    parser.add_argument("--train", default=None, metavar="NAME=CONFIG",
                        help="also train --seeds seeds of the recipe file CONFIG and evaluate "
                             "them and its base (NAME-seedN, NAME-base), each run recorded in "
                             "DOCS/horizons-runs.json (DOCS: --docs, else docs) and reused by "
                             "a later invocation under the same settings")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of --train's recipe")
    parser.add_argument("--fresh", action="store_true",
                        help="drop --train's records made under other settings")
    args = parser.parse_args()
    quiet_vllm_logging()
    if args.quick:
        with temporary_tiny_model() as tiny:
            report = measure({"tiny": tiny}, dict(list(SIZES.items())[:2]), args.episodes)
    else:
        given = args.policy or ([] if args.train else [
            "base=runs/base-model", "trained=runs/local-cpu/export"])
        policies = dict(p.split("=", 1) for p in given)
        require_model_folders(list(policies.values()), "give --policy NAME=MODEL")
        recorded = {}
        if args.train:
            name, config_file = args.train.split("=", 1)
            recorded = train_recipe(name, Path(config_file), args.seeds, args.episodes,
                                    Path(args.docs or "docs") / "horizons-runs.json", args.fresh)
        report = with_recorded(measure(policies, SIZES, args.episodes), recorded)
    if args.docs:
        trained = ["--train", args.train, "--seeds", str(args.seeds)] if args.train else []
        write_docs(report, Path(args.docs), shlex.join(
            ["python", "bench/horizons.py", "--json", "--docs", "docs", "--episodes",
             str(args.episodes), *(f"--policy={p}" for p in args.policy or []), *trained]))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
