"""A Gymnasium 1.4 text environment written against its public API, as a
user's would be: find a number by bisection, told higher or lower."""

from __future__ import annotations

import string

import gymnasium
from gymnasium import spaces

CHARSET = string.ascii_letters + string.digits + string.punctuation + " \n"


class HigherLower(gymnasium.Env):
    metadata = {"render_modes": []}

    def __init__(self, high: int = 16) -> None:
        self.high = high
        self.observation_space = spaces.Text(max_length=200, charset=CHARSET)
        self.action_space = spaces.Text(max_length=200, charset=CHARSET)
        self.secret = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(1, self.high + 1))
        return (f"Find my number between 1 and {self.high}. Reply with a number.",
                {"tags": {"family": "bisection"}})

    def step(self, action: str):
        try:
            guess = int(action.strip().split()[-1])
        except (ValueError, IndexError):
            return "reply with a number", 0.0, False, False, {}
        if guess == self.secret:
            return "correct", 1.0, True, False, {"success": True}
        return ("higher" if guess < self.secret else "lower"), -0.05, False, False, {}


# Registered under an id of the user's own when the module is imported: an
# actor finds it by the module's name, as "crl_gym_text:CrlHigherLower-v0".
gymnasium.register("CrlHigherLower-v0", entry_point=HigherLower, kwargs={"high": 16})
