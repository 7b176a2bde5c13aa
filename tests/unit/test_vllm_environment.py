"""vLLM's own writes to the environment of its engine and its workers keep
off every name the project starts those processes with, or relies on.

vLLM's GPU worker removes ``NCCL_ASYNC_ERROR_HANDLING`` in
``Worker.init_device``. The project once required that name in every
process that joins an NCCL weight group, so on a GPU no engine could join
one, and nothing noticed: the suite runs vLLM's CPU worker, which never runs
that line. These tests read the installed vLLM's source instead
(tests/environ_writes.py), so a write in a branch that runs only on a GPU is
checked on any machine, and a vLLM upgrade that writes one of the project's
names fails here.

Read (paths in the installed ``vllm`` package, found with
``importlib.util.find_spec``):

- the workers: ``v1/worker/gpu_worker.py``, ``cpu_worker.py`` (its worker
  derives from the GPU worker's) and ``worker_base.py``;
- the executors: ``v1/executor/uniproc_executor.py`` (the project's on CPU
  with one worker, actors/engine.py ``executor_backend``) and
  ``multiproc_executor.py`` (vLLM's own choice elsewhere);
- the engine core, ``v1/engine/core.py``, and ``core_client.py``, which
  starts its process;
- what those call that writes the environment of the engine or a worker:
  ``v1/engine/utils.py`` (the engine core's start: ``launch_core_engines``,
  ``_configure_uniproc_startup_threads``), ``utils/system_utils.py``
  (``_maybe_force_spawn`` through ``get_mp_context``, and the helpers
  ``update_environment_variables`` and ``set_env_var``),
  ``utils/ompmultiprocessing.py`` (a CPU worker's OpenMP settings),
  ``utils/numa_utils.py`` (``configure_subprocess``),
  ``v1/executor/vllm_net_devices.py`` (``set_worker_net_device``), and,
  from the GPU worker's ``init_worker_distributed_environment``,
  ``distributed/eplb/eplb_utils.py`` (``override_envs_for_eplb``) and
  ``model_executor/determinism/batch_invariant.py``
  (``init_batch_invariance``), with ``utils/nccl.py`` (``pin_nccl_env``)
  that the latter calls;
- ``env_override.py``, which every process that imports vLLM runs.

Not read: the platforms (``platforms/cpu.py`` sets ``LD_PRELOAD``, thread
settings and ``VLLM_WORKER_MULTIPROC_METHOD`` while the engine's
configuration is built, reached through ``current_platform``, not a function
the modules above call), the configuration classes (``config/``),
``envs.py``'s generated defaults, Ray's executors and utilities (the project
never runs Ray), other platforms' workers, the model, kernel and compilation
modules, any write through a function outside the files above that is not
one of tests/environ_writes.py's ``HELPERS``, and what C code (torch, NCCL)
sets.
"""

from __future__ import annotations

import importlib.util
import re
import textwrap
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path

import pytest

from actors.config import EngineConfig
from actors.engine import engine_environment, engine_process_env
from protocol.weights_collective import (
    NCCL_MEMBER_REQUIRED,
    VLLM_GPU_WORKER_REMOVES,
    start_environments,
)
from tests.environ_writes import EVERY_NAME, EnvironmentWrite, environment_writes


def _site() -> Path:
    """Where the installed ``vllm`` package is (the folder that holds it):
    found, not imported."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vLLM is not installed"
    return Path(spec.origin).parents[1]


#: The folder that holds the installed ``vllm``: files are named relative to it.
SITE = _site()
GPU_WORKER = "vllm/v1/worker/gpu_worker.py"
#: What is read, relative to :data:`SITE` (the module's docstring says why).
COVERED = (
    GPU_WORKER,
    "vllm/v1/worker/cpu_worker.py",
    "vllm/v1/worker/worker_base.py",
    "vllm/v1/executor/uniproc_executor.py",
    "vllm/v1/executor/multiproc_executor.py",
    "vllm/v1/engine/core.py",
    "vllm/v1/engine/core_client.py",
    "vllm/v1/engine/utils.py",
    "vllm/utils/system_utils.py",
    "vllm/utils/ompmultiprocessing.py",
    "vllm/utils/numa_utils.py",
    "vllm/v1/executor/vllm_net_devices.py",
    "vllm/distributed/eplb/eplb_utils.py",
    "vllm/model_executor/determinism/batch_invariant.py",
    "vllm/utils/nccl.py",
    "vllm/env_override.py",
)
#: How a write takes a variable away.
REMOVING = frozenset({"pop", "delete", "unsetenv", "popitem", "clear"})
#: Any deadline: which names the project sets does not depend on it.
WEIGHT_TIMEOUT_S = 120.0
#: Writes that may change a name the project sets or relies on (or one the
#: lister cannot name), each read and found harmless: (file, name) -> why.
ALLOWED: dict[tuple[str, str], str] = {
    ("vllm/v1/executor/multiproc_executor.py", "OMP_NUM_THREADS"):
        "set_multiprocessing_worker_envs returns before it on CPU and wherever "
        "OMP_NUM_THREADS is set already; the project sets it only for an engine on CPU "
        "(engine_process_env), where both hold",
    ("vllm/v1/engine/utils.py", "OMP_NUM_THREADS"):
        "_configure_uniproc_startup_threads sets it (until the engine core has started) "
        "only for UniProcExecutor off CPU, and only where it is unset; the project sets it "
        "only for an engine on CPU",
    ("vllm/utils/ompmultiprocessing.py", "OMP_NUM_THREADS"):
        "configure_omp_envs runs only in MultiprocExecutor, around each CPU worker's start; "
        "the project sets OMP_* only where the engine runs UniProcExecutor "
        "(engine_process_env is empty otherwise), so never in a process that starts one",
    ("vllm/utils/ompmultiprocessing.py", "OMP_PLACES"):
        "as OMP_NUM_THREADS there: only around MultiprocExecutor's CPU workers' start",
    ("vllm/utils/ompmultiprocessing.py", "OMP_PROC_BIND"):
        "as OMP_NUM_THREADS there: only around MultiprocExecutor's CPU workers' start",
    ("vllm/v1/worker/worker_base.py", "?envs"):
        "WorkerWrapperBase.update_environment_variables applies what only Ray's executor "
        "sends (collective_rpc); the project never runs Ray",
    ("vllm/utils/system_utils.py", "?k"):
        "update_environment_variables' body: its callers' names are listed where they "
        "call it (worker_base's ?envs)",
    ("vllm/utils/system_utils.py", "?key"):
        "set_env_var's body: its callers' names are listed where they call it "
        "(v1/engine/utils.py's OMP_NUM_THREADS)",
    ("vllm/v1/executor/vllm_net_devices.py", "?var_name"):
        "the names listed in VLLM_NIC_SELECTION_VARS; set_worker_net_device returns "
        "before unless it and VLLM_GPU_NIC_PCIE_MAPPING are set, which the project never does",
    ("vllm/utils/nccl.py", "?name"):
        "_swap_env's body: the pins pin_nccl_env is given, listed where it is called "
        "(batch_invariant's NCCL_* pins), and their restoring around unpinned_nccl_env",
}


@cache
def vllm_writes() -> tuple[EnvironmentWrite, ...]:
    """Every environment write of the files read (:data:`COVERED`)."""
    return tuple(write for file in COVERED for write in environment_writes(SITE / file, SITE))


def relied_on(started: Iterable[str], required: Mapping[tuple[str, ...], str]) -> set[str]:
    """The names of each ``required`` setting (names in torch's order of
    precedence) that torch may take its value from in a process started
    with ``started``: torch takes the first name set, so those up to the
    first the project sets, and all where it sets none. A later name (the
    legacy ``NCCL_ASYNC_ERROR_HANDLING`` behind its ``TORCH_`` one) is never
    read there, whoever writes it."""
    started = set(started)
    names: set[str] = set()
    for precedence in required:
        first = next((at for at, name in enumerate(precedence) if name in started),
                     len(precedence) - 1)
        names |= set(precedence[:first + 1])
    return names


def clashes(writes: Iterable[EnvironmentWrite], names: set[str]) -> list[EnvironmentWrite]:
    """The ``writes`` that may change one of ``names``: of such a name, of
    every name, or of one the lister could not name."""
    return [write for write in writes
            if write.name in names or write.name == EVERY_NAME or write.name.startswith("?")]


@pytest.fixture
def project_names(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Every name the project starts the learner's ranks, an engine or its
    engine-core process with, and those of the settings a weight group
    requires that torch may read there."""
    # A setting the project yields to where the caller made one is left
    # out of engine_environment's answer: with none made, every name is in it.
    for name in ("VLLM_RPC_BASE_PATH", "OMP_WAIT_POLICY", "TORCH_COMPILE_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    environments = start_environments(WEIGHT_TIMEOUT_S)
    started = {*environments.learner, *environments.engine,
               *engine_environment(EngineConfig(), True, WEIGHT_TIMEOUT_S),
               *engine_environment(EngineConfig(), False, WEIGHT_TIMEOUT_S),
               *engine_process_env(EngineConfig(cpu_threads_bind="0-1"), True)}
    return started | relied_on(started, NCCL_MEMBER_REQUIRED)


def test_the_gpu_worker_removes_exactly_what_the_project_expects_it_to() -> None:
    removed = {write.name for write in environment_writes(SITE / GPU_WORKER, SITE)
               if write.scope == "Worker.init_device" and write.how in REMOVING}
    assert removed == set(VLLM_GPU_WORKER_REMOVES), (
        f"vLLM's Worker.init_device now removes {sorted(removed)}: update "
        "protocol.weights_collective.VLLM_GPU_WORKER_REMOVES, and check that no weight "
        "group relies on a name it removes")


def test_vllm_writes_no_name_the_project_sets_or_relies_on(project_names: set[str]) -> None:
    unexplained = [write for write in clashes(vllm_writes(), project_names)
                   if (write.file, write.name) not in ALLOWED]
    assert not unexplained, (
        "vLLM writes names the project sets or relies on (tests/environ_writes.py):\n"
        + "\n".join(map(str, unexplained)))
    # The project must neither set nor rely on a name the GPU worker removes:
    # no reason makes such a clash harmless.
    assert not {name for _, name in ALLOWED} & set(VLLM_GPU_WORKER_REMOVES)


def test_every_allowed_clash_still_happens(project_names: set[str]) -> None:
    found = {(write.file, write.name) for write in clashes(vllm_writes(), project_names)}
    assert set(ALLOWED) <= found, f"no longer written, drop from ALLOWED: {set(ALLOWED) - found}"


def test_the_listing_finds_the_gpu_worker_s_removals_on_their_lines() -> None:
    assert vllm_writes()
    source = (SITE / GPU_WORKER).read_text().splitlines()
    for name in VLLM_GPU_WORKER_REMOVES:
        mentioned = re.compile(rf"""environ\b.*["']{name}["']""")
        lines = {number for number, text in enumerate(source, 1) if mentioned.search(text)}
        listed = {write.line for write in vllm_writes()
                  if write.file == GPU_WORKER and write.name == name and write.how in REMOVING}
        assert lines and listed == lines, (name, lines, listed)


#: Source snippets (a module of ``IMPORTED = "FROM_ELSEWHERE"`` beside them)
#: and the (name, how) of each write they hold, in order.
SNIPPETS = {
    "a subscript": ("""
        import os
        os.environ["A"] = "1"
        os.environ["B"] += ":x"
        os.environ["C"], x = "1", 2
        """, [("A", "set"), ("B", "set"), ("C", "set")]),
    "del": ("""
        import os
        del os.environ["A"], os.environ["B"]
        """, [("A", "delete"), ("B", "delete")]),
    "pop and setdefault": ("""
        import os
        os.environ.pop("A", None)
        os.environ.setdefault("B", "1")
        """, [("A", "pop"), ("B", "default")]),
    "update": ("""
        import os
        os.environ.update({"A": "1", **more}, B="2")
        os.environ |= {"C": "3"}
        """, [("A", "update"), ("?{**more}", "update"), ("B", "update"), ("C", "update")]),
    "putenv and unsetenv": ("""
        import os
        from os import unsetenv as drop
        os.putenv("A", "1")
        drop("B")
        """, [("A", "putenv"), ("B", "unsetenv")]),
    "aliases of os and environ": ("""
        import os as system
        from os import environ as env
        system.environ["A"] = "1"
        env.pop("B")
        """, [("A", "set"), ("B", "pop")]),
    "vLLM's helpers": ("""
        from vllm.utils import system_utils
        from vllm.utils.nccl import pin_nccl_env
        from vllm.utils.system_utils import set_env_var
        with set_env_var("A", "1"):
            system_utils.update_environment_variables({"B": "2"})
        pin_nccl_env({"C": "3"})
        """, [("A", "set-temporarily"), ("B", "update"), ("C", "pin")]),
    "clear": ("""
        import os
        os.environ.clear()
        """, [(EVERY_NAME, "clear")]),
    "module constants": ("""
        import os
        from names import IMPORTED
        A = "LOCAL"
        def f():
            os.environ[A] = "1"
            os.environ[IMPORTED] = "2"
        """, [("LOCAL", "set"), ("FROM_ELSEWHERE", "set")]),
    "a dict the function builds": ("""
        import os
        def f(on):
            settings = {"A": "1"}
            if on:
                settings["B"] = "2"
            for name, value in settings.items():
                os.environ[name] = value
        """, [("A", "set"), ("B", "set")]),
    "unresolvable names": ("""
        import os
        A = "LOCAL"
        def f(given, A):
            os.environ[given] = "1"
            os.environ[f"X_{given}"] = "1"
            os.environ[A] = "1"
            for name in given:
                os.environ.pop(name)
        """, [("?given", "set"), ("?f'X_{given}'", "set"), ("?A", "set"), ("?name", "pop")]),
    "reads": ("""
        import os
        x = os.environ["A"]
        y = os.environ.get("B")
        z = "C" in os.environ
        os.getenv("D")
        """, []),
}


@pytest.mark.parametrize("form", SNIPPETS)
def test_the_lister_names_each_write_and_how(form: str, tmp_path: Path) -> None:
    source, expected = SNIPPETS[form]
    (tmp_path / "names.py").write_text('IMPORTED = "FROM_ELSEWHERE"\n')
    (tmp_path / "snippet.py").write_text(textwrap.dedent(source))
    found = environment_writes(tmp_path / "snippet.py", tmp_path)
    assert [(write.name, write.how) for write in found] == expected
    assert all(write.file == "snippet.py" for write in found)


def test_a_write_is_placed_at_its_line_and_in_its_function(tmp_path: Path) -> None:
    (tmp_path / "snippet.py").write_text(
        'import os\nclass Worker:\n    def init_device(self):\n        os.environ.pop("A", None)\n')
    assert environment_writes(tmp_path / "snippet.py", tmp_path) == [
        EnvironmentWrite("snippet.py", 4, "A", "pop", "Worker.init_device")]
