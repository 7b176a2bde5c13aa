"""Where the learner computes: the backend and device follow learner.device."""

from __future__ import annotations

import pytest
import torch

from learner.models import placement


def test_auto_without_cuda_is_gloo_on_the_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: auto picks NCCL")
    assert placement("auto") == ("gloo", torch.device("cpu"))


def test_cpu_is_gloo_even_where_cuda_exists() -> None:
    assert placement("cpu") == ("gloo", torch.device("cpu"))
