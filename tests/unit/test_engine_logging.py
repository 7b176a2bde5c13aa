"""vLLM's per-tensor dtype warning: dropped for the configured cast (a
float32 export into a 16-bit engine), kept for every other mismatch, and
installed in every vLLM process through the plugin entry point."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import pytest
import torch

from actors.engine import (
    CAST_WARNING,
    VLLM_WEIGHT_LOADER_LOGGER,
    ExpectedCastFilter,
    quiet_expected_casts,
)


def _record(stored: torch.dtype, engine: torch.dtype) -> logging.LogRecord:
    return logging.LogRecord(VLLM_WEIGHT_LOADER_LOGGER, logging.WARNING, __file__, 1,
                             CAST_WARNING, ("model.embed_tokens.weight", stored, engine), None)


@pytest.mark.parametrize("stored, engine, shown", [
    (torch.float32, torch.bfloat16, False),
    (torch.float32, torch.float16, False),
    (torch.float16, torch.bfloat16, True),  # a lossy cast nobody configured
    (torch.bfloat16, torch.float16, True),
])
def test_only_the_configured_cast_is_quiet(stored: torch.dtype, engine: torch.dtype,
                                          shown: bool) -> None:
    assert ExpectedCastFilter().filter(_record(stored, engine)) is shown


def test_other_warnings_of_the_loader_are_kept() -> None:
    other = logging.LogRecord(VLLM_WEIGHT_LOADER_LOGGER, logging.WARNING, __file__, 1,
                              "Ignoring weight %s", ("lm_head.bias",), None)
    assert ExpectedCastFilter().filter(other)


def test_the_plugin_installs_the_filter_once_and_is_registered_with_vllm() -> None:
    logger = logging.getLogger(VLLM_WEIGHT_LOADER_LOGGER)
    quiet_expected_casts()
    quiet_expected_casts()
    assert sum(isinstance(f, ExpectedCastFilter) for f in logger.filters) == 1
    plugins = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "actors.engine:quiet_expected_casts" in plugins
