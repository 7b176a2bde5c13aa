"""Synthetic hellos, segments and batches, for tests and benchmarks.

``synthetic_hello``: an actor's registration with a fresh random token.

``synthetic_segment``: every other token trainable, token ids below 100,
log-probabilities -1 on trainable tokens: valid for any vocabulary of 100 or
more. ``synthetic_batch``: a learner batch of random rollouts, deterministic
in its seed.
"""

from __future__ import annotations

import numpy as np

from protocol.arrays import Array
from protocol.messages import (
    Batch,
    EngineInfo,
    Hello,
    Rollout,
    RolloutStats,
    Segment,
    StalenessStats,
    Stamp,
    new_token,
)


def synthetic_hello(stamp: Stamp, capacity: int = 1, token: bytes | None = None) -> Hello:
    """``token``: the incarnation's (None: a fresh random one)."""
    return Hello(**stamp.next(), capacity=capacity,
                 engine=EngineInfo(device="cpu", dtype="bfloat16", tensor_parallel=1, model="m"),
                 token=new_token() if token is None else token)


def synthetic_segment(stamp: Stamp, rollout_id: str, index: int, final: bool,
                      version: int = 0, tokens: int = 64) -> Segment:
    mask = (np.arange(tokens) % 2).astype(np.uint8)
    return Segment(
        **stamp.next(), rollout_id=rollout_id, task_id="task", index=index,
        segment_type="execution" if index % 2 == 0 else "summary",
        tokens=Array.from_numpy(np.arange(tokens, dtype=np.int32) % 100),
        loss_mask=Array.from_numpy(mask),
        logprobs=Array.from_numpy(np.where(mask, -1.0, 0.0).astype(np.float32)),
        versions=Array.from_numpy(np.where(mask, version, -1).astype(np.int32)),
        final=final, reward=1.0 if final else None)


def synthetic_batch(rollouts: int = 6, seed: int = 0, vocab: int = 1000,
                    summary_trainable: bool = True) -> Batch:
    """Rollouts of execution / summary / execution segments with random
    tokens; trainable runs after a prompt; behaviour log-probabilities near
    what a random model gives. As the actors emit them, a summary segment's
    prompt is the execution segment before it."""
    rng = np.random.default_rng(seed)
    items = []
    for r in range(rollouts):
        segments = []
        kinds = ["execution", "summary", "execution"][: 1 + 2 * int(rng.integers(0, 2))]
        tokens = np.zeros(0, np.int32)
        for index, kind in enumerate(kinds):
            n = int(rng.integers(12, 40))
            prompt = tokens if kind == "summary" else np.zeros(0, np.int32)
            tokens = np.concatenate([prompt, rng.integers(3, vocab, n).astype(np.int32)])
            mask = np.zeros(len(tokens), np.uint8)
            start = len(prompt) + int(rng.integers(2, n // 2))
            mask[start:] = 1 if (kind == "execution" or summary_trainable) else 0
            n = len(tokens)
            logprobs = np.where(mask, -rng.uniform(5.0, 8.0, n), 0.0).astype(np.float32)
            final = index == len(kinds) - 1
            segments.append(Segment(
                sender_id="a", incarnation=0, seq=r * 10 + index, sent_at=0.0,
                rollout_id=f"r{r}", task_id=f"task-{r % 3}", index=index, segment_type=kind,
                tokens=Array.from_numpy(tokens), loss_mask=Array.from_numpy(mask),
                logprobs=Array.from_numpy(logprobs),
                versions=Array.from_numpy(np.where(mask, 0, -1).astype(np.int32)),
                final=final, reward=float(rng.integers(0, 2)) if final else None,
                stats=RolloutStats(outcome="done", success=True, steps=1,
                                   compactions=len(kinds) // 2, generated_tokens=n,
                                   summary_tokens=0, duration_s=1.0) if final else None))
        items.append(Rollout(rollout_id=f"r{r}", staleness=0, segments=segments))
    return Batch(sender_id="replay", incarnation=0, seq=0, sent_at=0.0, policy_version=0,
                 rollouts=items, staleness=StalenessStats(min=0, max=0, mean=0, p50=0, p95=0))
