"""Shared fixtures: built models and anything expensive live for the session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, built once per test session."""
    from deploy.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_llm_float32(tiny_model_dir: Path):
    """An offline vLLM engine (CPU build, float32) on the tiny model; shut
    down at the end of the session, engine processes included."""
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM

    from actors.config import EngineConfig
    from actors.engine import engine_kwargs

    llm = LLM(**engine_kwargs(str(tiny_model_dir), EngineConfig(dtype="float32")))
    yield llm
    llm.llm_engine.engine_core.shutdown()
