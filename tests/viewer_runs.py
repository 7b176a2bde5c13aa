"""A run folder as the rollout viewer reads it, made by hand: the config,
the samples the learner keeps (one keyvault execution segment and the
summary that extends it, per rollout) and a few timeline spans; and the
held-out episodes ``compactionrl eval`` keeps whole."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from actors.config import ActorConfig
from deploy.config import load_config, to_toml
from deploy.evaluate import ShownEpisodes, play_held_out
from learner.samples import SampleRecorder, TrainedRollout, TrainedSequence
from ops.timeline import TRACE_FOLDER, Timeline
from tests.scripted_policy import ScriptedPolicy

WINDOW = "room 3 : note : alpha seven . room 4 : note : alpha two . stop . write a summary :"
SUMMARY = " alpha seven ."


def kept_rollout(tokenizer: Any, task: str, success: bool, actor: str,
                 versions: tuple[int, int]) -> TrainedRollout:
    """An execution segment whose last action is trained, and the summary
    that extends it (one sequence), as the learner keeps them, played by
    ``actor`` with the policy of ``versions`` (the action's, the summary's).
    Its advantages reach both ends of the scale, +0.5 and -0.5."""
    window = tokenizer.encode(WINDOW, add_special_tokens=False)
    summary = tokenizer.encode(SUMMARY, add_special_tokens=False)
    action = len(window) - 6  # "stop . write a summary :" stands for the request
    trainable = [action, *range(len(window), len(window) + len(summary))]
    n = len(trainable)
    return TrainedRollout(task, float(success), success, 1, {"rooms": "10"},
                          {"digits_right": float(success), "attempts": 1.0}, [TrainedSequence(
        tokens=window + summary, trainable=trainable, segment_types=["execution", "summary"],
        segment_lengths=[1, n - 1], factors=[0.5, 1.0],
        advantage=[0.5, -0.5, *[-0.25] * (n - 2)], is_weight=[1.0] * n, loss_weight=[0.01] * n,
        behaviour_logprob=[-0.5] * n, versions=[versions[0], *[versions[1]] * (n - 1)])],
                          actor=actor)


def kept_run(root: Path, tokenizer: Any) -> Path:
    """``root/my-run``: three kept rollouts over two steps (task keyvault-1
    at both, by actor a; keyvault-2 by actor b), and an actor's and the
    learner's spans, 4 s from the first one's start to the last one's end."""
    run_dir = root / "my-run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(to_toml(load_config(None, [])))
    recorder = SampleRecorder(run_dir / "samples")
    recorder.record(1, 5, [kept_rollout(tokenizer, "keyvault-1", False, "a", (3, 4))])
    recorder.record(2, 6, [kept_rollout(tokenizer, "keyvault-2", False, "b", (5, 5)),
                           kept_rollout(tokenizer, "keyvault-1", True, "a", (4, 5))])
    now = time.monotonic()
    for process, spans in (("actor-a", [("episode", "slot 0", 0.0, 3.0),
                                        ("summary", "slot 0", 1.0, 1.5)]),
                           ("learner", [("step", "learner", 2.0, 4.0)])):
        timeline = Timeline(run_dir / TRACE_FOLDER / f"{process}.jsonl", process)
        for name, lane, began, ended in spans:
            timeline.add(name, now + began, now + ended, lane)
        timeline.close()
    return run_dir


def played_held_out(tokenizer: Any, text: str) -> list[dict[str, Any]]:
    """The episodes ``compactionrl eval`` keeps whole, played by a policy
    that says ``text`` every turn."""
    config = ActorConfig()
    shown = ShownEpisodes()
    results = asyncio.run(play_held_out(ScriptedPolicy(tokenizer, text), config, 5,
                                        show_progress=False, keep=shown.keep))
    return shown.episodes(results)
