"""The GPU check: whether the project's own weight transfer holds on a GPU
(what a GPU run puts at risk), what a co-located weight push costs on one
GPU, whether NCCL accepts two ranks on the same GPU, and what the learner's
PPO step costs on one GPU.

The GPU machine it is written for has torch with CUDA and none of this
project's dependencies. Parts 4 to 6 are standard library and torch only,
their models written here, not imported from transformers; the learner part
(7) runs the learner's own sharding, log-probabilities and PPO step
(``learner.models``, ``learner.ppo.PPOTrainer``) on such a model. Parts 1
to 3 and 7 run the project's packages from the checkout (``PYTHONPATH``
names the checkout's root where the project is not installed), which need
pyzmq and msgspec (the transfer) and numpy and prometheus-client (the
learner's package): they are carried to the machine as wheels
(docs/deploy.md, "The GPU check"); without them those parts say which is
missing and skip, and the rest runs.

It measures, on GPU 0, the project's transfer first:

1. **The project's ipc channel** (``project_ipc``): protocol/weights_ipc.py
   between this process (rank 0, as learner rank 0) and an engine's process,
   joined through the project's rendezvous store: a bf16 Qwen2.5-0.5B-shaped
   manifest in 64 MiB buckets, one warm-up and ``--pushes`` publications,
   each of tensors of its own (seeded per publication and tensor); the
   receiver loads every tensor into zeroed parameters of its own. Per
   publication, every tensor's checksum on both sides (below), compared one
   by one; the median push (``send`` to the last acknowledgement) and GB/s.
2. **The receive-ahead loader under separate streams**
   (``receive_ahead_streams``): the same channel, 21 publications of a
   quarter-sized manifest in 4 MiB buckets, received as
   actors/weight_transfer.py receives them under vLLM: a thread draws
   ``RECEIVE_AHEAD`` tensors ahead (``protocol.weights.received_ahead``, its
   ``hand_over`` to the consumer's stream), and the loader copies each into
   its parameter on a CUDA stream of its own, spending ~50 us on that stream
   before each copy (``torch.cuda._sleep``) as vLLM's repacking does, so that
   a receive buffer released too early would be reused under a pending copy.
   Every publication's checksums compared.
3. **The project's weight group** (``weight_group``,
   bench/gpu_parts/weight_group.py): member processes of a weight group
   (protocol/weights_collective.py), each with a first group of its own
   that is never aborted, rank 0 started as a learner rank and the others
   as engines' workers (``start_environments``; on CUDA then without what
   vLLM's GPU worker removes, ``VLLM_GPU_WORKER_REMOVES``), in four trials:
   a receiver killed in the middle of a publication, with the fix and as
   before issue 62's (``before_fix``: the members' first groups keep
   torch's dump on timeout), whose sender and survivor must still answer
   past the first group's monitor (``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``
   lowered to 30 s); five publications of 988 MB in 256 MiB buckets failed
   on both sides with a broadcast in flight, in processes that never
   collect garbage, the buffers still alive and the GPU memory each keeps
   after them within one bucket; a receiver killed between its join and the
   first broadcast, the sender failing within its deadline; a run deadline
   of 36 s with rank 0 reaching the member's lane 36 s after the join,
   within the member's deadline (72 s), with the fix (the publication must
   arrive intact) and, at once, as before it (the engine's 30 s init
   timeout; the check that required both error-handling names). That
   module's docstring says how.
4. **A push by CUDA IPC** (``ipc_push``) between two processes, as vLLM's
   ``ipc`` weight-transfer engine does it: the sender holds the weights on
   the GPU and, per push, exports one IPC handle per tensor
   (``torch.multiprocessing.reductions.reduce_tensor``) and sends the
   handles over a local pipe; the receiver opens each handle
   (``rebuild_cuda_tensor``) and copies into its own pre-allocated tensor, a
   device-to-device copy with no host round trip, then acknowledges. A push
   is timed from the first export to the acknowledgement, for bf16 manifests
   shaped like Qwen2.5-0.5B, -1.5B and -7B (their real layer counts, sizes,
   heads and tied embeddings); median of ``--pushes`` after one warm-up. The
   baseline is the same copies inside the sender (``local_copy_seconds``).
   The receiver's tensors are zeroed before each push and, after the last,
   both sides compute a digest: the SHA-256 of (name, shape, checksum) over
   the manifest. A tensor's checksum (all parts) is the sum of its raw 16-bit
   words weighted by position ((index mod 65521) + 1), mod 2**64.
5. **NCCL with two ranks on one GPU** (``nccl_shared_gpu``): two processes on
   cuda:0 join one NCCL group through a ``FileStore`` and broadcast; whether
   it is refused, and the text (recent NCCL says "Duplicate GPU detected"). A
   rank that has not answered after ``--nccl-timeout`` seconds is killed and
   recorded as a hang.
6. **The learner part** (``learner``): random Qwen2.5-0.5B- and
   -1.5B-shaped policies (tied) and critics (the body again, with a scalar
   head), written here in plain torch (RMSNorm, rotary embeddings,
   grouped-query attention by SDPA with its causal kernels, SwiGLU), float32
   parameters with bf16 compute under FSDP2 on a process group of one rank,
   as the learner runs them. A PPO step on random token ids: clipped-ratio
   policy loss and value loss, backward, gradient clipping, AdamW. For 2k, 8k
   and 16k tokens per sequence (two sequences a step) and each set of the
   learner's memory switches (all on, each one off, none: per-layer
   activation checkpointing, chunked log-softmax recomputed in backward, one
   sequence per pass; and all on with the critic as a value head on the
   policy, no critic model): step time (median after a warm-up), tokens/s,
   the peak of allocated memory, per switch set the first length that does
   not fit (CUDA out of memory), and two utilizations against the H200's
   dense bf16 peak, with the FLOP count written out (``FLOP_FORMULA``):

   - MFU, model FLOPs per token: 6*(N_policy + N_critic - vocab*hidden) for
     forward and backward of both models (the critic's embedding is a
     lookup, not a matmul) plus 2*6*layers*hidden*seq for causal attention
     (a token attends to seq/2 positions on average: q.k and the weighted sum
     of v are 2*2*hidden*seq/2 per layer forward, three times that with
     backward); with a value head, one body: 6*(N_policy + hidden + 1) +
     6*layers*hidden*seq.
   - HFU, hardware FLOPs per token: the model FLOPs plus what the step
     computes again: the old values' forward where the step takes several
     micro-batches (``old_values_forward``); with per-layer checkpointing, every layer's
     forward once more, 2*N_layers + 2*layers*hidden*seq per body (N_layers:
     the decoder layers' parameters); with the chunked log-softmax, the
     output layer's logits once more, 2*vocab*hidden.

   Per model: the bf16 log-probabilities' error against float32 on the same
   tokens, and the time to gather every parameter whole (``full_tensor``)
   and to write them (``torch.save``). ``--budget-s`` skips what would start
   after that many seconds (it says so).
7. Versions of torch, CUDA and NCCL, the device and its memory.

Every process a part starts is killed with its process group when the part
ends, and every wait is bounded. The member processes of parts 1 to 3 are
forked from a fork server that imported torch and the project's protocol
once (and never touches CUDA).

On the GPU machine, after installing the carried wheels (docs/deploy.md), one
command (273 s of its own on an H200 with ``--budget-s 270``, measured on
2026-12-04, docs/weights.md "Run on an H200", with fewer weight group
trials; 7B's push peaks at about 32 GB; the weight group's trials now take
about 4 minutes of their own and the whole about 8 with the default
``--budget-s`` of 450, estimates: docs/weights.md "The GPU check")::

    python bench/gpu_check.py --json --out gpu_check

It prints one JSON object as its last line and writes it to
``gpu_check/gpu_check.json``; it exits 1 if a checksum differs, a weight
group trial with the fix did not hold (``trials_hold``), or the learner part
failed. ``--parts`` runs some of the parts only. Each part is a module of
bench/gpu_parts/.

``--dry-run`` runs the same code on CPU in seconds: manifests scaled down
(hidden, intermediate and vocabulary sizes divided by 32, about 1000x fewer
parameters; the project's buckets 64 KiB, 6 receive-ahead publications),
CPU tensors passed as shared memory by the same reductions, the project's
ipc channel on its CPU twin (staging files under /dev/shm), gloo instead of
NCCL (which on CPU is not refused: it says so), no streams, and for the
learner part a tiny model (hidden 64, 2 layers, vocabulary 512) at 64, 128
and 256 tokens, without MFU or memory figures. Its figures say nothing about
a GPU; no GPU figure is claimed anywhere unless this ran on one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from gpu_parts import weight_group
from gpu_parts.common import (
    DRY_RUN_DIVISOR,
    DRY_RUN_TRANSFER,
    GPU_TRANSFER,
    MODELS,
    TransferPlan,
    member_context,
    protocol_unavailable,
)
from gpu_parts.learner_part import (
    DRY_RUN_PLAN,
    GPU_PLAN,
    H200_BF16_DENSE_PEAK_FLOPS,
    LEARNER_MODELS,
    LEARNER_UNAVAILABLE,
    LearnerPlan,
    learner_part,
)
from gpu_parts.project_ipc import project_ipc_parts
from gpu_parts.raw_ipc import ipc_pushes, shared_device_check
from gpu_parts.weight_group import WeightGroupPlan, trials_hold, weight_group_trials


def environment(device: str) -> dict[str, Any]:
    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                             "nccl": None, "device": "cpu", "device_memory_bytes": None}
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        facts.update(device=properties.name, device_memory_bytes=properties.total_memory,
                     nccl=".".join(map(str, torch.cuda.nccl.version())))
    return facts


#: The project's weight transfer first: it is what a GPU run puts at risk.
TRANSFER_PARTS = ("project_ipc", "receive_ahead_streams", "weight_group")
PARTS = (*TRANSFER_PARTS, "ipc", "nccl", "learner")


def transfer_parts(device: str, parts: list[str], plans: dict[str, TransferPlan],
                   group_plan: WeightGroupPlan) -> dict[str, dict[str, Any] | None]:
    """Each transfer part's report (None: not asked for), or why it has none."""
    reports: dict[str, dict[str, Any] | None] = dict.fromkeys(TRANSFER_PARTS)
    wanted = [part for part in TRANSFER_PARTS if part in parts]
    if not wanted:
        return reports
    if why := protocol_unavailable():
        return {**reports, **{part: {"error": why} for part in wanted}}
    on_ipc = [part for part in wanted if part != "weight_group"]
    with member_context() as context:
        if on_ipc:
            try:
                reports.update(project_ipc_parts(context, device, plans, on_ipc))
            except Exception as error:  # one lent run: keep the other parts' figures
                reports.update({part: {"error": f"{type(error).__name__}: {error}"}
                                for part in on_ipc})
        if "weight_group" in wanted:
            reports["weight_group"] = weight_group_trials(context, device, group_plan)
    for part in wanted:
        print(f"{part}: " + json.dumps(reports[part])[:1000], flush=True)
    return reports


def transfers_intact(reports: dict[str, dict[str, Any] | None]) -> bool:
    """Whether every transfer part that ran delivered every checksum intact
    and, with the project's fix, the weight group's trials held (before the
    fix, what happens is what is shown)."""
    ran = {part: report for part, report in reports.items()
           if report is not None and not str(report.get("error")).startswith("skipped")}
    if any(report.get("error") for report in ran.values()):
        return False
    group = ran.pop("weight_group", None)
    if group and not trials_hold(group):
        return False
    return all(report["checksums_match"] for report in ran.values())


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, scaled-down manifests and models, gloo: the same code in "
                             "seconds")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--out", type=Path,
                        help="folder for gpu_check.json (the report) and the learner part's "
                             "export, which is deleted once timed (default: a temporary one)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="pushed by CUDA IPC")
    parser.add_argument("--pushes", type=int, default=5,
                        help="timed pushes after a warm-up (ipc and project_ipc)")
    parser.add_argument("--nccl-timeout", type=float, default=60.0,
                        help="seconds before the shared-device ranks count as hung")
    parser.add_argument("--learner-models", nargs="+", choices=LEARNER_MODELS,
                        default=list(LEARNER_MODELS))
    parser.add_argument("--lengths", nargs="+", type=int,
                        help="tokens per sequence of the learner part "
                             f"(default {GPU_PLAN.lengths}; dry run {DRY_RUN_PLAN.lengths})")
    parser.add_argument("--learner-steps", type=int,
                        help="timed PPO steps after a warm-up "
                             f"(default {GPU_PLAN.steps}; dry run {DRY_RUN_PLAN.steps})")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="learner work that would start after this many seconds from "
                             "the start is skipped (recorded as skipped)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_PEAK_FLOPS / 1e12,
                        help="the device's dense bf16 peak, for MFU (default: an H200's)")
    args = parser.parse_args(argv)
    if args.pushes < 1 or (args.learner_steps is not None and args.learner_steps < 1):
        parser.error("--pushes and --learner-steps must be at least 1")
    if args.lengths and min(args.lengths) < 2:
        parser.error("--lengths must be at least 2 tokens")
    return args


def learner_report(args: argparse.Namespace, device: str, out: Path,
                   started: float) -> dict[str, Any]:
    if LEARNER_UNAVAILABLE:
        return {"errors": 0, "skipped": LEARNER_UNAVAILABLE, "budget_s": args.budget_s}
    plan = DRY_RUN_PLAN if args.dry_run else GPU_PLAN
    plan = LearnerPlan(**{**asdict(plan), "steps": args.learner_steps or plan.steps,
                          "lengths": tuple(sorted(args.lengths or plan.lengths))})
    try:
        report = learner_part(args.learner_models, device, plan, out, started + args.budget_s,
                              args.peak_tflops * 1e12)
    except Exception as error:  # one lent run: keep the other parts' figures
        report = {"errors": 1, "error": f"{type(error).__name__}: {error}"}
    report["budget_s"] = args.budget_s
    return report


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_arguments(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); run it on a "
              "GPU machine, or pass --dry-run for the CPU version", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:  # tiny shapes gain nothing from threads; on busy cores, OpenMP's
        torch.set_num_threads(1)  # waiting threads made the dry run several times slower
    else:  # the ipc channel stages on the current device
        torch.cuda.set_device(0)
    facts = environment(device)
    print(f"{'DRY RUN (CPU, gloo, scaled-down manifests and models): ' if args.dry_run else ''}"
          f"torch {facts['torch']}, CUDA {facts['cuda']}, NCCL {facts['nccl']}, "
          f"device {facts['device']} ({facts['device_memory_bytes']} bytes)", flush=True)
    plans = DRY_RUN_TRANSFER if args.dry_run else GPU_TRANSFER
    plans = {**plans, "project_ipc": replace(plans["project_ipc"], pushes=args.pushes)}
    group_plan = weight_group.DRY_RUN_PLAN if args.dry_run else weight_group.GPU_PLAN
    report: dict[str, Any] = {"dry_run": args.dry_run, **facts,
                              **transfer_parts(device, args.parts, plans, group_plan),
                              "ipc_push": None,
                              "nccl_shared_gpu": None, "learner": None}
    if "ipc" in args.parts:
        report["ipc_push"] = ipc_pushes(args.models, device,
                                        DRY_RUN_DIVISOR if args.dry_run else 1, args.pushes)
    if "nccl" in args.parts:
        shared = report["nccl_shared_gpu"] = shared_device_check(device, args.nccl_timeout)
        print(f"two ranks of one {shared['backend']} group on one {device} device: "
              f"{shared['outcome']}{': ' + shared['error'] if shared['error'] else ''}")
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        if "learner" in args.parts:
            report["learner"] = learner_report(args, device, out, started)
        report["seconds"] = time.monotonic() - started
        if args.out:
            (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report))
    intact = all(push["checksum_equal"] for push in report["ipc_push"] or [])
    intact = intact and transfers_intact({part: report[part] for part in TRANSFER_PARTS})
    return 0 if intact and not (report["learner"] or {}).get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
