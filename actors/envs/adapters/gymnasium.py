"""A Gymnasium environment with text observations and text actions
(``gymnasium==1.4.0``, ``spaces.Text`` both ways) as a CompactionRL environment.

The first observation of ``reset(seed=...)`` is the task's instruction; each
action is the assistant's text, passed to ``step`` as it is; each later
observation is the observation turn. The episode ends when the environment
terminates or truncates; its reward is the **return** (the sum of the step
rewards), and ``success`` is ``info["success"]`` where the environment gives
it, else a positive return. Per-step rewards are summed into the final
reward, not placed on the step's tokens.

Environments whose spaces are not text (pixels, ``Box``, ``Discrete``) do not
map: wrap them in a ``gymnasium.Wrapper`` that renders observations as text
and parses actions from text, and register that (docs/environments.md).
"""

from __future__ import annotations

from typing import Any

from actors.envs.base import StepResult, Task


class GymnasiumText:
    """``env_id``: a registered Gymnasium id, or ``module:Class`` (imported
    and registered under that name); ``kwargs`` go to ``gymnasium.make``."""

    def __init__(self, env_id: str, system: str = "", kwargs: dict[str, Any] | None = None,
                 max_episode_steps: int | None = None) -> None:
        import gymnasium
        from gymnasium import spaces
        from gymnasium.envs.registration import EnvSpec

        self.env_id = env_id
        self.system = system
        # make() reads "module:Name" as "import module, make its registered
        # Name": a class path goes in as a spec of its own instead
        target = (EnvSpec(id=env_id.replace(":", "."), entry_point=env_id)
                  if ":" in env_id else env_id)
        self.env = gymnasium.make(target, max_episode_steps=max_episode_steps, **(kwargs or {}))
        for name in ("observation_space", "action_space"):
            space = getattr(self.env, name)
            if not isinstance(space, spaces.Text):
                raise ValueError(f"Gymnasium environment {env_id!r}: its {name} is "
                                 f"{type(space).__name__}, not Text; wrap it to map text both "
                                 "ways (docs/environments.md)")
        self._return = 0.0

    async def reset(self, seed: int) -> Task:
        observation, info = self.env.reset(seed=seed)
        self._return = 0.0
        tags = {key: str(value) for key, value in (info.get("tags") or {}).items()}
        return Task(task_id=str(info.get("task_id", f"{self.env_id}-{seed}")),
                    system=str(info.get("system", self.system)), instruction=str(observation),
                    tags=tags)

    async def step(self, action: str) -> StepResult:
        observation, reward, terminated, truncated, info = self.env.step(action)
        self._return += float(reward)
        done = bool(terminated or truncated)
        success = bool(info.get("success", self._return > 0)) if done else False
        return StepResult(str(observation), done=done, reward=self._return if done else 0.0,
                          success=success, info=dict(info))

    async def close(self) -> None:
        self.env.close()
