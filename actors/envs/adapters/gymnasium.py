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

import importlib
from typing import Any

from actors.envs.base import StepResult, Task


def make_target(env_id: str) -> Any:
    """What ``gymnasium.make`` is given for ``env_id``:

    - ``"Id-v0"``: an id registered in this process (Gymnasium's own, or by a
      module the environment's factory imports);
    - ``"module:Id-v0"``: Gymnasium's own form, the module that registers the
      id (imported here, so a fresh actor process finds the id);
    - ``"module:Class"``: a class path, registered under that name.
    """
    import gymnasium
    from gymnasium.envs.registration import EnvSpec

    module_name, colon, name = env_id.partition(":")
    if not colon:
        if env_id not in gymnasium.registry:
            raise ValueError(f"Gymnasium id {env_id!r} is not registered in this process: "
                             f"name the module that registers it, as 'module:{env_id}'")
        return env_id
    module = importlib.import_module(module_name)  # its registrations run now
    if name in gymnasium.registry:
        return name
    if isinstance(getattr(module, name, None), type):
        return EnvSpec(id=env_id.replace(":", "."), entry_point=env_id)
    raise ValueError(f"Gymnasium environment {env_id!r}: {module_name!r} neither registers "
                     f"the id {name!r} nor has a class of that name")


class GymnasiumText:
    """``env_id``: a registered Gymnasium id, ``module:Id`` (the module that
    registers it) or ``module:Class`` (:func:`make_target`); ``kwargs`` go to
    ``gymnasium.make``."""

    def __init__(self, env_id: str, system: str = "", kwargs: dict[str, Any] | None = None,
                 max_episode_steps: int | None = None) -> None:
        import gymnasium
        from gymnasium import spaces

        self.env_id = env_id
        self.system = system
        self.env = gymnasium.make(make_target(env_id), max_episode_steps=max_episode_steps,
                                  **(kwargs or {}))
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
