"""Configuration of an actor process (the ``[actors]`` section)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from protocol.bounds import bound_problems, bounded
from protocol.messages import MAX_CAPACITY, MAX_TENSOR_PARALLEL

DEFAULT_SUMMARY_INSTRUCTION = (
    "stop . write a summary of the history for your successor : the goal , every fact found "
    "with its exact value , the actions done and their results , and the next step . keep it "
    "short .")
DEFAULT_RESUME_TEMPLATE = (
    "{task}\n\nsummary of your earlier progress :\n{summary}\n\ncontinue the task from here .")
#: RoPE types whose max_position_embeddings vLLM 0.32 takes as already
#: scaled (it multiplies the others' by their factor itself).
PRESCALED_ROPE_TYPES = ("yarn", "longrope", "llama3", "su", "deepseek_yarn",
                        "deepseek_llama_scaling")


def read_model_config(model: str | Path) -> dict[str, Any] | None:
    """The model folder's config.json, or None where there is none (a model
    on another machine: checked where the engine starts)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _text_config(model_config: dict[str, Any]) -> dict[str, Any]:
    """Where the language model's settings are (multimodal configs nest them)."""
    if "max_position_embeddings" not in model_config:
        return model_config.get("text_config") or model_config
    return model_config


@dataclass
class EngineConfig:
    """The vLLM engine of one actor."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    """Weights and activations dtype inside vLLM (the learner may differ)."""
    max_model_len: int = 2048
    """Longest sequence the engine accepts; must be >= compaction.context_tokens."""
    tensor_parallel: int = bounded(1, ge=1, le=MAX_TENSOR_PARALLEL,
                                   why="the wire's bound (EngineInfo.tensor_parallel)")
    """GPUs per engine. Must be 1 on CPU."""
    gpu_memory_utilization: float = bounded(0.85, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (GPU only)."""
    cpu_threads_bind: str = "auto"
    """CPU build only: cores the engine's threads run on (a list such as
    "0-3"; "auto" or "nobind": every core the process may use). With one
    worker the model runs in vLLM's engine-core process, and the list binds
    that process; with tensor_parallel > 1, vLLM binds each worker ("0|1":
    a list per worker, and "auto" is vLLM's choice). Engines on one machine
    that share cores thrash: an engine started beside a busy one was starved
    while it started.
    `compactionrl up` gives each local CPU actor its own core when this is
    "auto"; an actor started by hand beside others needs one named here."""
    cpu_kv_cache_gib: int = bounded(1, ge=1, why="whole GiB")
    """KV cache size on CPU in whole GiB (vLLM's VLLM_CPU_KVCACHE_SPACE); small
    keeps 2-core machines usable."""
    enforce_eager: bool | None = None
    """No CUDA graphs / compilation: fast start, slower decoding. Unset: off on
    GPU (CUDA graphs decode faster), on on CPU (nothing to capture). On CPU,
    eager also turns torch.compile off in the engine, which vLLM otherwise
    uses for a few sampler helpers (~3 s of each start here)."""
    rope_scaling: dict[str, int | float | str | bool] = field(default_factory=dict)
    """RoPE scaling given to vLLM (as hf_overrides) so that max_model_len may
    exceed the model's max_position_embeddings, e.g. { rope_type = "yarn",
    factor = 4.0, original_max_position_embeddings = 32768 }: the window is
    then factor x original_max_position_embeddings (default: the model's
    max_position_embeddings). Empty: the model's own positions. The learner
    scores tokens with the model's config.json: give it the same scaling
    there, or the importance weights compare two different policies."""
    seed: int = 0
    """Engine sampling seed (each actor adds its index)."""
    trust_remote_code: bool = False
    """Run the model folder's own Python code (models transformers does not
    ship). It runs in the engines and, for the same model, in the learner's
    loading and export, which take this setting too."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """More of vLLM's engine arguments (``AsyncEngineArgs`` fields), passed
    through as given, e.g. ``{ max_num_seqs = 64, kv_cache_dtype = "fp8" }``.
    A name vLLM does not have, or one of the arguments the fields above set
    (``model``, ``dtype``, ``max_model_len``, ...), is refused at engine start."""

    def eager(self, on_gpu: bool) -> bool:
        """``enforce_eager`` for vLLM: as set, else off on GPU (CUDA graphs
        decode faster) and on on CPU (no graphs to capture; starts faster)."""
        return (not on_gpu) if self.enforce_eager is None else self.enforce_eager

    def window(self, model_config: dict[str, Any]) -> int | None:
        """The longest max_model_len the model allows: its max_position_embeddings,
        or factor x original_max_position_embeddings with rope_scaling. None:
        its config.json states no max_position_embeddings."""
        positions = _text_config(model_config).get("max_position_embeddings")
        if not self.rope_scaling:
            return positions
        original = self.rope_scaling.get("original_max_position_embeddings", positions)
        if not isinstance(original, int | float) or isinstance(original, bool):
            return None
        return int(float(self.rope_scaling.get("factor", 1.0)) * original)

    def window_problems(self, model_config: dict[str, Any], model: str,
                        section: str = "actors.engine") -> list[str]:
        """max_model_len against the model's config.json (``model`` names the
        folder in the message): vLLM refuses to start beyond the model's
        positions unless rope scaling stretches them."""
        window = self.window(model_config)
        if window is None or self.max_model_len <= window:
            return []
        if self.rope_scaling:
            return [f"{section}.max_model_len = {self.max_model_len} exceeds the "
                    f"{window} positions {section}.rope_scaling gives {model}: lower "
                    f"max_model_len to {window}, or raise the scaling factor"]
        factor = -(-self.max_model_len // window)  # the whole factor that reaches it
        return [f"{section}.max_model_len = {self.max_model_len} exceeds {model}'s "
                f"max_position_embeddings = {window} (vLLM refuses to start): lower "
                f"max_model_len (and compaction.context_tokens) to {window}, or set "
                f"{section}.rope_scaling = {{ rope_type = \"yarn\", factor = {factor}.0, "
                f"original_max_position_embeddings = {window} }}"]

    def hf_overrides(self, model_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``hf_overrides`` for ``rope_scaling`` (empty without it).
        vLLM 0.32 takes rope_parameters whole (set on the loaded config, not
        merged: the model's rope_theta is carried over here) and, for YaRN-like
        types, reads max_position_embeddings as the already scaled length
        (vllm/config/model.py, _get_and_verify_max_len), so it is raised too."""
        if not self.rope_scaling:
            return {}
        text = _text_config(model_config)
        rope = dict(text.get("rope_parameters") or {})
        if "rope_theta" not in rope and "rope_theta" in text:
            rope["rope_theta"] = text["rope_theta"]
        rope.update(self.rope_scaling)
        overrides: dict[str, Any] = {"rope_parameters": rope}
        window = self.window(model_config)
        if window is not None and rope.get("rope_type") in PRESCALED_ROPE_TYPES:
            rope.setdefault("original_max_position_embeddings",
                            text.get("max_position_embeddings"))
            overrides["max_position_embeddings"] = window
        return overrides


@dataclass
class SamplingConfig:
    """How assistant turns are sampled. Log-probabilities are those of this
    processed distribution, because the learner's importance weights divide by them."""

    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature of the behaviour policy (the learner's importance
    weights divide by the processed distribution it defines)."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling mass (1 = the full distribution)."""
    max_turn_tokens: int = bounded(128, ge=1)
    """Cap on one assistant turn (further capped by the room left in the window)."""


@dataclass
class CompactionConfig:
    """Context compaction (docs/design.md §2.1)."""

    enabled: bool = True
    """Off: plain multi-turn episodes that end when the window is full."""
    context_tokens: int = bounded(1024, ge=64)
    """C: the context limit an episode runs under."""
    reserve_tokens: int = 256
    """T_comp: compact after a step once fewer than this many tokens are free.
    Must cover the summary instruction plus max_summary_tokens."""
    keep_steps: int = bounded(2, ge=0)
    """k: most recent steps kept verbatim after the summary (lowered down to 0
    until the rebuilt context leaves reserve_tokens free)."""
    max_summary_tokens: int = bounded(160, ge=1)
    """Longest summary the policy may write."""
    max_compactions: int = bounded(3, ge=0)
    """Episode ends at this many compactions (3 = a 4x budget)."""
    summary_instruction: str = DEFAULT_SUMMARY_INSTRUCTION
    """q_sum: the user turn that asks for the summary."""
    resume_template: str = DEFAULT_RESUME_TEMPLATE
    """The user turn that opens a rebuilt context; ``{task}`` and ``{summary}``
    are replaced by the task and the summary (spliced in as the policy's tokens)."""


@dataclass
class EnvironmentConfig:
    """Which environment the episodes run against."""

    factory: str = "actors.envs.keyvault:KeyVault"
    """``module:Name`` of a class or function returning an Environment."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the factory, any TOML value, tables included (a
    verifiers taskset's own config, a Gymnasium environment's kwargs): passed
    as given, and checked by the factory before any engine starts."""
    max_steps: int = bounded(64, ge=1)
    """Episode step limit (outcome ``step_limit``, reward 0)."""
    observation_max_tokens: int = bounded(256, ge=1)
    """Longer observations are cut to this many tokens, with a visible marker."""
    truncation_marker: str = " [observation cut]"
    """Text that replaces the cut-off end of an observation."""
    tool_parser: str = "hermes"
    """vLLM's tool parser for the model family, for tasks that declare tools:
    ``hermes`` (Qwen2.5/Qwen3, ``<tool_call>`` JSON), ``llama3_json``,
    ``pythonic``, or any other name vLLM registers (actors/tools.py)."""


@dataclass
class EndpointConfig:
    """The recording endpoint (actors/recording_endpoint.py, docs/endpoint.md): an
    OpenAI-compatible chat completions server in front of the actor's engine,
    so that an agent harness drives the policy and its calls are trained."""

    enabled: bool = False
    """Serve harnesses instead of running the actor's own episodes: each
    harness session is one rollout."""
    port: int = bounded(8100, ge=0, le=65535)
    """First actor's HTTP port; actor i serves on port + i (0: any free port, logged)."""
    bind: str = "127.0.0.1"
    """Address the HTTP server listens on. Not authenticated: keep it on
    loopback or a private network (docs/endpoint.md)."""
    session_header: str = "X-Session-Id"
    """Request header naming the session (the rollout); without it, the
    request's ``user`` field."""
    summary_prompt: str = ""
    """A call whose last user message contains this text is a summarisation
    (the harness's own compaction prompt); a request field ``segment_type =
    "summary"`` marks one too. Empty: only the field does."""
    session_timeout_s: float = bounded(300.0, gt=0)
    """A session without a call or its reward this long is abandoned (its
    credit returned, its segments dropped by the replay, counted)."""
    max_recorded_turns: int = bounded(64, ge=1)
    """Completions per session whose tokens are kept for splicing back in."""


@dataclass
class ActorConfig:
    """One actor process: engine, sampling, compaction, and where to connect."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    compaction: CompactionConfig = field(default_factory=CompactionConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    count: int = bounded(2, ge=0)
    """Actor processes `compactionrl up` starts on this machine."""
    gpus: list[int] = field(default_factory=list)
    """GPUs of the actors `compactionrl up` starts, engine.tensor_parallel
    consecutive ones per actor (count x tensor_parallel in all). Empty:
    the GPUs after the learner's; on one GPU, one actor shares it with the
    learner (co-location). A learner GPU listed here co-locates that actor."""
    concurrent_episodes: int = bounded(8, ge=1, le=MAX_CAPACITY,
                                       why="the wire's bound (Hello.capacity)")
    """Episodes one actor runs at once on its engine."""
    kv_on_update: Literal["keep", "recompute"] = "keep"
    """What requests in flight during a weight update continue on. "keep":
    the KV the old weights computed (no re-prefill; tokens sampled after the
    update see it for the rest of the request, their log-probabilities still
    recorded as sampled); "recompute": vLLM preempts them and prefills prompt
    and sampled tokens again with the new weights. Either way no later request
    reuses a prefix-cache block computed by old weights."""
    group_size: int = bounded(1, ge=1)
    """Consecutive episodes that play the same task (environment seed) with
    different sampling seeds: the groups of learner.advantage = "grpo"."""
    metrics_port: int = 9110
    """First actor's Prometheus port; actor i serves on metrics_port + i (0 = off)."""
    ack_timeout_s: float = bounded(5.0, gt=0)
    """A segment not acknowledged this long is sent again (same actor, incarnation, seq)."""
    hello_retry_s: float = bounded(2.0, gt=0)
    """Hello is repeated this often until the replay answers with Welcome."""
    on_shutdown: Literal["abandon", "finish"] = "abandon"
    """On SIGTERM: drop in-flight episodes (the replay expires their segments)
    or finish them first. New episodes never start after SIGTERM."""
    shutdown_deadline_s: float = bounded(30.0, gt=0)
    """Longest wait on SIGTERM for episodes (with "finish") and acks together."""

    def window_tokens(self) -> int:
        """Tokens one episode's window holds at most in the engine's KV cache:
        its context (compaction's, or the engine's whole length without
        compaction) and a turn."""
        window = (self.compaction.context_tokens if self.compaction.enabled
                  else self.engine.max_model_len)
        return window + self.sampling.max_turn_tokens

    def kv_shortfall(self, kv_tokens: int) -> str | None:
        """What is wrong with an engine whose KV cache holds ``kv_tokens`` for
        ``concurrent_episodes`` (None: every episode's full window fits at
        once). Past it vLLM preempts running requests and recomputes them
        later: episodes take longer, and their rollouts grow stale."""
        window = self.window_tokens()
        if kv_tokens >= self.concurrent_episodes * window:
            return None
        return (f"the engine's KV cache holds {kv_tokens:,} tokens: {kv_tokens // window} full "
                f"windows of {window:,} (context and a turn), fewer than "
                f"actors.concurrent_episodes = {self.concurrent_episodes}; vLLM will preempt "
                f"and recompute requests (lower concurrent_episodes to {kv_tokens // window}, or "
                "give the engine more memory)")

    def validate(self, section: str = "actors") -> list[str]:
        """Problems that make this section unusable, each naming field and fix."""
        c, e = self.compaction, self.engine
        problems = bound_problems(self, section)
        for name in ("engine", "sampling", "compaction", "environment", "endpoint"):
            problems += bound_problems(getattr(self, name), f"{section}.{name}")
        if c.reserve_tokens >= c.context_tokens:
            problems.append(
                f"{section}.compaction.reserve_tokens = {c.reserve_tokens} leaves no room in "
                f"{section}.compaction.context_tokens = {c.context_tokens}: make the reserve "
                "smaller than the context")
        if c.enabled and c.reserve_tokens <= c.max_summary_tokens:
            problems.append(
                f"{section}.compaction.reserve_tokens = {c.reserve_tokens} cannot hold the "
                f"summary instruction plus max_summary_tokens = {c.max_summary_tokens}: raise "
                "the reserve or lower max_summary_tokens")
        if e.max_model_len < c.context_tokens:
            problems.append(
                f"{section}.engine.max_model_len = {e.max_model_len} is below "
                f"{section}.compaction.context_tokens = {c.context_tokens}: raise max_model_len")
        if e.rope_scaling and not isinstance(e.rope_scaling.get("factor"), int | float):
            problems.append(f"{section}.engine.rope_scaling = {e.rope_scaling} has no numeric "
                            "factor: give rope_type and factor, e.g. { rope_type = \"yarn\", "
                            "factor = 4.0, original_max_position_embeddings = 32768 }")
        if e.rope_scaling and "rope_type" not in e.rope_scaling:
            problems.append(f"{section}.engine.rope_scaling = {e.rope_scaling} has no rope_type "
                            "(vLLM reads rope_type, not the older type): add rope_type = "
                            "\"yarn\" (or the type the model documents)")
        if "{task}" not in c.resume_template or "{summary}" not in c.resume_template:
            problems.append(f"{section}.compaction.resume_template must contain {{task}} and "
                            "{summary}")
        if self.group_size > self.concurrent_episodes:
            problems.append(f"{section}.group_size = {self.group_size} exceeds "
                            f"{section}.concurrent_episodes = {self.concurrent_episodes}: the "
                            "replay grants a group's credits together, so an actor must be able "
                            "to run a whole group at once")
        env = self.environment
        if ":" not in env.factory:
            problems.append(f"{section}.environment.factory = {env.factory!r}: expected "
                            "'module:Name'")
        return problems
