"""bench/codec.py runs and its last line is the JSON object with the quoted ratios
(no speed is asserted here: speed is the benchmark's business)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.processes import run_command

BENCH = Path(__file__).parents[2] / "bench" / "codec.py"


def test_codec_benchmark_reports_ratios_as_json() -> None:
    result = run_command([sys.executable, str(BENCH), "--json", "--quick"], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("vs_pickle_32k", "vs_memcpy_32k", "vs_pickle_1k", "vs_memcpy_128k"):
        assert report[key] > 0
