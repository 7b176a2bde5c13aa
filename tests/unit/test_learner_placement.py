"""Where the learner computes: the backend and device follow learner.device;
on a GPU an engine shares, the rank caps its memory at its share."""

from __future__ import annotations

import pytest
import torch

from learner.models import memory_cap, placement


def test_auto_without_cuda_is_gloo_on_the_cpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: auto picks NCCL")
    assert placement("auto") == ("gloo", torch.device("cpu"))


def test_cpu_is_gloo_even_where_cuda_exists() -> None:
    assert placement("cpu") == ("gloo", torch.device("cpu"))


def test_only_a_rank_whose_gpu_an_engine_shares_caps_its_memory() -> None:
    assert memory_cap(0, "0", 0.6) == 0.6
    assert memory_cap(1, "0,2", 0.6) is None and memory_cap(2, "0,2", 0.6) == 0.6
    assert memory_cap(0, "", 0.6) is None  # no co-location: no cap
