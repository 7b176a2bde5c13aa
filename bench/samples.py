"""What the rollout viewer costs: (a) the learner, PPO steps of the tiny
model with rank 0's recording (learner/samples.py: the kept rollouts taken
from the step and written to disk) against the same steps without it,
interleaved on the same batches (``recording_vs_off``: the step time with
recording over without, each step recorded as if it were kept), and the
bytes one kept step writes and the bound they give a run of any length
(``kept_mb_bound``: the most files kept times the largest file); (b) the
reader, the page of a 10,000-step run at the bounds (kept steps of 2
rollouts of the local default's size, an actor's timeline file full, the
learner's steps): its size (``page_mb``) and the time headless Chromium
takes to draw it (``page_draw_ms``, measured by the page's own script; none
without Chromium).

    python bench/samples.py [--json] [--quick] [--repeats 20]
"""

from __future__ import annotations

import json
import random
import re
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from _options import BenchmarkParser  # bench/_options.py
from transformers import AutoTokenizer

from deploy.config import load_config, to_toml
from deploy.viewer import write_viewer
from learner.batch import to_train_batch
from learner.config import LearnerConfig
from learner.models import load_critic, load_policy
from learner.ppo import PPOTrainer
from learner.samples import SAMPLES_FOLDER, SampleRecorder, TrainedRollout, TrainedSequence
from ops.browser import CHROMIUM, rendered_dom
from ops.timeline import MAX_BYTES, TRACE_FOLDER, Timeline
from protocol.synthetic import synthetic_batch
from starting_points.tiny_model import temporary_tiny_model

#: Rollouts per batch: the local default's replay.rollouts_per_batch.
ROLLOUTS = 16
#: The long run whose page (b) draws, and its rollouts' shape: the local
#: default's windows of 260 tokens, 3 compactions (execution and summary
#: sequences), about 40 trained tokens in each.
LONG_RUN_STEPS = 10_000
SEQUENCES, WINDOW_TOKENS, TRAINED_TOKENS = 7, 260, 40


def long_run(folder: Path, vocabulary: int, actor_bytes: int) -> Path:
    """A run folder holding what a 10,000-step run keeps at the bounds (its
    actor's timeline file filled to ``actor_bytes``)."""
    run_dir = folder / "long-run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(to_toml(load_config(None, [])))
    rng = random.Random(0)
    trained = list(range(WINDOW_TOKENS - TRAINED_TOKENS, WINDOW_TOKENS))
    rollout = TrainedRollout("keyvault-1", 0.5, False, 3, {}, {"digits_right": 2.0},
                             [TrainedSequence(
        tokens=[rng.randrange(vocabulary) for _ in range(WINDOW_TOKENS)], trainable=trained,
        segment_types=["execution"], segment_lengths=[TRAINED_TOKENS], factors=[0.9],
        advantage=[rng.uniform(-1, 1) for _ in trained], is_weight=[1.0] * TRAINED_TOKENS,
        loss_weight=[0.001] * TRAINED_TOKENS, behaviour_logprob=[-0.7] * TRAINED_TOKENS,
        versions=[0] * TRAINED_TOKENS) for _ in range(SEQUENCES)])
    recorder = SampleRecorder(run_dir / SAMPLES_FOLDER)
    for step in range(1, LONG_RUN_STEPS + 1):
        if recorder.wants(step):
            recorder.record(step, step, [rollout, rollout])
    actor = Timeline(run_dir / TRACE_FOLDER / "actor-0.jsonl", "actor-0", actor_bytes)
    learner = Timeline(run_dir / TRACE_FOLDER / "learner.jsonl", "learner")
    began = time.monotonic() - LONG_RUN_STEPS * 10.0
    for n in range(actor_bytes // 64):  # more than the file takes: it ends full
        actor.add("episode", began + 0.25 * n, began + 0.25 * n + 5.0, f"slot {n % 16}")
    for step in range(LONG_RUN_STEPS):
        learner.add("step", began + 10.0 * step, began + 10.0 * step + 8.0, "learner")
    actor.close()
    learner.close()
    return run_dir


def page_figures(folder: Path, actor_bytes: int) -> dict[str, float | None]:
    """(b): the long run's page, its size and the time Chromium takes to draw it."""
    with temporary_tiny_model() as model:
        tokenizer = AutoTokenizer.from_pretrained(model)
    page = write_viewer(long_run(folder, len(tokenizer), actor_bytes), tokenizer)
    drawn = None
    if CHROMIUM is not None:
        dom = rendered_dom(page)
        drawn = float(re.search(r'data-rendered-ms="(\d+)"', dom).group(1))
    return {"page_mb": round(page.stat().st_size / 2**20, 2), "page_draw_ms": drawn}


def main() -> None:
    parser = BenchmarkParser(__doc__.splitlines()[0], quick="3 repeats (smoke test)")
    parser.add_size("--repeats", 20, 3, "pairs of steps, with and without recording", type=int)
    parser.add_size("--actor-bytes", MAX_BYTES, 2**20,
                    "bytes of the long run's actor timeline (a file's bound)", type=int)
    args = parser.parse_args()
    with temporary_tiny_model() as model, tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        trainer = PPOTrainer(load_policy(model), load_critic(model), LearnerConfig())
        recorder = SampleRecorder(Path(folder) / "samples", most_steps=args.repeats + 1)
        batches = [to_train_batch(synthetic_batch(rollouts=ROLLOUTS, seed=s), True)
                   for s in range(args.repeats + 1)]
        seconds: dict[bool, list[float]] = {True: [], False: []}
        for n, batch in enumerate(batches):
            for recording in (True, False):  # interleaved: both see the same machine state
                sample = partial(recorder.record, n + 1, n) if recording else None
                began = time.perf_counter()
                trainer.step(batch, sample=sample, sampled_rollouts=recorder.rollouts)
                if n:  # the first pair warms up
                    seconds[recording].append(time.perf_counter() - began)
        sizes = [path.stat().st_size for path in recorder.folder.glob("step-*.json")]
        page = page_figures(Path(folder), args.actor_bytes)
    on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
    bound = SampleRecorder(Path("unused")).most_steps
    result = {"recording_vs_off": round(on / off, 4), "step_ms_off": round(1e3 * off, 2),
              "step_ms_recording": round(1e3 * on, 2), "bytes_per_kept_step": max(sizes),
              "kept_steps_bound": bound, "kept_mb_bound": round(bound * max(sizes) / 2**20, 2),
              **page}
    print(f"PPO step of {ROLLOUTS} rollouts: {result['step_ms_off']} ms without recording, "
          f"{result['step_ms_recording']} ms with ({result['recording_vs_off']}x, medians of "
          f"{args.repeats}); a kept step writes {max(sizes)} bytes, at most {bound} are kept "
          f"({result['kept_mb_bound']} MB); the page of a {LONG_RUN_STEPS}-step run: "
          f"{page['page_mb']} MB, drawn in {page['page_draw_ms']} ms by headless Chromium")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
