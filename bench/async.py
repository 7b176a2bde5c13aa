"""Asynchronous speed-up: the same training synchronous and asynchronous, in one run.

Two ``compactionrl up`` runs on the local default, identical but for the
staleness bound: ``max_staleness = 0`` (fully synchronous: the actors
generate a batch with the current weights, the learner trains on it and
publishes, and only then is the next batch generated: the replay grants its
credits when the learner asks for it) and ``max_staleness = 2`` (actors generate while
the learner trains). Both run the same number of learner steps with the
same batch size from the same base policy, with an environment step latency
typical of tool calls. Reported, per mode: learner tokens per second over the
training window (first to last step), learner idle fraction (waiting for a
batch), actor idle fraction (episode slots stalled on credits or weights),
rollouts dropped stale (and, of the complete rollouts, the fraction dropped
and the mean length and success of those trained against all of them), and
held-out compacted success after training; and ``async_vs_sync_throughput``
and ``stale_fraction_async``.

Episode slots: both modes run ``(1 + max_staleness of the async mode) *
rollouts_per_batch`` episodes at once per actor (``--concurrent-episodes``
overrides), the most the async mode's credits ever admit. Fewer slots would
cap the async mode below its staleness bound (with one batch of slots it can
only overlap the next batch's generation with the current step); the sync
mode's credits admit one batch whatever the slots, so its extra slots wait on
credits and count as actor idle time.

    python bench/async.py [--steps 12] [--step-latency 0.3] [--episodes 200]
                          [--concurrent-episodes N] [--json] [--dry-run]

``--dry-run`` checks the commands of both modes (the command line's parser and
the configuration loader), prints them and trains nothing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from _options import BenchmarkParser  # bench/_options.py

from deploy.config import JobConfig, load_config
from ops.report import read_history
from ops.summary import finished_rollouts, training_window

ROOT = Path(__file__).resolve().parent.parent
COMPACTIONRL = str(Path(sys.executable).with_name("compactionrl"))
MODES = {"sync": 0, "async": 2}


def run(command: list[str], log: Path) -> None:
    print("  $ " + shlex.join(command), flush=True)
    with log.open("a") as out:
        completed = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    if completed.returncode != 0:
        raise SystemExit(f"command failed ({completed.returncode}); see {log}")


def episode_slots(config: JobConfig) -> int:
    """Episodes per actor at once: as many as the async mode's credits admit."""
    return (1 + MODES["async"]) * config.replay.rollouts_per_batch


def run_dir_of(mode: str, out_dir: Path) -> Path:
    return out_dir / f"{mode}-staleness{MODES[mode]}"


def overrides_of(mode: str, args: argparse.Namespace, out_dir: Path) -> list[str]:
    """The configuration overrides of one mode's ``compactionrl up``."""
    return ["--run.out_dir", str(out_dir), "--run.name", run_dir_of(mode, out_dir).name,
            "--replay.max_staleness", str(MODES[mode]), "--learner.publish_every", "1",
            "--learner.max_steps", str(args.steps),
            "--actors.concurrent_episodes", str(args.concurrent_episodes),
            "--actors.environment.options.step_latency_s", str(args.step_latency)]


def eval_command(run_dir: Path, episodes: int) -> list[str]:
    return [COMPACTIONRL, "eval", "--model", str(run_dir / "export"), "--episodes",
            str(episodes), "--out", str(run_dir / "eval-compacted.json")]


def dry_run(args: argparse.Namespace, out_dir: Path) -> list[str]:
    """Check and print both modes' commands, as ``compactionrl`` would parse
    and configure them; run none."""
    from deploy.cli import build_parser

    checked = []
    for mode in MODES:
        for command in ([COMPACTIONRL, "up", *overrides_of(mode, args, out_dir)],
                        eval_command(run_dir_of(mode, out_dir), args.episodes)):
            parsed, overrides = build_parser().parse_known_args(command[1:])
            load_config(getattr(parsed, "config", None), overrides)
            print("  $ " + shlex.join(command), flush=True)
            checked.append(shlex.join(command))
    print("dry run: the commands of both modes checked, none run")
    return checked


def measure(mode: str, args: argparse.Namespace, out_dir: Path, log: Path) -> dict[str, Any]:
    run_dir = run_dir_of(mode, out_dir)
    overrides = overrides_of(mode, args, out_dir)
    config = load_config(None, overrides)
    shutil.rmtree(run_dir, ignore_errors=True)  # this script's own output, from a last run
    run([COMPACTIONRL, "up", *overrides], log)
    try:
        first, last = training_window(read_history(run_dir / "metrics.jsonl"), args.steps)
    except ValueError as exc:
        raise SystemExit(f"{exc}: raise --steps") from None
    seconds = last["time"] - first["time"]
    slots = config.actors.count * config.actors.concurrent_episodes
    stalled = ((last["stall_credits_s"] - first["stall_credits_s"])
               + (last["stall_weights_s"] - first["stall_weights_s"]))
    run(eval_command(run_dir, args.episodes), log)
    report = json.loads((run_dir / "eval-compacted.json").read_text())
    return {
        "max_staleness": MODES[mode],
        "steps_timed": last["learner_step"] - first["learner_step"],
        "seconds": seconds,
        "learner_tokens_per_s": (last["learner_tokens"] - first["learner_tokens"]) / seconds,
        "learner_idle_fraction": (last["learner_idle_s"] - first["learner_idle_s"]) / seconds,
        "actor_idle_fraction": stalled / (seconds * slots),
        "stale_rollouts": last["stale_rollouts"],
        **(finished_rollouts(last) or {}),
        "success": report["success"], "success_ci95": report["success_ci95"],
    }


def main() -> int:
    parser = BenchmarkParser(__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="learner steps per mode")
    parser.add_argument("--step-latency", type=float, default=0.3,
                        help="seconds per environment step (a tool call)")
    parser.add_argument("--episodes", type=int, default=200, help="evaluation episodes")
    parser.add_argument("--concurrent-episodes", type=int, default=None,
                        help="episodes per actor at once in both modes "
                        "(default: what the async mode's credits admit)")
    parser.add_argument("--out", default="runs/async-bench")
    parser.add_argument("--dry-run", action="store_true",
                        help="check and print both modes' commands; train nothing")
    args = parser.parse_args()
    if args.concurrent_episodes is None:
        args.concurrent_episodes = episode_slots(load_config(None, []))
    out_dir = Path(args.out)
    if args.dry_run:
        commands = dry_run(args, out_dir)
        if args.json:
            print(json.dumps({"dry_run": True, "commands": commands}))
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "async.log"
    results = {mode: measure(mode, args, out_dir, log) for mode in MODES}
    print(f"{'':24s} {'sync':>10s} {'async':>10s}")
    for key in ("learner_tokens_per_s", "learner_idle_fraction", "actor_idle_fraction",
                "stale_rollouts", "success"):
        print(f"{key:24s} {results['sync'][key]:10.3f} {results['async'][key]:10.3f}")
    summary = {
        "async_vs_sync_throughput": (results["async"]["learner_tokens_per_s"]
                                     / results["sync"]["learner_tokens_per_s"]),
        "stale_fraction_async": results["async"].get("stale_fraction"),
        "success_sync": results["sync"]["success"], "success_async": results["async"]["success"],
        "steps": args.steps, "step_latency_s": args.step_latency,
        "concurrent_episodes": args.concurrent_episodes, "modes": results,
    }
    print(f"async_vs_sync_throughput {summary['async_vs_sync_throughput']:.2f}, "
          f"stale_fraction_async {summary['stale_fraction_async']}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
