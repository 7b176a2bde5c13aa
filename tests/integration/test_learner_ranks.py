"""The same batches give the same update on 1 rank and on 2 ranks (FSDP2, gloo,
torchrun), and bit for bit on 2 ranks of one node and on two nodes of one
rank each: the loss is normalised by the global token count, and whitening's
statistics are global, with a rank whose share of a minibatch is empty. The
memory switches (activation checkpointing, chunked log-probabilities, a token
budget per micro-batch) leave that update as it is, on the tiny model and on
a ~20M model of Qwen2's shape, with a critic model or a value head. Each
world size trains all its jobs in one torchrun launch."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deploy.cli import torchrun_args
from learner.batch import microbatches
from learner.config import LearnerConfig
from tests.ports import free_ports
from tests.processes import VENV_BIN, run_command
from tests.programs.ppo_ranks import CONFIG, batches
from tests.tolerances import rounding_tolerance

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[1] / "programs" / "ppo_ranks.py"
ROOT = Path(__file__).parents[2]
#: Learner steps of each run.
STEPS = 2
#: Every memory switch on. Within 100 tokens, rank 0's share of the first
#: minibatch (sequences of 52 and 27 tokens) makes 2 micro-batches and rank
#: 1's (50 and 24) one; a rank with an empty share makes none.
MEMORY = {"activation_checkpointing": "on", "logprob_chunk_tokens": 16,
          "max_tokens_per_microbatch": 100}
#: The 20M model's switches: its first step is one minibatch of all 7
#: rollouts, whose shares (26 to 52 tokens a sequence) make 2 and 3
#: micro-batches within 90 tokens (2 each within 100).
MEMORY_20M = {**MEMORY, "max_tokens_per_microbatch": 90}


@dataclass(frozen=True)
class Job:
    """One training of the test program: ``steps`` from ``model``, the
    learner settings ``changes`` over the program's ``CONFIG``."""

    model: Path
    out: Path
    steps: int = STEPS
    changes: dict[str, object] = field(default_factory=dict)


def launch(jobs: list[Job], ranks: int, nodes: int = 1) -> None:
    """Run ``jobs`` one after another in one process group of ``nodes``
    torchrun agents of ``ranks`` ranks each, started with the options
    ``compactionrl learner`` gives torchrun (two agents on this machine act
    as two nodes, their rendezvous on loopback)."""
    [port] = free_ports(1)
    listed = json.dumps([{"model": str(job.model), "out": str(job.out), "steps": job.steps,
                          "changes": job.changes} for job in jobs])
    commands = [[str(VENV_BIN / "torchrun"), *torchrun_args(LearnerConfig(
        nproc=ranks, nnodes=nodes, node_rank=node, rdzv_endpoint=f"127.0.0.1:{port}")),
        str(SCRIPT), listed] for node in range(nodes)]
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(nodes) as pool:
        results = list(pool.map(lambda command: run_command(command, timeout=600, env=env),
                                commands))
    for result in results:
        assert result.returncode == 0, result.stderr[-4000:]


#: Per (job, world size: 1, 2 or "nodes"), where the job wrote its parameters.
Trained = dict[tuple[str, int | str], Path]
#: What each world size trains (one launch each): the tiny model plain, with
#: a value head, and the 20M model in one minibatch of one epoch (two updates:
#: each of its FSDP2 passes moves the model's gradients over gloo, which on
#: one core took 5 s an update); on 2 ranks the last two with every memory
#: switch on.
JOBS = {"plain": {}, "value_head": {"critic": "value_head"},
        "20m": {"ppo_epochs": 1, "minibatches": 1}}
#: The memory switches of each job on 2 ranks.
MEMORY_OF = {"plain": {}, "value_head": MEMORY, "20m": MEMORY_20M}


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, qwen2_20m_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Trained:
    """Per (job, world size), where its parameters were written (and beside
    them its step metrics); ("plain", "nodes") is the plain job on two
    nodes of one rank each."""
    folder = tmp_path_factory.mktemp("ranks")
    outs: Trained = {}

    def jobs(world: int | str) -> list[Job]:
        listed = []
        for name, changes in JOBS.items():
            if world == "nodes" and name != "plain":
                continue
            memory = MEMORY_OF[name] if world == 2 else {}
            outs[name, world] = folder / f"{name}-{world}.safetensors"
            listed.append(Job(qwen2_20m_dir if name == "20m" else tiny_model_dir,
                              outs[name, world], changes={**changes, **memory}))
        return listed

    launch(jobs(1), ranks=1)
    launch(jobs(2), ranks=2)
    launch(jobs("nodes"), ranks=1, nodes=2)
    return outs


def assert_same_training(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                         model: Path, epochs: int = CONFIG.ppo_epochs,
                         minibatches: int = CONFIG.minibatches) -> None:
    assert got.keys() == expected.keys()
    start = load_file(model / "model.safetensors")
    # The script trains in double with SGD: each update moves a parameter by lr
    # times its gradient, clipped to a norm of max_grad_norm, which bounds every
    # element. 2 ranks sum that gradient's per-token contributions (one per
    # position of the minibatch, and one per rank) in another order; float32
    # is left only in transformers' RMSNorm and the learner's log-softmax.
    updates = positions = 0
    for batch in batches(STEPS):
        for minibatch in batch.minibatches(minibatches):
            updates += epochs
            positions = max(positions, sum(len(s.tokens) for s in batch.sequences
                                           if s.rollout in minibatch))
    tolerance = (max(CONFIG.lr, CONFIG.critic_lr) * updates
                 * rounding_tolerance(CONFIG.max_grad_norm, positions + 2))
    moved = 0
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=tolerance, msg=name)
        key = name.removeprefix("policy.")
        if key in start and not torch.equal(start[key].to(tensor.dtype), tensor):
            moved += 1
    assert moved > 0, "training changed nothing"


def test_one_rank_and_two_ranks_give_the_same_parameters(
        tiny_model_dir: Path, trained: Trained) -> None:
    assert_same_training(load_file(trained["plain", 2]), load_file(trained["plain", 1]),
                         tiny_model_dir)


def test_one_rank_and_two_ranks_report_the_same_step_statistics(
        trained: Trained) -> None:
    """Token counts summed over ranks, the gradient norm (the same on every
    rank) not: it is a square root of a sum of squares, no cancellation, so
    the two agree to float64 rounding (the gradients themselves to ~1e-13)."""
    one, two = (json.loads(trained["plain", world].with_suffix(".json").read_text())
                for world in (1, 2))
    assert [m["tokens"] for m in two] == [m["tokens"] for m in one]
    for got, expected in zip(two, one, strict=True):
        assert got["losses/policy_grad_norm"] == pytest.approx(
            expected["losses/policy_grad_norm"], rel=1e-9)


def test_two_nodes_of_one_rank_train_bit_for_bit_as_one_node_of_two(
        trained: Trained) -> None:
    """The same global ranks, on two torchrun agents with a static rendezvous
    (node 0 holding rank 0), run the same collectives in the same order."""
    nodes, two_ranks = load_file(trained["plain", "nodes"]), load_file(trained["plain", 2])
    assert nodes.keys() == two_ranks.keys()
    different = [name for name, tensor in two_ranks.items() if not torch.equal(nodes[name], tensor)]
    assert not different, different


def test_a_value_head_on_two_ranks_within_a_memory_budget_trains_as_on_one_rank(
        tiny_model_dir: Path, trained: Trained) -> None:
    """The critic as a head on the policy: one pass per micro-batch for both
    losses, the head in FSDP2's root unit."""
    one, two = load_file(trained["value_head", 1]), load_file(trained["value_head", 2])
    assert {name for name in one if "value_head" in name} == {
        "policy.value_head.weight", "policy.value_head.bias"}
    assert not any(name.startswith("critic.") for name in one)
    assert_same_training(two, one, tiny_model_dir)


def test_a_20m_qwen2_model_on_two_ranks_with_every_memory_switch_trains_as_on_one_rank_without(
        qwen2_20m_dir: Path, trained: Trained) -> None:
    """The switches at more than the tiny model's scale: six layers, a
    vocabulary of 32,768 in chunks of 16 positions. Ranks that cut their
    shares into different numbers of micro-batches (one of them into none)
    still run matching FSDP passes. Two steps of one minibatch and one epoch:
    7 rollouts, then 1."""
    minibatches = JOBS["20m"]["minibatches"]
    counts = [[len(microbatches([len(s.tokens) for s in batch.sequences if s.rollout in share],
                                MEMORY_20M["max_tokens_per_microbatch"]))
               for share in batch.assign(minibatch, 2)]
              for batch in batches(STEPS) for minibatch in batch.minibatches(minibatches)]
    assert any(min(c) > 0 and c[0] != c[1] for c in counts), counts
    assert any(min(c) == 0 for c in counts), counts
    assert_same_training(load_file(trained["20m", 2]), load_file(trained["20m", 1]),
                         qwen2_20m_dir, epochs=1, minibatches=minibatches)
