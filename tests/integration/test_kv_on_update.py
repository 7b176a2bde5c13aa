"""``actors.kv_on_update`` on a real vLLM CPU engine, both modes: a request in
flight across a weight update carries the old version and then the new one,
with log-probabilities exactly those of what it was sampled from ("keep": the
new weights over the KV the old ones computed; "recompute": the new weights
over KV recomputed by them); "keep" recomputes nothing; and a request that
starts after the update, sharing its prefix with one served before it, is
computed entirely with the new weights (no prefix-cache block of the old ones
is reused)."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from pathlib import Path

import pytest
import torch

from actors.config import ActorConfig
from actors.engine import Engine
from deploy.model_check import reference_logprobs
from deploy.sample import FLOAT32_LOGPROB_TOLERANCE
from protocol.weights import manifest_of
from tests.weight_sender import PROMPTS, WeightSender

pytestmark = pytest.mark.slow

PROMPT = PROMPTS[0]  # 190 tokens: more than one KV block (128 tokens on CPU)
TEMPERATURE = ActorConfig().sampling.temperature


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path) -> dict[str, torch.nn.Module]:
    """The tiny model ("old") and a perturbed copy, as if trained ("new")."""
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new = copy.deepcopy(old)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for parameter in new.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return {"old": old, "new": new}


@pytest.fixture(scope="module")
def learner(live_engine: Engine, engine_loop) -> WeightSender:
    learner = WeightSender()
    learner.join(engine_loop, live_engine)
    return learner


async def _push(learner: WeightSender, engine: Engine, model: torch.nn.Module, version: int,
                kv_on_update: str) -> None:
    tensors = [(name, p.detach().contiguous()) for name, p in model.named_parameters()]
    manifest = manifest_of(tensors, 0)
    sender = threading.Thread(target=lambda: learner.group.send(manifest,
                                                                (t for _, t in tensors)))
    sender.start()
    await engine.load_weights(version, manifest, kv_on_update)
    sender.join(timeout=60)


def _preemptions(engine: Engine) -> float:
    """vLLM's ``vllm:num_preemptions`` counter of ``engine`` itself, read from
    its own stat logger: the process's Prometheus registry holds only the
    last engine started in it (vLLM unregisters its metrics at each start),
    and the shared engine is not always that one."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    [logger] = [logger for logger in engine.llm.logger_manager.stat_loggers
                if isinstance(logger, PrometheusStatLogger)]
    return sum(child._value.get() for child in logger.counter_num_preempted_reqs.values())


def _in_flight_reference(old: torch.nn.Module, new: torch.nn.Module, prompt: list[int],
                         completion: list[int], old_tokens: int, kept: bool) -> torch.Tensor:
    """Log-probabilities of ``completion`` as sampled across an update after
    ``old_tokens`` tokens: the old weights before; after it the new weights
    over the old weights' KV of everything computed before the pause (the
    prompt and all but the last old token) when ``kept``, else over KV they
    recompute themselves."""
    before = reference_logprobs(old, prompt, completion[:old_tokens], TEMPERATURE)[0]
    if not kept:
        return torch.cat([before, reference_logprobs(new, prompt, completion,
                                                     TEMPERATURE)[0][old_tokens:]])
    ids = torch.tensor([prompt + completion])
    split = len(prompt) + old_tokens - 1  # the last old token's KV is computed after resume
    with torch.no_grad():
        cache = old(ids[:, :split], use_cache=True).past_key_values
        logits = new(ids[:, split:-1], past_key_values=cache, use_cache=True).logits[0]
    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    after = logp.gather(1, torch.tensor(completion[old_tokens:])[:, None])[:, 0]
    return torch.cat([before, after])


@pytest.mark.parametrize("kv_on_update", ["keep", "recompute"])
def test_an_update_leaves_in_flight_tokens_exact_and_new_requests_on_the_new_weights(
        kv_on_update: str, live_engine: Engine, learner: WeightSender, models,
        engine_loop) -> None:
    old, new = models["old"], models["new"]
    engine = live_engine

    async def scenario():
        await _push(learner, engine, old, engine.version + 1, kv_on_update)
        start = engine.version
        # served before the update: its blocks (prompt and 300 sampled tokens)
        # stay in the prefix cache, computed by the old weights
        served = await engine.generate(PROMPT, max_tokens=300, seed=1)
        # a random-init model almost never samples EOS: this one runs to max_tokens
        in_flight = asyncio.ensure_future(engine.generate(PROMPT, max_tokens=1500, seed=3))
        while engine.llm.output_processor.get_num_unfinished_requests() == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        preemptions = _preemptions(engine)
        await _push(learner, engine, new, start + 1, kv_on_update)
        spanning = await in_flight
        await asyncio.sleep(0.1)  # the last outputs' stats reach the metrics
        preempted = _preemptions(engine) - preemptions
        # after the update, with the served request's prefix: 3 whole blocks
        prompt = PROMPT + served.token_ids
        after = await engine.generate(prompt, max_tokens=24, seed=5)
        return start, spanning, preempted, prompt, after

    began = time.perf_counter()
    start, spanning, preempted, prompt, after = engine_loop.run(scenario())
    seconds = time.perf_counter() - began
    versions = spanning.versions
    old_tokens = versions.count(start)
    kept = kv_on_update == "keep"
    spanning_error = _max_error(_in_flight_reference(
        old, new, PROMPT, spanning.token_ids, old_tokens, kept), spanning.logprobs)
    other_mode_error = _max_error(_in_flight_reference(
        old, new, PROMPT, spanning.token_ids, old_tokens, not kept), spanning.logprobs)
    after_error = _max_error(reference_logprobs(new, prompt, after.token_ids, TEMPERATURE)[0],
                             after.logprobs)
    old_weights_error = _max_error(reference_logprobs(old, prompt, after.token_ids,
                                                      TEMPERATURE)[0], after.logprobs)
    print(f"{kv_on_update}: {seconds:.1f} s; in flight: {old_tokens} old tokens of "
          f"{len(versions)}, |d log p| {spanning_error:.1e} (other mode's KV: "
          f"{other_mode_error:.2f}), {preempted:.0f} preemptions; after: |d log p| "
          f"{after_error:.1e} (old weights: {old_weights_error:.2f})")

    # the request in flight: old version, then new, each token's log-probability
    # that of the distribution it was sampled from, and not the other mode's
    assert versions == [start] * old_tokens + [start + 1] * (len(versions) - old_tokens)
    assert 0 < old_tokens < len(versions)
    assert spanning_error <= FLOAT32_LOGPROB_TOLERANCE
    assert other_mode_error > 0.01
    # "keep" recomputes nothing; "recompute" preempted the request to recompute it
    assert preempted == 0 if kept else preempted >= 1

    # the new request: the new weights throughout, no block of the old ones reused
    assert set(after.versions) == {start + 1}
    assert after_error <= FLOAT32_LOGPROB_TOLERANCE
    assert old_weights_error > 0.05


def _max_error(reference: torch.Tensor, logprobs: list[float]) -> float:
    return (reference - torch.tensor(logprobs)).abs().max().item()
