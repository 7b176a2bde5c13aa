"""Configuration of an actor process (the ``[actors]`` section)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DEFAULT_SUMMARY_INSTRUCTION = (
    "stop . write a summary of the history for your successor : the goal , every fact found "
    "with its exact value , the actions done and their results , and the next step . keep it "
    "short .")
DEFAULT_RESUME_TEMPLATE = (
    "{task}\n\nsummary of your earlier progress :\n{summary}\n\ncontinue the task from here .")


@dataclass
class EngineConfig:
    """The vLLM engine of one actor."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    """Weights and activations dtype inside vLLM (the learner may differ)."""
    max_model_len: int = 2048
    """Longest sequence the engine accepts; must be >= compaction.context_tokens."""
    tensor_parallel: int = 1
    """GPUs per engine. Must be 1 on CPU."""
    gpu_memory_utilization: float = 0.85
    """Fraction of GPU memory vLLM may take (GPU only)."""
    cpu_threads_bind: str = "auto"
    """CPU build only: cores the engine's OpenMP threads run on ("auto":
    vLLM's choice, every core the process may use but the last, which it
    keeps for its scheduler; "nobind"; or a list such as "0-3"). Engines on
    one machine with "auto" all bind the same cores: they thrash, and an
    engine started beside a busy one was starved there while it started.
    `compactionrl up` gives each local CPU actor its own core when this is
    "auto"; an actor started by hand beside others needs one named here."""
    cpu_kv_cache_gib: int = 1
    """KV cache size on CPU in whole GiB (vLLM's VLLM_CPU_KVCACHE_SPACE); small
    keeps 2-core machines usable."""
    enforce_eager: bool = True
    """No CUDA graphs / compilation: fast start, the safe default on CPU."""
    seed: int = 0
    """Engine sampling seed (each actor adds its index)."""


@dataclass
class SamplingConfig:
    """How assistant turns are sampled. Log-probabilities are those of this
    processed distribution, because the learner's importance weights divide by them."""

    temperature: float = 1.0
    """Sampling temperature of the behaviour policy (the learner's importance
    weights divide by the processed distribution it defines)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = the full distribution)."""
    max_turn_tokens: int = 128
    """Cap on one assistant turn (further capped by the room left in the window)."""


@dataclass
class CompactionConfig:
    """Context compaction (DESIGN §2.1)."""

    enabled: bool = True
    """Off: plain multi-turn episodes that end when the window is full."""
    context_tokens: int = 1024
    """C: the context limit an episode runs under."""
    reserve_tokens: int = 256
    """T_comp: compact after a step once fewer than this many tokens are free.
    Must cover the summary instruction plus max_summary_tokens."""
    keep_steps: int = 2
    """k: most recent steps kept verbatim after the summary (lowered down to 0
    until the rebuilt context leaves reserve_tokens free)."""
    max_summary_tokens: int = 160
    """Longest summary the policy may write."""
    max_compactions: int = 3
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
    options: dict[str, int | float | str | bool] = field(default_factory=dict)
    """Keyword arguments for the factory."""
    max_steps: int = 64
    """Episode step limit (outcome ``step_limit``, reward 0)."""
    observation_max_tokens: int = 256
    """Longer observations are cut to this many tokens, with a visible marker."""
    truncation_marker: str = " [observation cut]"
    """Text that replaces the cut-off end of an observation."""


@dataclass
class ActorConfig:
    """One actor process: engine, sampling, compaction, and where to connect."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    compaction: CompactionConfig = field(default_factory=CompactionConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    count: int = 2
    """Actor processes `compactionrl up` starts on this machine."""
    concurrent_episodes: int = 8
    """Episodes one actor runs at once on its engine."""
    group_size: int = 1
    """Consecutive episodes that play the same task (environment seed) with
    different sampling seeds: the groups of learner.advantage = "grpo"."""
    metrics_port: int = 9110
    """First actor's Prometheus port; actor i serves on metrics_port + i (0 = off)."""
    ack_timeout_s: float = 5.0
    """A segment not acknowledged this long is sent again (same actor, incarnation, seq)."""
    hello_retry_s: float = 2.0
    """Hello is repeated this often until the replay answers with Welcome."""
    on_shutdown: Literal["abandon", "finish"] = "abandon"
    """On SIGTERM: drop in-flight episodes (the replay expires their segments)
    or finish them first. New episodes never start after SIGTERM."""
    shutdown_deadline_s: float = 30.0
    """Longest wait on SIGTERM for episodes (with "finish") and acks together."""

    def validate(self, section: str = "actors") -> list[str]:
        """Problems that make this section unusable, each naming field and fix."""
        problems = []
        c, e = self.compaction, self.engine
        if self.group_size < 1:
            problems.append(f"{section}.group_size must be >= 1")
        if c.context_tokens < 64:
            problems.append(f"{section}.compaction.context_tokens = {c.context_tokens}: "
                            "must be at least 64")
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
        if c.keep_steps < 0:
            problems.append(f"{section}.compaction.keep_steps = {c.keep_steps}: k must be >= 0")
        if c.max_summary_tokens < 1:
            problems.append(f"{section}.compaction.max_summary_tokens must be >= 1")
        if c.max_compactions < 0:
            problems.append(f"{section}.compaction.max_compactions must be >= 0")
        if e.max_model_len < c.context_tokens:
            problems.append(
                f"{section}.engine.max_model_len = {e.max_model_len} is below "
                f"{section}.compaction.context_tokens = {c.context_tokens}: raise max_model_len")
        if e.tensor_parallel < 1:
            problems.append(f"{section}.engine.tensor_parallel must be >= 1")
        if not 0 < e.gpu_memory_utilization <= 1:
            problems.append(f"{section}.engine.gpu_memory_utilization must be in (0, 1]")
        if e.cpu_kv_cache_gib < 1:
            problems.append(f"{section}.engine.cpu_kv_cache_gib must be >= 1 (whole GiB)")
        s = self.sampling
        if s.temperature <= 0:
            problems.append(f"{section}.sampling.temperature must be > 0")
        if not 0 < s.top_p <= 1:
            problems.append(f"{section}.sampling.top_p must be in (0, 1]")
        if s.max_turn_tokens < 1:
            problems.append(f"{section}.sampling.max_turn_tokens must be >= 1")
        if "{task}" not in c.resume_template or "{summary}" not in c.resume_template:
            problems.append(f"{section}.compaction.resume_template must contain {{task}} and "
                            "{summary}")
        env = self.environment
        if ":" not in env.factory:
            problems.append(f"{section}.environment.factory = {env.factory!r}: expected "
                            "'module:Name'")
        if env.max_steps < 1:
            problems.append(f"{section}.environment.max_steps must be >= 1")
        if env.observation_max_tokens < 1:
            problems.append(f"{section}.environment.observation_max_tokens must be >= 1")
        for name in ("ack_timeout_s", "hello_retry_s", "shutdown_deadline_s"):
            if getattr(self, name) <= 0:
                problems.append(f"{section}.{name} must be > 0")
        if self.count < 0:
            problems.append(f"{section}.count must be >= 0")
        if self.concurrent_episodes < 1:
            problems.append(f"{section}.concurrent_episodes must be >= 1")
        return problems
