"""The decoder's fuzz target (tests/programs/fuzz_codec.py) runs clean for a
few seconds; run it longer by hand:
``python -m tests.programs.fuzz_codec --seconds 600``."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.processes import run_command

pytest.importorskip("atheris")

SECONDS = 10
ROOT = Path(__file__).parents[2]


def test_the_decoder_survives_coverage_guided_fuzzing(tmp_path: Path) -> None:
    result = run_command([sys.executable, "-m", "tests.programs.fuzz_codec",
                          "--seconds", str(SECONDS), "--corpus", str(tmp_path)],
                         timeout=SECONDS + 120,
                         env={"PYTHONPATH": os.pathsep.join(
                             [str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr[-4000:]
    assert not list(tmp_path.glob("crash-*"))
    [runs] = re.findall(r"Done (\d+) runs", result.stderr)
    print(f"{runs} inputs in {SECONDS} s, corpus {len(list(tmp_path.iterdir()))} inputs")
    assert int(runs) > 1000
