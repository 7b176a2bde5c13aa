"""The suite counts the vLLM engines it starts where each one's core
process starts (ops/engine_starts.py), whoever started it: the plugin is
registered with vLLM, and the process name it looks for is the installed
vLLM's."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import multiprocessing
import re
from pathlib import Path

import pytest

from ops.engine_starts import ENGINE_CORE_PROCESS, ENGINE_STARTS_RECORD, record_engine_start


def test_vllm_names_an_engine_s_core_process_as_the_count_expects() -> None:
    spec = importlib.util.find_spec("vllm.v1.engine.utils")
    assert spec is not None and spec.origin is not None
    names = re.findall(r'name=f?"(EngineCore[^"{]*)', Path(spec.origin).read_text())
    assert names and all(name.startswith(ENGINE_CORE_PROCESS) for name in names), names


def test_the_count_is_a_vllm_plugin() -> None:
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(p.value == "ops.engine_starts:record_engine_start" for p in plugins)


def test_only_an_engine_s_core_process_records_its_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "starts"
    monkeypatch.setenv(ENGINE_STARTS_RECORD, str(record))
    record_engine_start()  # this process: not an engine's core
    assert not record.exists()
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore_DP1")
    record_engine_start()
    record_engine_start()
    assert len(record.read_text().splitlines()) == 2
