"""Where vLLM runs an actor's model, and the cores it binds there
(actors/engine.py: ``executor_backend``, ``engine_process_env``). The fault
run checks the binding on real engines
(tests/faults/test_up_faults.py: phase 0)."""

from __future__ import annotations

import os

import pytest

from actors.config import EngineConfig
from actors.engine import engine_process_env, engine_process_started, executor_backend


def test_on_cpu_one_worker_runs_in_the_engine_core_and_more_are_vllm_s_choice() -> None:
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    assert executor_backend(EngineConfig(), on_cpu=True) is UniProcExecutor
    assert executor_backend(EngineConfig(tensor_parallel=2), on_cpu=True) is None
    assert executor_backend(EngineConfig(), on_cpu=False) is None


def test_a_list_of_cores_binds_the_engine_process_and_auto_or_nobind_leave_it_free() -> None:
    assert engine_process_env(EngineConfig(cpu_threads_bind="0-1,3"), on_cpu=True) == {
        "OMP_NUM_THREADS": "3", "OMP_PROC_BIND": "true", "OMP_PLACES": "{0,1,3}"}
    for free in ("auto", "nobind"):
        assert engine_process_env(EngineConfig(cpu_threads_bind=free), on_cpu=True) == {}
    # vLLM binds each worker of a tensor-parallel engine itself, and GPUs bind nothing
    assert engine_process_env(EngineConfig(tensor_parallel=2, cpu_threads_bind="0|1"),
                              on_cpu=True) == {}
    assert engine_process_env(EngineConfig(cpu_threads_bind="2"), on_cpu=False) == {}


def test_the_binding_is_set_only_while_the_engine_starts(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("OMP_PLACES", raising=False)
    with engine_process_started(EngineConfig(cpu_threads_bind="1")):
        assert (os.environ["OMP_NUM_THREADS"], os.environ["OMP_PLACES"]) == ("1", "{1}")
    assert os.environ["OMP_NUM_THREADS"] == "7" and "OMP_PLACES" not in os.environ
