"""How many vLLM engines started, counted where each starts: a
``vllm.general_plugins`` entry point (pyproject) runs in every vLLM process,
and an engine's core is the process multiprocessing names ``EngineCore``
(``EngineCore_DP<n>`` with data parallelism: vllm/v1/engine/utils.py). Where
:data:`ENGINE_STARTS_RECORD` names a file, each core appends its pid to it,
whoever started the engine (an actor, a test, ``compactionrl model
sample``): the suite counts its engines so (tests/conftest.py)."""

from __future__ import annotations

import multiprocessing
import os

#: The environment variable naming the file each engine start appends a line to.
ENGINE_STARTS_RECORD = "COMPACTIONRL_ENGINE_STARTS"
#: What multiprocessing names an engine's core process (its prefix).
ENGINE_CORE_PROCESS = "EngineCore"


def record_engine_start() -> None:
    """The plugin: in an engine's core process, one line for its start (one
    short append, atomic beside other processes' with ``O_APPEND``)."""
    record = os.environ.get(ENGINE_STARTS_RECORD)
    if record and multiprocessing.current_process().name.startswith(ENGINE_CORE_PROCESS):
        with open(record, "a") as starts:
            starts.write(f"{os.getpid()}\n")
