"""What keeping samples for the rollout viewer costs the learner: PPO steps of
the tiny model with rank 0's recording (learner/samples.py: the kept rollouts
taken from the step and written to disk) against the same steps without it,
interleaved on the same batches (``recording_vs_off``: the step time with
recording over without, each step recorded as if it were kept). Also the
bytes one kept step writes and the bound they give a run of any length
(``kept_mb_bound``: the most files kept times the largest file).

    python bench/samples.py [--json] [--quick] [--repeats 20]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from _options import BenchmarkParser  # bench/_options.py

from learner.batch import to_train_batch
from learner.config import LearnerConfig
from learner.models import load_critic, load_policy
from learner.ppo import PPOTrainer
from learner.samples import SampleRecorder
from protocol.synthetic import synthetic_batch
from starting_points.tiny_model import temporary_tiny_model

#: Rollouts per batch: the local default's replay.rollouts_per_batch.
ROLLOUTS = 16


def main() -> None:
    parser = BenchmarkParser(__doc__.splitlines()[0], quick="3 repeats (smoke test)")
    parser.add_size("--repeats", 20, 3, "pairs of steps, with and without recording", type=int)
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
    on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
    bound = SampleRecorder(Path("unused")).most_steps
    result = {"recording_vs_off": round(on / off, 4), "step_ms_off": round(1e3 * off, 2),
              "step_ms_recording": round(1e3 * on, 2), "bytes_per_kept_step": max(sizes),
              "kept_steps_bound": bound, "kept_mb_bound": round(bound * max(sizes) / 2**20, 2)}
    print(f"PPO step of {ROLLOUTS} rollouts: {result['step_ms_off']} ms without recording, "
          f"{result['step_ms_recording']} ms with ({result['recording_vs_off']}x, medians of "
          f"{args.repeats}); a kept step writes {max(sizes)} bytes, at most {bound} are kept "
          f"({result['kept_mb_bound']} MB)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
