"""The benchmarks run and end with the JSON object of the ratios they quote
(no speed is asserted: speed is the benchmarks' business)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.processes import run_command

BENCH = Path(__file__).parents[2] / "bench"


@pytest.mark.parametrize("script, arguments, keys", [
    ("codec.py", ["--quick"], ("vs_pickle_32k", "vs_memcpy_32k", "vs_pickle_1k")),
    ("replay.py", ["--senders", "2", "--segments", "40"],
     ("vs_raw_zmq_log_off", "vs_raw_zmq_log_on", "batch_latency_ms_p50")),
    ("learner.py", ["--quick"], ("gae_vs_loop", "ppo_vs_bare", "shared_vs_separate")),
    pytest.param("weights.py", ["--big-params", "2e6", "--engines", "1", "--pushes", "1"],
                 ("push_vs_raw_100m", "stall_vs_load"), marks=pytest.mark.slow),
])
def test_benchmark_reports_its_ratios_as_json(script: str, arguments: list[str],
                                              keys: tuple[str, ...]) -> None:
    result = run_command([sys.executable, str(BENCH / script), "--json", *arguments],
                         timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for key in keys:
        assert report[key] > 0, key
