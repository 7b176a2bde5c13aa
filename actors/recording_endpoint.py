"""The recording endpoint: an OpenAI-compatible chat completions server in
front of the actor's engine, so that an agent harness we did not write drives
the policy and every call it makes is trained (docs/endpoint.md).

Routes (``actors.endpoint``; one server per actor process, on the actor's
event loop and engine):

- ``POST /v1/chat/completions``: messages (and tools) in, one completion
  out, streamed (server-sent events) or whole. The request names its session
  (one rollout) in the ``X-Session-Id`` header (``session_header``) or, without
  it, in ``user``. A call marked ``"segment_type": "summary"`` (or whose last
  user message holds ``summary_prompt``) is the harness's summarisation.
- ``POST /v1/sessions/{id}/reward`` with ``{"reward": r, "success": b}``:
  the session's outcome; its last segment goes to the replay with it.
- ``DELETE /v1/sessions/{id}``: the harness gives the session up.
- ``GET /v1/models``: the one model served.

Token-in/token-out: the endpoint renders the messages with the model's chat
template itself (``ChatFormat.conversation_ids``), and an assistant message
that is one of the session's earlier completions goes in as the tokens the
policy sampled, never re-tokenised from its text. A call that continues the
previous one (its messages, then an assistant message) must send that
completion back unchanged: otherwise it is refused (409, counted), since its
tokens would contradict the recorded ones. How calls become segments:
actors/sessions.py.

A session starts only with a credit of the replay: without one the endpoint
answers 429 with ``Retry-After`` (counted), which harness clients retry.
Every refusal is an HTTP error with an OpenAI-style body naming the reason,
and a count in ``crl_actor_endpoint_errors_total{reason}``; nothing a request
holds can stop the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec
from aiohttp import web

from actors.chat import ChatFormat, TemplateError, message_text
from actors.config import ActorConfig
from actors.context import Generation
from actors.episode import EpisodeResult
from actors.metrics import ActorMetrics
from actors.rollout_writer import Rollout
from actors.sessions import SessionRecord
from protocol.codec import TOO_DEEP, nests_deeper

log = logging.getLogger("compactionrl.endpoint")

#: Roles a message may have; "developer" (OpenAI's newer name) is rendered as system.
ROLES = ("system", "developer", "user", "assistant", "tool")
#: Seconds a harness is told to wait for a credit before retrying.
RETRY_AFTER_S = 1
#: How deep lists and objects may nest in a request body (a tool's JSON
#: schema is the deepest real case, a few levels per nested object); deeper
#: is refused before the chat template and the encoders recurse into it.
MAX_BODY_NESTING = 64
#: Ended session ids remembered, so that a call naming one is refused
#: rather than silently starting a new rollout in the middle of an episode.
ENDED_SESSIONS_KEPT = 65_536


class EndpointError(Exception):
    """A request refused: HTTP ``status``, a ``reason`` (the counter's label) and a message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


class StreamingPolicy(Protocol):
    async def stream(self, prompt: list[int], max_tokens: int, seed: int | None = None,
                     temperature: float | None = None) -> AsyncIterator[Generation]: ...


class SessionHost(Protocol):
    """What the endpoint needs from its actor process (actors/process.py)."""

    config: ActorConfig
    chat: ChatFormat
    metrics: ActorMetrics

    @property
    def policy(self) -> StreamingPolicy: ...

    async def open_rollout(self) -> Rollout:
        """A new rollout, on a credit spent for it and begun, which the
        session writes its segments with; raise :class:`EndpointError`
        (429) when none may start now."""

    async def close_rollout(self, rollout: Rollout, abandoned: bool) -> None:
        """The session ended; ``abandoned``: without a reward (the replay drops it)."""


class ChatRequest(msgspec.Struct, kw_only=True):
    """The fields of an OpenAI chat completions request the endpoint reads
    (others are ignored, as OpenAI-compatible servers do)."""

    messages: list[dict[str, Any]]
    model: str = ""
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    n: int = 1
    seed: int | None = None
    segment_type: Literal["execution", "summary"] | None = None


class RewardRequest(msgspec.Struct, kw_only=True):
    reward: float
    success: bool | None = None
    """Default: reward >= 1."""
    tags: dict[str, str] = msgspec.field(default_factory=dict)


def turn_key(message: dict[str, Any]) -> str:
    """An assistant message's identity: its text and its calls (name and
    parsed arguments; call ids and formatting left out)."""
    calls = []
    for call in message.get("tool_calls") or []:
        try:
            function = call["function"]
            arguments = function.get("arguments") or "{}"
            calls.append([function["name"], json.loads(arguments)
                          if isinstance(arguments, str) else arguments])
        except (KeyError, TypeError, AttributeError, ValueError, RecursionError):
            raise EndpointError(400, "invalid_messages",
                                "an assistant message's tool_calls are malformed") from None
    return json.dumps([message_text(message), calls], sort_keys=True)


@dataclass
class Session:
    """One harness session: its recorder, its rollout (the segments it has
    closed, sent or the newest held back), and the completions it was returned."""

    record: SessionRecord
    rollout: Rollout
    """The session's rollout, from the credit it spent to its last segment
    or its abandonment: the host opened it, and closes it as the session ends."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    recorded: OrderedDict[str, list[int]] = field(default_factory=OrderedDict)
    """Completions as returned (:func:`turn_key`) -> the ids the policy sampled."""
    previous: list[dict[str, Any]] | None = None
    """The last call's messages, and the key of its completion."""
    previous_key: str = ""
    summary_seconds: float = 0.0
    ended: bool = False

    def check_continuation(self, messages: list[dict[str, Any]]) -> None:
        """A call that continues the last one must send its completion back as returned."""
        previous = self.previous
        if (previous is not None and len(messages) > len(previous)
                and messages[:len(previous)] == previous
                and messages[len(previous)]["role"] == "assistant"
                and turn_key(messages[len(previous)]) != self.previous_key):
            raise EndpointError(409, "contradiction",
                                "the assistant message after the previous call's messages is "
                                "not the completion that call returned: its tokens would "
                                "contradict the recorded ones (send it back unchanged)")


class RecordingEndpoint:
    """The HTTP server of one actor's sessions."""

    def __init__(self, host: SessionHost, model_name: str) -> None:
        self.host = host
        self.config = host.config.endpoint
        self.model_name = model_name
        self.sessions: dict[str, Session] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # ------------------------------------------------------------------ server

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/sessions/{session}/reward", self._reward)
        app.router.add_delete("/v1/sessions/{session}", self._abandon)
        app.router.add_get("/v1/models", self._models)
        return app

    async def start(self, port: int) -> int:
        """Listen on ``bind:port`` (0: any free port); returns the port."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.bind, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("recording endpoint on http://%s:%d/v1", self.config.bind, self.port)
        return self.port

    async def close(self) -> None:
        """Stop serving; sessions still open are abandoned."""
        await self.abandon_all()
        if self._runner is not None:
            await self._runner.cleanup()

    async def abandon_all(self) -> None:
        """End every open session, abandoned (the actor stops, or starts
        over as a new incarnation: then their calls would count nowhere)."""
        for session_id in list(self.sessions):
            await self._end(session_id, "abandoned")

    async def expire_idle(self) -> None:
        """Abandon sessions idle past ``session_timeout_s``, until cancelled."""
        timeout = self.config.session_timeout_s
        while True:
            await asyncio.sleep(timeout / 4)
            now = time.monotonic()
            for session_id, session in list(self.sessions.items()):
                if not session.lock.locked() and now - session.record.last_call > timeout:
                    log.warning("session %s idle for %.0f s: abandoned", session_id,
                                now - session.record.last_call)
                    await self._end(session_id, "abandoned")

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        try:
            return await handler(request)
        except EndpointError as error:
            return self._refuse(error)
        except web.HTTPException as error:  # aiohttp's own: no route, body too large
            reason = {404: "no_route", 405: "method", 413: "too_large"}.get(error.status, "http")
            return self._refuse(EndpointError(error.status, reason, error.reason))
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client went away: nothing to answer
        except Exception as error:  # the engine failed: this request only
            log.exception("request failed")
            return self._refuse(EndpointError(500, "internal", f"the request failed: {error}"))

    def _refuse(self, error: EndpointError) -> web.Response:
        self.host.metrics.endpoint_errors.labels(error.reason).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 429 else None
        return web.json_response(
            {"error": {"message": str(error), "type": "invalid_request_error"
                       if error.status < 500 else "server_error", "code": error.reason}},
            status=error.status, headers=headers)

    # ------------------------------------------------------------------ routes

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "compactionrl"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = decode(await request.read(), ChatRequest)
        session_id = request.headers.get(self.config.session_header) or body.user
        if not session_id:
            raise EndpointError(400, "no_session", f"name the session in the "
                                f"{self.config.session_header} header or the user field")
        if body.n != 1:
            raise EndpointError(400, "invalid_request", "n must be 1: one completion per call")
        messages = checked_messages(body.messages)
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self.ended:
                raise EndpointError(409, "session_ended", f"session {session_id!r} has ended: "
                                    "a new episode needs a new session id")
            rollout = await self.host.open_rollout()
            rollout.task_id = request.headers.get("X-Task-Id") or session_id
            session = Session(SessionRecord(session_id, rollout.rollout_id), rollout)
            self.sessions[session_id] = session
        async with session.lock:
            if session.ended:
                raise EndpointError(409, "session_ended", f"session {session_id!r} has ended")
            try:
                return await self._complete(request, session, body, messages)
            except BaseException:
                if not session.record.calls:  # nothing recorded: its credit back at once
                    await self._end(session_id, "abandoned", remember=False)
                raise

    async def _complete(self, request: web.Request, session: Session, body: ChatRequest,
                        messages: list[dict[str, Any]]) -> web.StreamResponse:
        session.check_continuation(messages)
        try:
            chat = self.host.chat.with_tools(body.tools)
            prompt = chat.conversation_ids(
                messages, lambda index, message: session.recorded.get(turn_key(message)))
        except TemplateError as error:
            raise EndpointError(400, "template", str(error)) from None
        window = self.host.config.engine.max_model_len
        room = window - len(prompt)
        if room < 1:
            raise EndpointError(400, "over_window", f"the prompt is {len(prompt)} tokens; the "
                                f"model's window (max_model_len) is {window}")
        wanted = body.max_completion_tokens or body.max_tokens
        max_tokens = min(room, wanted or self.host.config.sampling.max_turn_tokens)
        summary = body.segment_type == "summary" or self._asks_summary(messages)
        completion_id = f"chatcmpl-{next(self._ids)}"
        began = time.monotonic()
        # a summary is the session's stall while it is written, as an
        # episode slot's (actors/slots.py, SummaryStall)
        with (self.host.metrics.stall_seconds.waiting("summary", marked=False) if summary
              else contextlib.nullcontext()):
            stream = self.host.policy.stream(prompt, max_tokens, seed=body.seed)
            if body.stream:
                response, generation, message = await stream_completion(
                    request, chat, body, stream, completion_id, self.model_name, max_tokens,
                    len(prompt))
            else:
                generation = Generation([], [], [])
                async for delta in stream:
                    generation.extend(delta)
                response = None
                message, finish = completion_message(chat, generation, body.tools, max_tokens)
        if summary:
            session.summary_seconds += time.monotonic() - began
        key = turn_key(message)
        session.recorded[key] = generation.token_ids
        session.recorded.move_to_end(key)
        while len(session.recorded) > self.config.max_recorded_turns:
            session.recorded.popitem(last=False)
        session.previous, session.previous_key = messages, key
        rebuilds = session.record.rebuilds
        await session.rollout.add(session.record.record(prompt, generation, summary))
        self.host.metrics.endpoint_rebuilds.inc(session.record.rebuilds - rebuilds)
        self.host.metrics.endpoint_calls.labels("summary" if summary else "execution").inc()
        if response is not None:
            return response
        return web.json_response({
            "id": completion_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": None}],
            "usage": usage(len(prompt), len(generation.token_ids))})

    async def _reward(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session"]
        body = decode(await request.read(), RewardRequest)
        session = self._session(session_id)
        async with session.lock:
            if session.ended:
                raise EndpointError(409, "session_ended", f"session {session_id!r} has ended")
            record = session.record
            last = record.finish()
            rollout = session.rollout
            if last is None and rollout.empty:
                await self._end(session_id, "abandoned")
                raise EndpointError(409, "nothing_sampled", f"session {session_id!r} has no "
                                    "completion to reward: it is abandoned")
            result = EpisodeResult.of(
                rollout.task_id, "done", body.reward,
                body.reward >= 1.0 if body.success is None else body.success,
                steps=record.calls - record.summaries, compactions=record.summaries,
                generated_tokens=record.generated_tokens, summary_tokens=record.summary_tokens,
                duration_s=time.monotonic() - record.started, tags=body.tags,
                summary_seconds=session.summary_seconds)
            await rollout.finish(last, result)
            self.host.metrics.episode_finished(body.reward, result.stats, 0, {})
            await self._end(session_id, "rewarded")
        return web.json_response({"session": session_id, "rollout_id": record.rollout_id,
                                  "segments": session.rollout.sent, "calls": record.calls,
                                  "summaries": record.summaries, "rebuilds": record.rebuilds})

    async def _abandon(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session"]
        session = self._session(session_id)
        async with session.lock:
            await self._end(session_id, "abandoned")
        return web.json_response({"session": session_id, "abandoned": True})

    # ------------------------------------------------------------------ helpers

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise EndpointError(404, "unknown_session", f"no session {session_id!r} is open")
        return session

    async def _end(self, session_id: str, how: Literal["rewarded", "abandoned"],
                   remember: bool = True) -> None:
        """End a session; ``remember``: refuse its id from now on (False
        for a session whose first call failed, which recorded nothing)."""
        session = self.sessions.pop(session_id, None)
        if session is None or session.ended:
            return
        session.ended = True
        if remember:
            self.ended[session_id] = None
            while len(self.ended) > ENDED_SESSIONS_KEPT:
                self.ended.popitem(last=False)
        self.host.metrics.endpoint_sessions.labels(how).inc()
        await self.host.close_rollout(session.rollout, abandoned=how == "abandoned")

    def _asks_summary(self, messages: list[dict[str, Any]]) -> bool:
        marker = self.config.summary_prompt
        users = [m for m in messages if m["role"] == "user"]
        return bool(marker) and bool(users) and marker in message_text(users[-1])


def decode(raw: bytes, kind: type[msgspec.Struct]) -> Any:
    """A request body of type ``kind``, whose free-form parts (messages,
    tools: rendered and encoded recursively later) nest at most
    :data:`MAX_BODY_NESTING` levels."""
    try:
        body = msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as error:  # JSON, but not the fields expected
        raise EndpointError(400, "invalid_request", f"the request body: {error}") from None
    except msgspec.DecodeError as error:
        raise EndpointError(400, "malformed_json", f"the request body: {error}") from None
    except RecursionError:
        raise EndpointError(400, "malformed_json", f"the request body: {TOO_DEEP}") from None
    if nests_deeper(list(msgspec.structs.astuple(body)), MAX_BODY_NESTING):
        raise EndpointError(400, "too_deep", f"the request body nests deeper than "
                            f"{MAX_BODY_NESTING} levels")
    return body


def checked_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages, each with a known role and text content ("developer"
    read as "system"); :class:`EndpointError` (400) otherwise."""
    if not messages:
        raise EndpointError(400, "invalid_messages", "messages is empty")
    checked = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise EndpointError(400, "invalid_messages", f"messages[{index}].role = {role!r}: "
                                f"expected one of {', '.join(ROLES)}")
        try:
            message_text(message)
        except TemplateError as error:
            raise EndpointError(400, "invalid_messages", f"messages[{index}]: {error}") from None
        checked.append(message | {"role": "system"} if role == "developer" else message)
    return checked


def completion_message(chat: ChatFormat, generation: Generation, tools: list[dict] | None,
                       max_tokens: int) -> tuple[dict[str, Any], str]:
    """The assistant message of a completion, as the harness gets it (its
    tool calls parsed where the request declared tools), and its finish reason."""
    ids = chat.strip_end(generation.token_ids)
    ended = len(ids) < len(generation.token_ids)
    finish = "stop" if ended or len(generation.token_ids) < max_tokens else "length"
    text = chat.decode(ids)
    if tools:
        parsed = chat.tool_calls.parse(chat.decode(ids, keep_special=True), tools)
        if parsed.calls:
            return ({"role": "assistant", "content": parsed.content or None, "tool_calls": [
                {"id": f"call_{index}", "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                for index, call in enumerate(parsed.calls)]}, "tool_calls")
    return {"role": "assistant", "content": text}, finish


async def stream_completion(request: web.Request, chat: ChatFormat, body: ChatRequest,
                            stream: AsyncIterator[Generation], completion_id: str,
                            model_name: str, max_tokens: int, prompt_tokens: int
                            ) -> tuple[web.StreamResponse, Generation, dict[str, Any]]:
    """Server-sent events of the completion: text as it is sampled, or,
    with tools, the whole message at the end (its calls are parsed then)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    created = int(time.time())

    async def event(delta: dict[str, Any], finish: str | None = None,
                    extra: dict[str, Any] | None = None) -> None:
        chunk = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                 "model": model_name,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        await response.write(b"data: " + json.dumps(chunk | (extra or {})).encode() + b"\n\n")

    generation = Generation([], [], [])
    shown = ""
    try:
        await event({"role": "assistant", "content": ""})
        async for delta in stream:
            generation.extend(delta)
            if body.tools:
                continue
            text = chat.decode(chat.strip_end(generation.token_ids))
            if len(text) > len(shown) and not text.endswith("\ufffd"):  # whole characters
                await event({"content": text[len(shown):]})
                shown = text
    finally:  # a client gone midway: the engine's request is aborted, nothing recorded
        await stream.aclose()  # type: ignore[attr-defined]
    message, finish = completion_message(chat, generation, body.tools, max_tokens)
    if body.tools:
        await event({key: value for key, value in message.items() if key != "role"}
                    | {"tool_calls": [call | {"index": i} for i, call
                                      in enumerate(message.get("tool_calls") or [])]})
    elif (message["content"] or "") != shown:
        await event({"content": (message["content"] or "")[len(shown):]})
    await event({}, finish)
    if (body.stream_options or {}).get("include_usage"):
        chunk = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                 "model": model_name, "choices": [],
                 "usage": usage(prompt_tokens, len(generation.token_ids))}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response, generation, message


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def serve_until(endpoint: RecordingEndpoint, port: int, stopping: asyncio.Event) -> None:
    """Run ``endpoint`` on ``port`` with its expiry task until ``stopping`` is set."""
    await endpoint.start(port)
    expiry = asyncio.create_task(endpoint.expire_idle())
    try:
        await stopping.wait()
    finally:
        expiry.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await expiry
        await endpoint.close()
