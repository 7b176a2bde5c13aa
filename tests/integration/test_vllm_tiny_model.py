"""The tiny model in the real vLLM CPU build agrees with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deploy.model_check import BF16_LOGPROB_TOLERANCE, compare
from deploy.sample import FLOAT32_LOGPROB_TOLERANCE
from tests.processes import compactionrl

pytestmark = pytest.mark.slow

PROMPTS = [[5, 100, 200, 300], list(range(10, 200)), [7] * 40]


def test_greedy_tokens_and_logprobs_match_transformers(tiny_model_dir: Path,
                                                       tiny_llm_float32) -> None:
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0, ignore_eos=True)
    outputs = tiny_llm_float32.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                        use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        completion = list(output.outputs[0].token_ids)
        assert len(completion) == 24
        logprobs = [output.outputs[0].logprobs[i][t].logprob for i, t in enumerate(completion)]
        agreement = compare(reference, prompt, completion, logprobs,
                            FLOAT32_LOGPROB_TOLERANCE, temperature=0.0)
        # Every engine token is the reference's argmax given the tokens before
        # it, up to ties within the tolerance: where two logits lie that close,
        # which one wins depends on the kernels' summation order (vLLM's and
        # transformers' differ, and vary by CPU), so comparing whole greedy
        # sequences token for token could fail on a tie and diverge after it.
        assert agreement.greedy_mismatches == 0
        assert agreement.max_logprob_error <= FLOAT32_LOGPROB_TOLERANCE


def test_sampled_logprobs_are_of_the_tempered_distribution(tiny_model_dir: Path,
                                                          tiny_llm_float32) -> None:
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = SamplingParams(temperature=0.7, max_tokens=24, logprobs=0, seed=3)
    [output] = tiny_llm_float32.generate([{"prompt_token_ids": PROMPTS[1]}], params,
                                         use_tqdm=False)
    completion = list(output.outputs[0].token_ids)
    logprobs = [output.outputs[0].logprobs[i][t].logprob for i, t in enumerate(completion)]
    agreement = compare(reference, PROMPTS[1], completion, logprobs, FLOAT32_LOGPROB_TOLERANCE,
                        temperature=0.7)
    assert agreement.max_logprob_error <= FLOAT32_LOGPROB_TOLERANCE


def test_model_sample_check_in_bfloat16(tiny_model_dir: Path) -> None:
    result = compactionrl("model", "sample", "--model", str(tiny_model_dir), "--check",
                          "--json", "--num-prompts", "4", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["dtype"] == "bfloat16"
    assert report["check"]["ok"]
    assert 0 < report["check"]["max_logprob_error"] <= BF16_LOGPROB_TOLERANCE
