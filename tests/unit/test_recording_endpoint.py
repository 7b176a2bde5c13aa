"""The recording endpoint's HTTP layer on a real loopback server: OpenAI
request and response shapes, streaming, segments from calls, credits, and
bad input answered with an HTTP error and a count. The policy is a scripted
stand-in (the harness test in tests/integration runs the real engine)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from actors.chat import ChatFormat
from actors.config import ActorConfig, EndpointConfig
from actors.context import ClosedSegment, Generation
from actors.episode import EpisodeResult
from actors.metrics import ActorMetrics
from actors.recording_endpoint import MAX_BODY_NESTING, EndpointError, RecordingEndpoint
from actors.rollout_writer import Rollout
from protocol import GroupTag
from tests.guides import guide_block

CALL = {"name": "bash", "arguments": {"command": "ls"}}
TOOLS = [{"type": "function", "function": {
    "name": "bash", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}}, "required": ["command"]}}}]


class ScriptedPolicy:
    """Samples the next text of its script (then the end of turn), in two deltas."""

    def __init__(self, chat: ChatFormat) -> None:
        self.chat = chat
        self.script: list[str] = []
        self.prompts: list[list[int]] = []

    async def stream(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                     temperature: float | None = None) -> AsyncIterator[Generation]:
        self.prompts.append(prompt)
        text = self.script.pop(0)
        ids = (self.chat.tokenizer.encode(text, add_special_tokens=False)
               + self.chat.assistant_end)[:max_tokens]
        half = len(ids) // 2
        for part in (ids[:half], ids[half:]):
            yield Generation(part, [-0.5] * len(part), [7] * len(part))


class Host:
    """The actor's side: credits, the rollouts it opens and closes, and the
    segments they would send (it is their replay link too)."""

    def __init__(self, chat: ChatFormat, config: ActorConfig, credits: int) -> None:
        self.config, self.chat, self.metrics = config, chat, ActorMetrics()
        self.policy = ScriptedPolicy(chat)
        self.credits = credits
        self.replay_link = self
        self.sent: list[tuple[str, int, ClosedSegment, EpisodeResult | None]] = []
        self.closed: list[tuple[str, bool]] = []

    async def open_rollout(self) -> Rollout:
        if not self.credits:
            raise EndpointError(429, "no_credit", "no rollout credit is free")
        self.credits -= 1
        return Rollout(self, len(self.closed), f"rollout-{len(self.closed)}-{self.credits}")

    async def close_rollout(self, rollout: Rollout, abandoned: bool) -> None:
        self.closed.append((rollout.rollout_id, abandoned))

    async def send_segment(self, rollout_id: str, task_id: str, group: GroupTag | None,
                           index: int, segment: ClosedSegment, result: EpisodeResult | None
                           ) -> None:
        self.sent.append((rollout_id, index, segment, result))

    async def send_abandon(self, rollout_id: str, group: GroupTag | None) -> None:
        raise AssertionError("a session's abandon goes through close_rollout")

    def errors(self, reason: str) -> float:
        return self.metrics.registry.get_sample_value(
            "crl_actor_endpoint_errors_total", {"reason": reason}) or 0.0


@pytest.fixture(scope="module")
def chat(tiny_model_dir: Path) -> ChatFormat:
    from transformers import AutoTokenizer

    config = ActorConfig()
    return ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir), config.compaction,
                      config.environment)


Scenario = Callable[[Host, str, aiohttp.ClientSession], Awaitable[None]]


def serve(chat: ChatFormat, scenario: Scenario, credits: int = 4, **endpoint: Any) -> Host:
    config = ActorConfig(endpoint=EndpointConfig(enabled=True, **endpoint))
    config.engine = replace(config.engine, max_model_len=256)
    host = Host(chat, config, credits)

    async def run() -> None:
        server = RecordingEndpoint(host, "tiny")
        port = await server.start(0)
        expiry = asyncio.create_task(server.expire_idle())
        try:
            async with aiohttp.ClientSession() as client:
                await scenario(host, f"http://127.0.0.1:{port}/v1", client)
        finally:
            expiry.cancel()
            await server.close()

    asyncio.run(asyncio.wait_for(run(), 60))
    return host


async def post(client: aiohttp.ClientSession, url: str, body: Any, session: str | None = "s1",
               raw: bytes | None = None) -> tuple[int, Any, dict[str, str]]:
    headers = {"X-Session-Id": session} if session else {}
    async with client.post(url, data=raw if raw is not None else json.dumps(body),
                           headers=headers | {"Content-Type": "application/json"}) as response:
        return response.status, await response.json(), dict(response.headers)


SYSTEM = {"role": "system", "content": "Open the vault."}
TASK = {"role": "user", "content": "Find the code."}


def test_a_session_becomes_execution_and_summary_segments_with_the_reward_on_the_last(
        chat: ChatFormat) -> None:
    async def scenario(host: Host, base: str, client: aiohttp.ClientSession) -> None:
        host.policy.script = ["look north", "next", "alpha seven", "answer alpha 7"]
        url = f"{base}/chat/completions"
        status, first, _ = await post(client, url, {"model": "tiny", "messages": [SYSTEM, TASK]})
        assert status == 200
        assert first["object"] == "chat.completion"
        assert first["choices"][0]["message"] == {"role": "assistant", "content": "look north"}
        assert first["choices"][0]["finish_reason"] == "stop"
        history = [SYSTEM, TASK, first["choices"][0]["message"],
                   {"role": "user", "content": "a box"}]
        status, second, _ = await post(client, url, {"messages": history})
        history += [second["choices"][0]["message"], {"role": "user", "content": "a note"}]
        summary_request = {"role": "user", "content": "summarise"}
        status, summary, _ = await post(client, url, {"messages": history + [summary_request],
                                                      "segment_type": "summary"})
        assert summary["usage"]["completion_tokens"] == len(
            chat.tokenizer.encode("alpha seven", add_special_tokens=False)) + 1
        rebuilt = [SYSTEM, {"role": "user", "content": "Find the code. summary : alpha seven"}]
        status, _, _ = await post(client, url, {"messages": rebuilt})
        assert status == 200
        async with client.post(f"{base}/sessions/s1/reward", json={"reward": 1.0}) as response:
            assert response.status == 200
            assert (await response.json())["segments"] == 3

    host = serve(chat, scenario)
    assert [(i, s.segment_type) for _, i, s, _ in host.sent] == [
        (0, "execution"), (1, "summary"), (2, "execution")]
    execution, summary, last = (s for _, _, s, _ in host.sent)
    # the second prompt extended the first: one segment, the policy's tokens as sampled
    assert execution.tokens[:len(host.policy.prompts[0])] == host.policy.prompts[0]
    second = chat.tokenizer.encode("next", add_special_tokens=False) + chat.assistant_end
    assert execution.tokens == host.policy.prompts[1] + second
    assert execution.loss_mask[-len(second):] == [1] * len(second)
    assert set(execution.versions) == {-1, 7} and summary.num_trainable > 0
    assert summary.tokens[:len(host.policy.prompts[2])] == host.policy.prompts[2]
    assert last.tokens[:len(host.policy.prompts[3])] == host.policy.prompts[3]
    result = host.sent[-1][3]
    assert result is not None and result.reward == 1.0 and result.stats.success
    assert result.task_id == "s1"  # no X-Task-Id: the session's id names its task
    assert (result.stats.steps, result.stats.compactions) == (3, 1)
    assert host.sent[0][3] is None and host.closed == [(host.sent[0][0], False)]


def test_a_continued_conversation_extends_the_recorded_tokens_exactly(chat: ChatFormat) -> None:
    async def scenario(host: Host, base: str, client: aiohttp.ClientSession) -> None:
        host.policy.script = ["look", "go on"]
        url = f"{base}/chat/completions"
        _, first, _ = await post(client, url, {"messages": [SYSTEM, TASK]})
        history = [SYSTEM, TASK, first["choices"][0]["message"], {"role": "user", "content": "ok"}]
        await post(client, url, {"messages": history})

    host = serve(chat, scenario)
    first, second = host.policy.prompts
    sampled = chat.tokenizer.encode("look", add_special_tokens=False) + chat.assistant_end
    assert second[:len(first) + len(sampled)] == first + sampled
    assert host.metrics.registry.get_sample_value("crl_actor_endpoint_rebuilds_total") == 0


def test_streamed_text_is_the_completion_and_ends_with_done(chat: ChatFormat) -> None:
    async def scenario(host: Host, base: str, client: aiohttp.ClientSession) -> None:
        host.policy.script = ["open the door", "open the door"]
        url = f"{base}/chat/completions"
        body = {"messages": [SYSTEM, TASK], "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.post(url, json=body, headers={"X-Session-Id": "s"}) as response:
            assert response.headers["Content-Type"] == "text/event-stream"
            events = [line.removeprefix("data: ") for line in
                      (await response.text()).split("\n\n") if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
        assert text == "open the door"
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
        assert chunks[-1]["usage"]["completion_tokens"] > 0
        _, whole, _ = await post(client, url, {"messages": [SYSTEM, TASK]}, session="t")
        assert whole["choices"][0]["message"]["content"] == text

    serve(chat, scenario)


def test_tool_calls_are_returned_parsed_and_spliced_back_as_sampled(chat: ChatFormat) -> None:
    async def scenario(host: Host, base: str, client: aiohttp.ClientSession) -> None:
        host.policy.script = [f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>", "done"]
        url = f"{base}/chat/completions"
        _, first, _ = await post(client, url, {"messages": [TASK], "tools": TOOLS})
        message = first["choices"][0]["message"]
        assert first["choices"][0]["finish_reason"] == "tool_calls"
        call = message["tool_calls"][0]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
            "bash", CALL["arguments"])
        # a client sends it back with its own id and argument formatting
        echoed = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "other-id", "type": "function",
             "function": {"name": "bash", "arguments": '{ "command" : "ls" }'}}]}
        status, _, _ = await post(client, url, {"messages": [TASK, echoed, {
            "role": "tool", "tool_call_id": "other-id", "content": "a.txt"}], "tools": TOOLS})
        assert status == 200

    host = serve(chat, scenario)
    first, second = host.policy.prompts
    assert second[:len(first)] == first
    assert host.metrics.registry.get_sample_value("crl_actor_endpoint_rebuilds_total") == 0


def test_bad_requests_get_an_http_error_with_a_reason_and_a_count(chat: ChatFormat) -> None:
    async def scenario(host: Host, base: str, client: aiohttp.ClientSession) -> None:
        host.policy.script = ["look", "fine"]
        url = f"{base}/chat/completions"
        assert (await post(client, url, None, raw=b"{not json"))[0] == 400
        # nested past the decoder's recursion limit, and past the body's bound
        status, body, _ = await post(client, url, None, raw=b'{"messages": [{"content": '
                                     + b"[" * 100_000 + b"]" * 100_000 + b"}]}")
        assert (status, body["error"]["code"]) == (400, "malformed_json")
        deep: object = "x"
        for _ in range(MAX_BODY_NESTING):
            deep = [deep]
        status, body, _ = await post(client, url, {"messages": [
            {"role": "user", "content": deep}]})
        assert (status, body["error"]["code"]) == (400, "too_deep")
        assert (await post(client, url, {"messages": "x"}))[0] == 400
        assert (await post(client, url, {"messages": [TASK]}, session=None))[0] == 400
        assert (await post(client, url, {"messages": [{"role": "robot", "content": "x"}]}))[0] \
            == 400
        status, body, _ = await post(client, url, {"messages": [
            {"role": "user", "content": "word " * 400}]}, session="long")
        assert (status, body["error"]["code"]) == (400, "over_window")
        _, first, _ = await post(client, url, {"messages": [TASK]})
        edited = {"role": "assistant", "content": "not what was sampled"}
        status, body, _ = await post(client, url, {"messages": [TASK, edited, TASK]})
        assert (status, body["error"]["code"]) == (409, "contradiction")
        async with client.post(f"{base}/sessions/nobody/reward", json={"reward": 1}) as response:
            assert response.status == 404
        async with client.post(f"{base}/sessions/s1/reward", data=b"[]") as response:
            assert response.status == 400
        # still serving the session after all that
        status, _, _ = await post(client, url, {"messages": [
            TASK, first["choices"][0]["message"], TASK]})
        assert status == 200

    host = serve(chat, scenario)
    assert host.errors("malformed_json") == 2 and host.errors("too_deep") == 1
    for reason in ("malformed_json", "invalid_request", "no_session", "invalid_messages",
                   "over_window", "contradiction", "unknown_session"):
        assert host.errors(reason) >= 1, reason
    assert host.errors("invalid_request") == 2


def test_no_credit_is_a_429_with_retry_after_and_ended_sessions_stay_ended(
        chat: ChatFormat) -> None:
    async def scenario(host: Host, base: str, client: aiohttp.ClientSession) -> None:
        host.policy.script = ["look"]
        url = f"{base}/chat/completions"
        assert (await post(client, url, {"messages": [TASK]}, session="a"))[0] == 200
        status, body, headers = await post(client, url, {"messages": [TASK]}, session="b")
        assert (status, body["error"]["code"], headers["Retry-After"]) == (429, "no_credit", "1")
        async with client.delete(f"{base}/sessions/a") as response:
            assert response.status == 200
        status, body, _ = await post(client, url, {"messages": [TASK]}, session="a")
        assert (status, body["error"]["code"]) == (409, "session_ended")

    host = serve(chat, scenario, credits=1)
    assert host.closed == [("rollout-0-0", True)] and host.sent == []


def test_an_idle_session_is_abandoned(chat: ChatFormat) -> None:
    async def scenario(host: Host, base: str, client: aiohttp.ClientSession) -> None:
        host.policy.script = ["look"]
        await post(client, f"{base}/chat/completions", {"messages": [TASK]})
        for _ in range(100):
            if host.closed:
                break
            await asyncio.sleep(0.05)

    host = serve(chat, scenario, session_timeout_s=0.2)
    assert [abandoned for _, abandoned in host.closed] == [True]
    assert host.metrics.registry.get_sample_value(
        "crl_actor_endpoint_sessions_total", {"end": "abandoned"}) == 1


def test_a_session_whose_first_call_fails_returns_its_credit_at_once(chat: ChatFormat) -> None:
    """Nothing was recorded: the rollout is given up now (not after the idle
    timeout), and the harness may retry under the same id."""
    async def scenario(host: Host, base: str, client: aiohttp.ClientSession) -> None:
        host.policy.script = ["look"]
        url = f"{base}/chat/completions"
        status, _, _ = await post(client, url, {"messages": [
            {"role": "user", "content": "word " * 400}]}, session="a")
        assert status == 400
        assert host.closed == [("rollout-0-0", True)]
        host.credits += 1  # the replay returned it
        assert (await post(client, url, {"messages": [TASK]}, session="a"))[0] == 200

    serve(chat, scenario, credits=1)


def guide_client_code() -> dict[str, Any]:
    """The functions of docs/endpoint.md's client snippet, as printed."""
    names: dict[str, Any] = {}
    exec(guide_block("docs/endpoint.md", "## The calls the `openai` client does not make",
                     "python"), names)
    return names


def test_the_guide_s_client_code_waits_rewards_and_gives_up_with_the_openai_client(
        chat: ChatFormat) -> None:
    """docs/endpoint.md's snippet for the calls the ``openai`` client does not
    make, run as printed: the wait answers once the endpoint serves, a reward
    closes one session with the outcome, a give-up drops the other, and the
    refusals arrive as the client's own errors with the endpoint's reason."""
    import openai

    guide = guide_client_code()

    async def scenario(host: Host, base: str, _: aiohttp.ClientSession) -> None:
        host.policy.script = ["look", "next"]
        async with openai.AsyncOpenAI(base_url=base, api_key="any") as client:
            await guide["wait_until_ready"](client, timeout_s=10)
            for session in ("kept", "dropped"):
                await client.chat.completions.create(
                    model="tiny", messages=[SYSTEM, TASK],
                    extra_headers={"X-Session-Id": session})
            recorded = await guide["post_reward"](client, "kept", 1.0, True)
            assert (recorded["session"], recorded["segments"], recorded["calls"]) == (
                "kept", 1, 1)
            await guide["give_up"](client, "dropped")
            with pytest.raises(openai.NotFoundError) as twice:
                await guide["post_reward"](client, "kept", 1.0, True)
            assert twice.value.body["code"] == "unknown_session"
            with pytest.raises(openai.NotFoundError) as unknown:
                await guide["give_up"](client, "never-seen")
            assert unknown.value.body["code"] == "unknown_session"

    host = serve(chat, scenario)
    [(rollout, index, segment, result)] = host.sent
    assert index == 0 and result is not None and result.reward == 1.0 and result.stats.success
    assert sorted(abandoned for _, abandoned in host.closed) == [False, True]
    assert host.metrics.registry.get_sample_value(
        "crl_actor_endpoint_sessions_total", {"end": "abandoned"}) == 1


def test_the_guide_s_wait_gives_up_when_nothing_listens() -> None:
    """No endpoint at the address: the wait raises the client's connection
    error once its bound has passed, instead of waiting for ever."""
    import openai

    from tests.ports import free_ports

    guide = guide_client_code()
    [port] = free_ports(1)

    async def wait() -> None:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="any",
                                      max_retries=0) as client:
            await guide["wait_until_ready"](client, timeout_s=0.5)

    with pytest.raises(openai.APIConnectionError):
        asyncio.run(asyncio.wait_for(wait(), 30))


def test_the_example_harness_makes_these_calls_with_the_guide_s_code() -> None:
    """examples/keyvault_agent.py, which tests/integration/test_endpoint_harness.py
    trains through the endpoint, waits, rewards and gives up with the
    guide's functions as printed."""
    block = guide_block("docs/endpoint.md", "## The calls the `openai` client does not make",
                        "python")
    functions = block[block.index("async def wait_until_ready"):].strip()
    example = (Path(__file__).parents[2] / "examples" / "keyvault_agent.py").read_text()
    assert functions in example
