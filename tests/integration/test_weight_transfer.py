"""Weights broadcast over gloo into a running vLLM CPU engine, through the
project's transfer engine (registered by its vllm.general_plugins entry point
in vLLM's spawned workers): afterwards the engine samples from the new weights."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from actors.config import ActorConfig, EngineConfig
from actors.engine import Engine, quiet_vllm_logging
from protocol.weights import WeightGroup
from tests.ports import free_ports

pytestmark = pytest.mark.slow

PROMPT = list(range(10, 200))  # longer than one KV block: the prefix cache must be cleared


async def _greedy(engine: Engine) -> tuple[list[int], list[float]]:
    generation = await engine.generate(PROMPT, max_tokens=8, temperature=0.0)
    return generation.token_ids, generation.logprobs


def test_broadcast_weights_replace_the_running_engines(tiny_model_dir: Path,
                                                       engine_loop) -> None:
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import (
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )

    quiet_vllm_logging()
    engine = engine_loop.run(Engine.start(str(tiny_model_dir), EngineConfig(dtype="float32"),
                                          ActorConfig().sampling, weight_transfer=True))
    try:
        trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter in trained.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
        tensors = [(name, p.detach().contiguous()) for name, p in trained.named_parameters()]

        [port] = free_ports(1)
        groups: list[WeightGroup] = []
        learner_side = threading.Thread(
            target=lambda: groups.append(WeightGroup("127.0.0.1", port, 0, 2, 0)))
        learner_side.start()
        engine_loop.run(engine.llm.init_weight_transfer_engine(WeightTransferInitRequest(
            init_info={"master_addr": "127.0.0.1", "master_port": port, "world_size": 2,
                       "rank": 1})))
        learner_side.join(timeout=60)
        before, _ = engine_loop.run(_greedy(engine))

        engine_loop.run(engine.llm.pause_generation(mode="keep", clear_cache=True))
        engine_loop.run(engine.llm.start_weight_update())
        sender = threading.Thread(target=lambda: [groups[0].broadcast(t) for _, t in tensors])
        sender.start()
        engine_loop.run(engine.llm.update_weights(WeightTransferUpdateRequest(update_info={
            "names": [n for n, _ in tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors]})))
        sender.join(timeout=60)
        engine_loop.run(engine.llm.finish_weight_update())
        engine_loop.run(engine.llm.resume_generation())

        after, logprobs = engine_loop.run(_greedy(engine))
        assert after != before
        ids = torch.tensor([PROMPT + after])
        with torch.no_grad():
            logp = torch.log_softmax(trained(ids).logits[0].float(), dim=-1)
        expected = [logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(after)]
        # tied embeddings: a stale lm_head copy would be off by whole nats
        assert max(abs(a - b) for a, b in zip(expected, logprobs, strict=True)) < 1e-3
        assert after == logp[len(PROMPT) - 1:-1].argmax(-1).tolist()
    finally:
        engine_loop.run(engine.shutdown())
