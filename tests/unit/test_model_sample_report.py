"""``compactionrl model sample`` without ``--json``: the report a reader gets
(deploy/sample.py). The engine run itself, with ``--check``, is
tests/integration/test_vllm_tiny_model.py's."""

from __future__ import annotations

import pytest

from deploy.sample import print_report

REPORT = {"model": "m", "dtype": "bfloat16", "engine_start_s": 12.34, "prompt_tokens": 20,
          "completion": "ok", "completion_tokens": [1, 2], "logprobs": [-0.5, -1.25],
          "generated_tokens_per_s": 88.0}


def test_the_text_report_says_the_start_the_tokens_and_the_check(
        capsys: pytest.CaptureFixture[str]) -> None:
    checked = REPORT | {"check": {"max_logprob_error": 0.002, "tolerance": 0.05,
                                  "greedy_mismatches": 0, "ok": True}}
    print_report(checked, "bfloat16", "4 x 32")
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "engine started in 12.3 s (bfloat16); prompt 20 tokens",
        "completion: 'ok'",
        "first tokens: [1, 2]",
        "log-probs:    [-0.5, -1.25]",
        "4 x 32 tokens at 88.0 tokens/s",
        "vs transformers: max |d log p| = 2.00e-03 (tolerance 0.05), greedy mismatches "
        "beyond ties: 0 -> OK"]
    print_report(REPORT, "bfloat16", "4 x 32")
    assert "vs transformers" not in capsys.readouterr().out  # no --check, no line
