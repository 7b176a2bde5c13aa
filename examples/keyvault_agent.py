"""A short agent harness written against the ``openai`` client alone: the
kind of harness CompactionRL did not write, driving the policy through an
actor's recording endpoint (docs/endpoint.md).

It plays a built-in environment (any ``module:Name`` of ``actors.envs``
style: ``reset(seed)`` and ``step(text)``) with its own framing (observations
come back as user messages) and its own compaction: when the last call's
prompt and completion leave fewer than ``--reserve-tokens`` of
``--context-tokens``, it asks the policy for a
summary with its own prompt, marked ``segment_type = "summary"``, and starts
over from the task and that summary. At the end it posts the episode's
reward to the endpoint, or gives the session up if its environment fails.
Everything it knows of the endpoint: the base URL, the session header, the
summary marker, and the reward, give-up and readiness calls, whose code is
docs/endpoint.md's as printed.

    python examples/keyvault_agent.py --base-url http://127.0.0.1:8100/v1 --episodes 8
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import uuid
from typing import Any

import httpx
from openai import APIConnectionError, AsyncOpenAI

SUMMARY_PROMPT = "stop . write a summary of the facts found , with their exact values ."


async def wait_until_ready(client: AsyncOpenAI, timeout_s: float = 600.0) -> None:
    """Return once the actor serves: its endpoint listens only after its
    engine has started (a minute or more on a CPU)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await client.models.list()
            return
        except APIConnectionError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(2.0)


async def post_reward(client: AsyncOpenAI, session: str, reward: float,
                      success: bool) -> dict:
    """End the session with its outcome; the answer counts what was recorded
    (segments, calls, summaries, rebuilds)."""
    response = await client.post(f"/sessions/{session}/reward", cast_to=httpx.Response,
                                 body={"reward": reward, "success": success})
    return response.json()


async def give_up(client: AsyncOpenAI, session: str) -> None:
    """End the session without an outcome: the replay drops its segments."""
    await client.delete(f"/sessions/{session}", cast_to=httpx.Response)


def load_environment(factory: str, options: dict[str, Any]) -> Any:
    module, name = factory.split(":")
    return getattr(importlib.import_module(module), name)(**options)


async def play(client: AsyncOpenAI, environment: Any, seed: int, args: argparse.Namespace
               ) -> dict[str, Any]:
    """One episode in its own session; returns what happened."""
    session = f"keyvault-{seed}-{uuid.uuid4().hex[:8]}"
    headers = {"X-Session-Id": session}
    task = await environment.reset(seed)
    start = [{"role": "system", "content": task.system},
             {"role": "user", "content": task.instruction}]
    messages = list(start)
    reward, success, steps, summaries, prompt_tokens = 0.0, False, 0, 0, 0
    while steps < args.max_steps:
        if prompt_tokens + args.reserve_tokens > args.context_tokens:
            if summaries == args.max_summaries:
                break
            summary = await client.chat.completions.create(
                model=args.model, messages=messages + [{"role": "user",
                                                        "content": SUMMARY_PROMPT}],
                max_tokens=args.summary_tokens, extra_headers=headers,
                extra_body={"segment_type": "summary"})
            summaries += 1
            messages = [start[0], {"role": "user", "content": (
                f"{task.instruction}\n\nsummary :\n{summary.choices[0].message.content}"
                "\n\ncontinue .")}]
        completion = await client.chat.completions.create(
            model=args.model, messages=messages, max_tokens=args.turn_tokens,
            extra_headers=headers)
        prompt_tokens = completion.usage.prompt_tokens + completion.usage.completion_tokens
        action = completion.choices[0].message.content or ""
        try:
            result = await environment.step(action)
        except Exception:  # nothing to reward: the replay drops the session's segments
            await give_up(client, session)
            raise
        steps += 1
        # the completion goes back exactly as it came (token-in/token-out)
        messages += [{"role": "assistant", "content": action},
                     {"role": "user", "content": result.observation}]
        if result.done:
            reward, success = result.reward, result.success
            break
    recorded = await post_reward(client, session, reward, success)
    return {"session": session, "steps": steps, "summaries": summaries, "reward": reward,
            "success": success, "recorded": recorded}


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    # a session waits for a rollout credit: the endpoint answers 429 with
    # Retry-After, which the client's retries honour
    client = AsyncOpenAI(base_url=args.base_url, api_key="unused", max_retries=args.retries,
                         timeout=300)
    await wait_until_ready(client)
    options = json.loads(args.options)
    seeds = iter(range(args.first_seed, args.first_seed + args.episodes))
    results: list[dict[str, Any]] = []

    async def worker() -> None:
        environment = load_environment(args.environment, options)
        for seed in seeds:
            results.append(await play(client, environment, seed, args))

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    await client.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8100/v1")
    parser.add_argument("--model", default="policy", help="any name: one model is served")
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--environment", default="actors.envs.keyvault:KeyVault")
    parser.add_argument("--options", default=json.dumps(
        {"codes": 1, "digits": 3, "rooms": 10, "distractor_words": 3, "ordered": False,
         "partial_credit": True}), help="the environment's options, as JSON")
    parser.add_argument("--context-tokens", type=int, default=260)
    parser.add_argument("--reserve-tokens", type=int, default=80,
                        help="compact once the context leaves fewer free (room for the next "
                             "observation, the summary request and the summary)")
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--summary-tokens", type=int, default=24)
    parser.add_argument("--max-summaries", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=32)
    parser.add_argument("--retries", type=int, default=100)
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    for result in results:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
