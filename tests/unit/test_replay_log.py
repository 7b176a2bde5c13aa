"""The durable log: records survive, a torn or corrupt tail is cut, compaction is atomic."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from replay.log import CATCH_UP_BYTES, RELEASED, SEGMENT, VERSION, DurableLog, decode_version


def records(path: Path) -> list[tuple[int, bytes]]:
    log = DurableLog(path)
    try:
        return list(log.recover())
    finally:
        log.close()


def write(path: Path, frames: list[bytes], released: list[str] = ()) -> None:
    log = DurableLog(path)
    for frame in frames:
        log.append_segment(frame)
    for rollout in released:
        log.append_released(rollout, 0)
    log.sync()
    log.close()


def test_records_come_back_in_order(tmp_path: Path) -> None:
    path = tmp_path / "log"
    write(path, [b"one", b"two"], ["r1"])
    write(path, [b"three"])
    assert records(path) == [(SEGMENT, b"one"), (SEGMENT, b"two"), (RELEASED, b"r1"),
                             (SEGMENT, b"three")]


@pytest.mark.parametrize("seed", range(20))
def test_a_torn_tail_is_cut_and_never_followed_by_new_data(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "log"
    frames = [random.Random(seed * 100 + i).randbytes(50) for i in range(5)]
    write(path, frames)
    size = path.stat().st_size
    cut = random.Random(seed).randrange(1, size)
    with open(path, "r+b") as file:
        file.truncate(cut)
    survivors = records(path)
    assert [p for _, p in survivors] == frames[:len(survivors)]
    write(path, [b"after"])
    assert [p for _, p in records(path)] == frames[:len(survivors)] + [b"after"]


def test_a_corrupt_record_ends_recovery(tmp_path: Path) -> None:
    path = tmp_path / "log"
    write(path, [b"good", b"flipped", b"lost"])
    data = bytearray(path.read_bytes())
    data[9 + 4 + 9 + 2] ^= 0xFF  # a payload byte of the second record
    path.write_bytes(bytes(data))
    assert records(path) == [(SEGMENT, b"good")]


def test_compaction_keeps_only_live_frames_and_the_learner_version(tmp_path: Path) -> None:
    path = tmp_path / "log"
    log = DurableLog(path)
    for i in range(10):
        log.append_segment(b"frame-%d" % i)
        log.append_version(i)
    log.append_released("r", 70)
    log.sync()
    before = path.stat().st_size
    log.compact([b"frame-8", b"frame-9"], version=9)
    log.append_segment(b"frame-10")
    log.close()
    assert path.stat().st_size < before
    kept = records(path)
    assert [(kind, decode_version(p)) for kind, p in kept if kind == VERSION] == [(VERSION, 9)]
    assert [p for kind, p in kept if kind == SEGMENT] == [b"frame-8", b"frame-9", b"frame-10"]
    assert not path.with_suffix(".compacting").exists()


@pytest.mark.parametrize("catch_up_bytes", [0, CATCH_UP_BYTES])
def test_records_appended_during_a_background_compaction_follow_the_live_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, catch_up_bytes: int) -> None:
    """Whether the thread or the swap copies them (0: the thread copies
    whatever it finds flushed), the new log replays to the same records."""
    monkeypatch.setattr("replay.log.CATCH_UP_BYTES", catch_up_bytes)
    path = tmp_path / "log"
    log = DurableLog(path)
    for i in range(4):
        log.append_segment(b"frame-%d" % i)
    log.append_released("r0", 14)
    log.sync()
    log.start_compaction([b"frame-2", b"frame-3"], version=5)
    assert log.compacting
    log.append_segment(b"during")  # the service goes on while the thread writes
    log.append_released("r1", 14)
    log.sync()
    assert log.finish_compaction(wait=True) and not log.compacting
    log.append_segment(b"after")
    log.close()
    assert records(path) == [(VERSION, (5).to_bytes(8, "little")), (SEGMENT, b"frame-2"),
                             (SEGMENT, b"frame-3"), (SEGMENT, b"during"), (RELEASED, b"r1"),
                             (SEGMENT, b"after")]
    assert not path.with_suffix(".compacting").exists()


def test_a_compaction_that_cannot_write_leaves_the_log_whole(tmp_path: Path) -> None:
    path = tmp_path / "log"
    log = DurableLog(path)
    log.append_segment(b"kept")
    log.sync()
    path.with_suffix(".compacting").mkdir()  # the rewrite's file cannot be opened
    log.start_compaction([], version=1)
    with pytest.raises(OSError, match="the log is unchanged"):
        log.finish_compaction(wait=True)
    path.with_suffix(".compacting").rmdir()
    log.append_segment(b"next")
    log.close()
    assert records(path) == [(SEGMENT, b"kept"), (SEGMENT, b"next")]


def test_without_hard_links_a_compaction_still_swaps_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(*args: object) -> None:
        raise OSError("hard links not supported")

    monkeypatch.setattr("replay.log.os.link", no_links)
    path = tmp_path / "log"
    log = DurableLog(path)
    log.append_segment(b"dead")
    log.append_segment(b"live")
    log.sync()
    log.compact([b"live"], version=2)
    log.append_segment(b"next")
    log.close()
    assert [p for kind, p in records(path) if kind == SEGMENT] == [b"live", b"next"]
    assert not path.with_suffix(".retired").exists()
