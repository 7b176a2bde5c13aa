"""Experiment tracking (learner/tracking/) with the real packages: TensorBoard
event files read back with TensorBoard's own reader, a W&B run in offline
mode read back from its files; and the figures and samples a step records."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from learner.config import TrackingConfig
from learner.tracking.base import (
    SAMPLE_COLUMNS,
    git_revision,
    open_tracker,
    rollout_samples,
    step_scalars,
)
from protocol.synthetic import synthetic_batch
from tests.processes import process_tree

ROOT = Path(__file__).parents[2]
ROWS = [["task-0", "kept alpha seven", "answer alpha 7", 1.0, 1, 0],
        ["task-1", "", "next", 0.0, 0, 2]]


def record(tracker) -> None:
    tracker.config({"learner": {"lr": 1e-5}}, "abc123")
    for step in (1, 2, 3):
        tracker.scalars(step, {"train/loss": 1.0 / step, "rollouts/reward": 0.25 * step})
    tracker.table(3, "rollouts/samples", SAMPLE_COLUMNS, ROWS)
    tracker.close()


def test_tensorboard_events_read_back_with_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    record(open_tracker(TrackingConfig(backends=["tensorboard"]), tmp_path, "run-1"))
    events = EventAccumulator(str(tmp_path / "tracking" / "tensorboard"),
                              size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    tables = events.Tensors("rollouts/samples/text_summary")
    assert tables[0].step == 3
    text = tables[0].tensor_proto.string_val[0].decode()
    assert "| task | summaries | final_answer |" in text and "answer alpha 7" in text
    config = events.Tensors("run/config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"git_revision": "abc123"' in config


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (LevelDB's log format under a 7-byte
    ``:W&B`` header: 32 KiB blocks of checksum, length, type, data), parsed
    with wandb's own protobuf definitions."""
    import struct

    from wandb.proto import wandb_internal_pb2

    block, data = 32768, path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending, records = 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_a_wandb_run_offline_writes_what_was_logged(tmp_path: Path) -> None:
    os.environ["WANDB_SILENT"] = "true"
    tracker = open_tracker(TrackingConfig(backends=["wandb"], wandb_mode="offline",
                                          project="crl-test"), tmp_path, "run-2")
    record(tracker)
    [run] = list((tmp_path / "tracking" / "wandb").glob("offline-run-*"))
    [history_file] = list(run.glob("run-*.wandb"))
    records = wandb_records(history_file)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["train/loss"]) for h in history] == [
        (1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert history[-1]["rollouts/samples/_type"] == "table-file"
    assert history[-1]["rollouts/samples/nrows"] == len(ROWS)
    config = {item.key: json.loads(item.value_json) for r in records
              if r.WhichOneof("record_type") == "config" for item in r.config.update}
    assert config["git_revision"] == "abc123" and config["learner"] == {"lr": 1e-5}
    [table] = list(run.glob("files/media/table/rollouts/samples_3_*.table.json"))
    logged = json.loads(table.read_text())
    assert logged["columns"] == list(SAMPLE_COLUMNS) and logged["data"] == ROWS
    # wandb's service ended with the run: nothing of it outlives the tracker
    assert not [pid for pid in process_tree(os.getpid())[1:]
                if "wandb" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")]


def test_nothing_is_opened_without_backends(tmp_path: Path) -> None:
    assert open_tracker(TrackingConfig(), tmp_path, "run") is None
    assert not (tmp_path / "tracking").exists()


def test_a_step_records_the_batch_s_figures_and_samples_its_rollouts(
        tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    batch = synthetic_batch(rollouts=6, seed=2, vocab=1000)
    rewards = [float(r.segments[-1].reward) for r in batch.rollouts]
    scalars = step_scalars({"tokens": 10.0, "losses/policy_loss": 0.5}, batch, rewards,
                           [r > 0 for r in rewards], [1] * 6)
    assert scalars["losses/policy_loss"] == 0.5 and scalars["train/tokens"] == 10.0
    assert scalars["rollouts/reward"] == pytest.approx(sum(rewards) / 6)
    assert scalars["replay/staleness_max"] == 0.0
    rows = rollout_samples(batch, AutoTokenizer.from_pretrained(tiny_model_dir), 3)
    assert [row[0] for row in rows] == [r.segments[-1].task_id for r in batch.rollouts[:3]]
    assert all(len(row) == len(SAMPLE_COLUMNS) and row[2] for row in rows)
    assert [row[4] for row in rows] == [sum(s.segment_type == "summary" for s in r.segments)
                                        for r in batch.rollouts[:3]]


def test_the_revision_is_the_checkout_s_commit() -> None:
    revision = git_revision(ROOT)
    assert revision == "unknown" or len(revision.removesuffix("+dirty")) == 40
