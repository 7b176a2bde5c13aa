"""Shared fixtures: built models and anything expensive live for the session;
CURVE keys are made per test."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import zmq

from ops.engine_starts import ENGINE_STARTS_RECORD
from protocol.transport import CurveConfig, generate_keys
from protocol.weights import GROUP_TIMEOUT_S
from tests.ports import xdist_share

T = TypeVar("T")

#: The environment the session began with. vLLM's CPU platform edits
#: ``os.environ`` when an engine starts in this process (``LD_PRELOAD`` of
#: torch's libgomp, which switches vLLM's thread binding to GOMP's, thread
#: and cache settings); a user's shell never has them, so no process a test
#: starts may inherit them.
SESSION_ENVIRONMENT = dict(os.environ)


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    """A ZeroMQ context for the test's own sockets, destroyed (linger 0) after it."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(autouse=True)
def environment_of_the_session() -> None:
    """Every test starts from the session's environment. Function-scoped, it
    is set up after the session and module fixtures, the engines among them."""
    os.environ.clear()
    os.environ.update(SESSION_ENVIRONMENT)


#: Session fixtures that start a vLLM engine: every test that uses one runs on
#: the same xdist worker, so that each engine starts once per suite.
SESSION_ENGINES = frozenset({"tiny_llm_float32", "actor_engine", "live_engine",
                             "engine_loop"})


#: Seconds this machine took for a fixed pure-Python loop (the best of three,
#: timed before any test starts): machines of one kind differ in speed, and
#: the suite's times can only be compared between logs that print this.
REFERENCE_LOOP_STEPS = 1_000_000
MACHINE_REFERENCE_S: list[float] = []


def _reference_loop_s() -> float:
    began = time.perf_counter()
    total = 0
    for step in range(REFERENCE_LOOP_STEPS):
        total += step * step
    return time.perf_counter() - began


#: The file every engine start of this pass appends to (ops/engine_starts.py),
#: made by the controller (or a run without workers) and inherited by every
#: process the pass starts.
ENGINE_STARTS: list[Path] = []


def engine_starts() -> int:
    """The vLLM engines this pass has started, in every process."""
    return len(ENGINE_STARTS[0].read_text().splitlines()) if ENGINE_STARTS else 0


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n N`` each worker runs on its own share of the cores
    (inherited by every process its tests start, and followed by ``up``'s and
    vLLM's own placement, which read the affinity): two workers on two cores
    then never run four engines and learners on one core while the other idles.
    The controller (or a run without workers) times the reference loop first."""
    share = xdist_share()
    if share is None and not MACHINE_REFERENCE_S:
        MACHINE_REFERENCE_S.append(min(_reference_loop_s() for _ in range(3)))
    if share is None and not ENGINE_STARTS:
        handle, path = tempfile.mkstemp(prefix="compactionrl-engine-starts-")
        os.close(handle)
        ENGINE_STARTS.append(Path(path))
        # In the environment every test starts from, too: without workers the
        # session's environment was taken before this hook ran.
        os.environ[ENGINE_STARTS_RECORD] = SESSION_ENVIRONMENT[ENGINE_STARTS_RECORD] = path
    cores = sorted(os.sched_getaffinity(0))
    if share is not None and share[1] <= len(cores):
        worker, workers = share
        own = cores[worker::workers]
        os.sched_setaffinity(0, own)
        # torch sized its OpenMP pool from the affinity when this file's imports
        # imported it: two threads on one core make every parallel kernel wait for
        # a descheduled thread (the tiny model's PPO step measured 30 times slower).
        torch.set_num_threads(len(own))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """xdist's unit of work (``--dist loadgroup``): a module, whose module
    fixtures (a whole ``up`` run, torchrun launches) must not start on both
    workers; the tests that share a session engine, across modules; and the
    single test, in a module marked ``independent``."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        if SESSION_ENGINES.intersection(getattr(item, "fixturenames", ())):
            group = "session-engines"
        elif item.get_closest_marker("independent") is not None:
            continue
        else:
            group = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=_start_rank)


def _start_rank(item: pytest.Item) -> int:
    """Where an item's work starts (a stable sort keeps the order within a
    rank; ``make test`` passes ``--no-loadscope-reorder`` so xdist hands out
    groups in this order): the long groups first, the session engines' group
    (a dozen engine tests in a row) before all, the many short unit tests
    (those marked neither ``slow`` nor ``trains``) last, where they fill whichever worker is
    done first. Otherwise a two-minute module handed out last keeps one
    worker busy while the other idles."""
    if SESSION_ENGINES.intersection(getattr(item, "fixturenames", ())):
        return 0
    short = (item.nodeid.startswith("tests/unit/") and item.get_closest_marker("slow") is None
             and item.get_closest_marker("trains") is None)
    return 2 if short else 1


#: Seconds each xdist worker spent in tests (setup, call and teardown), read
#: by the controller from its workers' reports.
WORKER_BUSY_S: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    worker = getattr(report, "node", None)  # set on the controller's copy of a worker's report
    if worker is not None:
        WORKER_BUSY_S[worker.gateway.id] += report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The run's wall time is its busiest worker's: a log shows how even they were."""
    if WORKER_BUSY_S:
        terminalreporter.write_line("seconds each xdist worker spent in tests: " + ", ".join(
            f"{worker} {seconds:.0f}" for worker, seconds in sorted(WORKER_BUSY_S.items())))
    if MACHINE_REFERENCE_S:
        terminalreporter.write_line(
            f"machine reference: {REFERENCE_LOOP_STEPS:,} steps of a pure-Python loop took "
            f"{MACHINE_REFERENCE_S[0]:.3f} s before the first test (to compare this "
            "machine's speed with another log's)")
    if ENGINE_STARTS:
        allowed = terminalreporter.config.getoption("max_engines")
        terminalreporter.write_line(f"vLLM engines this pass started: {engine_starts()}"
                                    + ("" if allowed is None else f" (at most {allowed})"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A pass allowed fewer engines than it started fails (``make check``:
    none), whatever its tests said."""
    allowed = session.config.getoption("max_engines")
    if ENGINE_STARTS and allowed is not None and engine_starts() > allowed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    if ENGINE_STARTS:
        ENGINE_STARTS.pop().unlink(missing_ok=True)


# optional: a run without xdist (``-p no:xdist``) has no such hook
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """xdist's workers tell its scheduler an item's group by a suffix of the
    node id. On a pytest where that suffix does not take
    (pytest-dev/pytest-xdist#1386) every group would be spread silently, and
    each module fixture start on both workers: the run stops instead."""
    if node.config.getvalue("dist") == "loadgroup" and not any("@" in id_ for id_ in ids):
        pytest.exit(f"xdist's --dist loadgroup does not take on pytest {pytest.__version__} "
                    "(no test id has its group; pytest-dev/pytest-xdist#1386): install "
                    "the pytest that pyproject.toml pins", returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--max-engines", type=int, default=None,
                     help="fail the pass if it started more vLLM engines than this "
                          "(make check: 0)")
    parser.addoption("--soak-seconds", type=float, default=0.0,
                     help="run the fault suite's soak cases for this long (default: the "
                          "fast variants, tens of seconds)")


@pytest.fixture
def soak_seconds(request: pytest.FixtureRequest) -> float:
    """``--soak-seconds`` (0 unless asked for)."""
    return request.config.getoption("--soak-seconds")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder of the test's in ``/tmp``, for a ``TMPDIR`` whose socket paths
    fit a Unix socket's 107 characters (pytest's own ``tmp_path`` is too deep)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="crl-test-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


class LoopThread:
    """An asyncio loop in a thread, so that one async engine can serve many
    tests (an ``AsyncLLM`` is bound to the loop it first ran on)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, built once per test session."""
    from starting_points.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    """The tiny model's tokenizer, one per test module."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


#: A model of Qwen2's architecture and proportions at ~20M parameters (tied
#: embeddings, grouped KV heads, an MLP 2.7 times as wide as the model), for
#: the learner's tests at more than the tiny model's scale.
QWEN2_20M = {"vocab_size": 32_768, "hidden_size": 384, "intermediate_size": 1024,
             "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 2,
             "tie_word_embeddings": True}


@pytest.fixture(scope="session")
def qwen2_20m_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ~20M model with random weights, as a folder of weights and config
    (what the learner loads), built once per test session."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("qwen2-20m")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN2_20M)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llm_float32(tiny_model_dir: Path):
    """An offline vLLM engine (CPU build, float32) on the tiny model; shut
    down at the end of the session, engine processes included."""
    from actors.config import EngineConfig
    from actors.engine import engine_kwargs, engine_process_started, quiet_vllm_logging

    quiet_vllm_logging()
    from vllm import LLM

    config = EngineConfig(dtype="float32")
    with engine_process_started(config):
        llm = LLM(**engine_kwargs(str(tiny_model_dir), config))
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def engine_loop() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def actor_engine(tiny_model_dir: Path, engine_loop: LoopThread):
    """The actors' async engine (bfloat16, as configured by default) on the
    tiny model, for the whole session; run coroutines with ``engine_loop.run``."""
    from actors.config import ActorConfig
    from actors.engine import Engine, quiet_vllm_logging

    quiet_vllm_logging()

    config = ActorConfig()
    engine = engine_loop.run(Engine.start(str(tiny_model_dir), config.engine, config.sampling))
    yield engine
    engine_loop.run(engine.shutdown())


@pytest.fixture(scope="session")
def live_engine(tiny_model_dir: Path, engine_loop: LoopThread):
    """An async engine on the tiny model in float32 that receives weights
    (``weight_transfer``), for the session: the tests of weight updates share
    it. Each user pushes the weights it measures against first, in a group
    of its own, and sets versions relative to ``live_engine.version`` or
    after such a push: the engine holds whatever its last user left."""
    from actors.config import ActorConfig, EngineConfig
    from actors.engine import Engine, quiet_vllm_logging

    quiet_vllm_logging()
    engine = engine_loop.run(Engine.start(str(tiny_model_dir), EngineConfig(dtype="float32"),
                                          ActorConfig().sampling, weight_timeout_s=GROUP_TIMEOUT_S))
    yield engine
    engine_loop.run(engine.shutdown())


@pytest.fixture
def curve(tmp_path: Path) -> tuple[CurveConfig, Path]:
    """Server and one authorized client key pair, plus an intruder's pair that
    is not in the authorized folder."""
    generate_keys(tmp_path, ["server", "client-0"])
    intruder = tmp_path / "intruder"
    generate_keys(intruder, ["client-x"])
    return CurveConfig(
        enabled=True,
        server_secret_key=str(tmp_path / "server.key_secret"),
        server_public_key=str(tmp_path / "server.key"),
        client_secret_key=str(tmp_path / "client-0.key_secret"),
        authorized_keys_dir=str(tmp_path / "authorized"),
    ), intruder / "client-x.key_secret"
