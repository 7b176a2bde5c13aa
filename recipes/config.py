"""Configuration of the recipes (light: the command line reads it without
importing torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BootstrapConfig:
    """How ``compactionrl bootstrap`` makes the base policy (the recipe is
    reported with every result)."""

    source: str = "runs/tiny-model"
    """The model fine-tuned (the tiny model is built there if missing and
    this is the default); the base policy goes to run.model or ``--out``."""
    demonstrations: int = 4000
    """Demonstration episodes played by the scripted player."""
    drop_fact_probability: float = 0.3
    """The imperfection: each summary leaves out each fact in the window
    independently with this probability (0 = perfect summaries)."""
    epochs: int = 2
    """Passes over the demonstrations."""
    lr: float = 1e-3
    """AdamW learning rate, decayed linearly to 0 (supervised; RL uses
    learner.lr). Copying a note's value into a summary appears after ~400
    steps at 1e-3; at 3e-3 the tiny model stayed on a plateau that never copies."""
    batch_sequences: int = 16
    """Sequences (a summary segment with the execution segment it extends,
    or a final execution segment) per optimiser step."""
    seed: int = 0
    """Seeds the demonstrations, the recipe's coin flips and the data order."""

    def validate(self, section: str = "bootstrap") -> list[str]:
        problems = []
        if not 0.0 <= self.drop_fact_probability <= 1.0:
            problems.append(f"{section}.drop_fact_probability must be in [0, 1]")
        for name in ("demonstrations", "epochs", "batch_sequences"):
            if getattr(self, name) < 1:
                problems.append(f"{section}.{name} must be >= 1")
        if self.lr <= 0:
            problems.append(f"{section}.lr must be > 0")
        return problems
