"""A file written atomically is whole or absent, whatever the writer's fate."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from ops.files import atomic_write_text, write_section


def test_replaces_the_content_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "meta.json"
    target.write_text("old")
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]


def test_a_writer_killed_mid_write_leaves_the_old_content(tmp_path: Path) -> None:
    target = tmp_path / "meta.json"
    atomic_write_text(target, "old")
    pid = os.fork()
    if pid == 0:  # the child dies inside the write, after the temporary is open
        original = os.fsync

        def die(fd: int) -> None:
            original(fd)
            os.kill(os.getpid(), signal.SIGKILL)

        os.fsync = die
        atomic_write_text(target, "new" * 1000)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)
    assert target.read_text() == "old"


def test_a_section_is_replaced_in_place_and_the_rest_kept(tmp_path: Path) -> None:
    page = tmp_path / "results.md"
    write_section(page, "table", "# one\n")
    write_section(page, "costs", "two")
    write_section(page, "table", "# one, again\n")
    assert page.read_text() == ("<!-- begin table -->\n# one, again\n<!-- end table -->\n\n"
                                "<!-- begin costs -->\ntwo\n<!-- end costs -->\n")
