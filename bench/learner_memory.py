"""Learner memory: the peak memory and speed of one PPO step on one long
sequence, with the memory switches on against today's path (all off), and
with the critic as a value head on the policy against a critic model.

A Qwen2-architecture model of ~35M parameters (384 wide, 8 layers, GQA 6/2
heads, MLP 2048, a 32k tied vocabulary: logits against layer activations per
position in about the proportion of Qwen2.5-0.5B's) is written once; then for
each length (2k, 8k, 16k tokens) and path, a fresh process (spawned) does
what a learner rank does, on the CPU: a gloo world of one, policy and critic
loaded and sharded with FSDP2, ``PPOTrainer``, and one step (policy and
critic losses, backward, AdamW) on a batch of one sequence of that length.

- ``today``: ``activation_checkpointing = "off"``, ``logprob_chunk_tokens =
  0``, ``max_tokens_per_microbatch = 0``.
- ``switches``: checkpointing ``"on"``, log-probabilities in chunks of 1,024
  positions, micro-batches within 4,096 tokens. The budget cuts between whole
  sequences only: a batch of one sequence is never cut (one longer than the
  budget goes alone), so here the savings are the other two switches'.
- ``value_head``: the switches, and ``critic = "value_head"``: no critic
  model (its parameters, gradients and AdamW state), one pass through the
  body for both losses.

Memory, per case (MiB): ``loaded`` is the process's RSS (``VmRSS``) after
the models and the trainer are there and have taken one short step (256
tokens: AdamW's state then exists, as in a running learner, instead of being
allocated inside the measured step), and the batch is built; then the
kernel's RSS high-water mark is reset to it (``/proc/self/clear_refs``, so
that loading's transients do not count) and ``peak`` is ``ru_maxrss`` after
the step. The step's memory is ``step = peak - loaded``: activations, logits
and gradients.
``peak_vs_today_8k`` is the ratio of ``step`` (switches over today, 8k
tokens; goal <= 0.25), ``peak_rss_vs_today_8k`` that of the whole process's
``peak``. ``tokens_per_s_vs_today_8k``: the sequence's tokens over the
step's wall time, switches over today (goal >= 0.7: checkpointing runs each
layer's forward again); each row also has the step's CPU time, steadier than
wall time on a busy machine. ``value_head_*_vs_critic_model_8k``: the
value head's ``loaded``, ``step`` and tokens/s over the switches' (a critic
model). This process never imports torch: after
``vfork`` and ``exec``, a child's ``ru_maxrss`` starts at its parent's.

A case is skipped, not run, when its estimate exceeds ``MemAvailable``: the
``loaded + step`` of the same path's longest case so far, its ``step`` scaled
linearly in tokens, plus 10 %. One that runs the machine short
(``MemAvailable`` under 512 MiB) is killed and recorded as stopped: neither
swaps nor meets the OOM killer.

    python bench/learner_memory.py [--json] [--quick]

``--quick``: a ~5M model (256 wide, 2 layers, a 12k vocabulary), 1,024
tokens only (each case's process costs seconds of imports), chunks of 128, a
budget of 512: a smoke test of the same code, whose ``*_8k`` keys then
compare the 1,024-token cases (``reference_tokens``).
"""

from __future__ import annotations

import json
import multiprocessing
import resource
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from _options import BenchmarkParser  # bench/_options.py

from learner.config import LearnerConfig

if TYPE_CHECKING:  # torch stays out of this process (see above)
    from transformers import Qwen2Config

    from learner.batch import TrainBatch

MIB = 2 ** 20
MEMINFO, STATUS = "/proc/meminfo", "/proc/self/status"
#: A running case is killed when the machine has less than this available.
MIN_AVAILABLE_MIB = 512
#: Margin on a case's linear estimate before it starts.
ESTIMATE_MARGIN = 1.1
PATHS = ("today", "switches", "value_head")
HEADER = (f"{'tokens':>7}  {'path':<10} {'loaded MiB':>10} {'peak MiB':>9} {'step MiB':>9} "
          f"{'step s':>8} {'CPU s':>8} {'tokens/s':>9}")


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2 causal LM with tied embeddings."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int


@dataclass(frozen=True)
class Sizes:
    model: ModelShape
    lengths: tuple[int, ...]
    reference: int
    """The length of the ``*_8k`` keys."""
    chunk_tokens: int
    microbatch_tokens: int


FULL = Sizes(ModelShape(384, 2048, 8, 6, 2, 32_768), (2048, 8192, 16_384), 8192, 1024, 4096)
QUICK = Sizes(ModelShape(256, 1024, 2, 4, 2, 12_288), (1024,), 1024, 128, 512)


def learner_config(path: str, sizes: Sizes) -> LearnerConfig:
    if path == "today":
        return LearnerConfig(activation_checkpointing="off", logprob_chunk_tokens=0,
                             max_tokens_per_microbatch=0)
    return LearnerConfig(activation_checkpointing="on", logprob_chunk_tokens=sizes.chunk_tokens,
                         max_tokens_per_microbatch=sizes.microbatch_tokens,
                         critic="value_head" if path == "value_head" else "model")


def qwen2_config(shape: ModelShape) -> Qwen2Config:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.hidden // shape.heads,
        max_position_embeddings=32_768, tie_word_embeddings=True, initializer_range=0.02)


def build_model(folder: str, shape: ModelShape, out: Connection) -> None:
    """In a fresh process: write the model to ``folder`` (weights and
    config: all the learner loads) and send its size."""
    import torch
    from transformers import Qwen2ForCausalLM
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(shape))
    model.save_pretrained(folder, safe_serialization=True)
    out.send({"params": sum(p.numel() for p in model.parameters()),
              "torch_threads": torch.get_num_threads()})


def one_sequence_batch(tokens: int) -> TrainBatch:
    """A batch of one rollout: one final segment of ``tokens`` tokens, every
    other one trainable (ids below 100, valid for any vocabulary)."""
    from learner.batch import to_train_batch
    from protocol.messages import Batch, Rollout, StalenessStats, Stamp
    from protocol.synthetic import synthetic_segment

    segment = synthetic_segment(Stamp("bench", 0), "r0", 0, True, tokens=tokens)
    wire = Batch(sender_id="replay", incarnation=0, seq=0, sent_at=0.0, policy_version=0,
                 rollouts=[Rollout(rollout_id="r0", staleness=0, segments=[segment])],
                 staleness=StalenessStats(min=0, max=0, mean=0, p50=0, p95=0))
    return to_train_batch(wire, True)


def proc_mib(path: str, field: str) -> float:
    """A ``kB`` field of a /proc file (``/proc/meminfo``, ``/proc/self/status``), in MiB."""
    with open(path) as lines:
        for line in lines:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(f"no {field} in {path}")


#: The short step each case takes before the measured one.
WARM_UP_TOKENS = 256


def reset_peak_rss() -> bool:
    """Set the kernel's RSS high-water mark (``ru_maxrss``) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def run_case(folder: str, tokens: int, config: LearnerConfig, out: Connection) -> None:
    """In a fresh process: one learner step, as a rank of a world of one does it."""
    import gc

    import torch
    import torch.distributed as dist
    from transformers.utils.logging import disable_progress_bar

    from learner.models import load_critic, load_policy, shard
    from learner.ppo import PPOTrainer

    disable_progress_bar()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    cpu, checkpointing = torch.device("cpu"), config.activation_checkpointing
    value_head = config.critic == "value_head"
    trainer = PPOTrainer(
        shard(load_policy(folder, value_head=value_head), cpu, False, checkpointing),
        None if value_head else shard(load_critic(folder), cpu, False, checkpointing), config)
    # a running learner has taken steps before: AdamW's state exists
    trainer.step(one_sequence_batch(WARM_UP_TOKENS))
    batch = one_sequence_batch(tokens)
    gc.collect()
    loaded = proc_mib(STATUS, "VmRSS")
    reset = reset_peak_rss()
    began, cpu_began = time.perf_counter(), time.process_time()
    trainer.step(batch)
    seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu_began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB
    dist.destroy_process_group()
    out.send({"loaded_mib": round(loaded, 1), "peak_mib": round(peak, 1),
              "step_mib": round(peak - loaded, 1), "seconds": round(seconds, 3),
              "cpu_seconds": round(cpu_seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
              "peak_reset": reset})


def spawned(target: Callable[..., None], *args: object) -> tuple[dict | None, str]:
    """``target(*args, connection)`` in a fresh process: what it sends, or
    None and why not (killed when the machine runs short of memory)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(*args, send))
    process.start()
    send.close()
    while not receive.poll(0.2):
        if (left := proc_mib(MEMINFO, "MemAvailable")) < MIN_AVAILABLE_MIB:
            process.kill()
            process.join()
            return None, f"stopped: {left:.0f} MiB available left"
    try:
        result = receive.recv()
    except EOFError:  # it exited without sending
        result = None
    process.join()
    return result, "" if result else f"the process exited with {process.exitcode}, no result"


def estimate_mib(done: dict[int, dict], tokens: int) -> float | None:
    """``loaded + step`` of the same path's longest run, scaled linearly in tokens."""
    if not done:
        return None
    longest = max(done)
    row = done[longest]
    return ESTIMATE_MARGIN * (row["loaded_mib"] + row["step_mib"] * tokens / longest)


def measure(sizes: Sizes, folder: str) -> list[dict]:
    rows: list[dict] = []
    done: dict[str, dict[int, dict]] = {path: {} for path in PATHS}
    for tokens in sizes.lengths:
        for path in PATHS:
            row: dict = {"tokens": tokens, "path": path}
            need, left = estimate_mib(done[path], tokens), proc_mib(MEMINFO, "MemAvailable")
            if need is not None and need > left:
                row.update(status="skipped", reason=f"needs ~{need:.0f} MiB (linear from "
                           f"{max(done[path])} tokens), {left:.0f} MiB available")
            else:
                result, why = spawned(run_case, folder, tokens, learner_config(path, sizes))
                if result is None:
                    row.update(status="failed", reason=why)
                else:
                    row.update(status="ok", **result)
                    done[path][tokens] = result
            rows.append(row)
            print(table_line(row), flush=True)
    return rows


def table_line(row: dict) -> str:
    start = f"{row['tokens']:>7}  {row['path']:<10}"
    if row["status"] != "ok":
        return f"{start} {row['status']}: {row['reason']}"
    return (f"{start} {row['loaded_mib']:>10.0f} {row['peak_mib']:>9.0f} {row['step_mib']:>9.0f} "
            f"{row['seconds']:>8.2f} {row['cpu_seconds']:>8.2f} {row['tokens_per_s']:>9.0f}")


def ratio(rows: list[dict], tokens: int, key: str, path: str = "switches",
          baseline: str = "today") -> float | None:
    """``path``'s ``key`` over ``baseline``'s at ``tokens``; None where either
    did not run."""
    found = {row["path"]: row for row in rows if row["tokens"] == tokens and row["status"] == "ok"}
    if path not in found or baseline not in found:
        return None
    return round(found[path][key] / found[baseline][key], 3)


def main() -> None:
    args = BenchmarkParser(__doc__.splitlines()[0], quick="smaller sizes (smoke test)").parse_args()
    sizes = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory() as folder:
        model, why = spawned(build_model, folder, sizes.model)
        if model is None:
            raise SystemExit(f"building the model failed: {why}")
        settings = {
            "model": {**asdict(sizes.model), **model}, "lengths": list(sizes.lengths),
            "reference_tokens": sizes.reference,
            "paths": {path: {name: getattr(learner_config(path, sizes), name) for name in (
                "activation_checkpointing", "logprob_chunk_tokens", "max_tokens_per_microbatch",
                "critic")} for path in PATHS},
            "memory": "step = peak - loaded (MiB); loaded: VmRSS after the models, trainer and "
                      "batch; peak: ru_maxrss after one step, its high-water mark reset at "
                      "loaded; a fresh spawned process per case",
        }
        print(f"{model['params'] / 1e6:.1f}M parameters, {model['torch_threads']} threads; "
              f"switches: {settings['paths']['switches']}")
        print(HEADER)
        rows = measure(sizes, folder)
    result = {
        "peak_vs_today_8k": ratio(rows, sizes.reference, "step_mib"),
        "peak_rss_vs_today_8k": ratio(rows, sizes.reference, "peak_mib"),
        "tokens_per_s_vs_today_8k": ratio(rows, sizes.reference, "tokens_per_s"),
        **{f"value_head_{name}_vs_critic_model_8k": ratio(rows, sizes.reference, key,
                                                          "value_head", "switches")
           for name, key in (("loaded", "loaded_mib"), ("step", "step_mib"),
                             ("tokens_per_s", "tokens_per_s"))},
        **settings, "table": rows,
    }
    print(f"at {sizes.reference} tokens, switches over today: step memory "
          f"{result['peak_vs_today_8k']} (goal <= 0.25), process peak "
          f"{result['peak_rss_vs_today_8k']}, tokens/s {result['tokens_per_s_vs_today_8k']} "
          "(goal >= 0.7); a value head over a critic model (both with the switches): loaded "
          f"{result['value_head_loaded_vs_critic_model_8k']}, step memory "
          f"{result['value_head_step_vs_critic_model_8k']}, tokens/s "
          f"{result['value_head_tokens_per_s_vs_critic_model_8k']}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
