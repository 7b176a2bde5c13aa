"""Configuration of the recipes (light: the command line reads it without
importing torch)."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.bounds import bound_problems, bounded


@dataclass
class BootstrapConfig:
    """How ``compactionrl bootstrap`` makes the base policy (the recipe is
    reported with every result)."""

    source: str = "runs/tiny-model"
    """The model fine-tuned (the tiny model is built there if missing and
    this is the default); the base policy goes to run.model or ``--out``."""
    demonstrations: int = bounded(4000, ge=1)
    """Demonstration episodes played by the scripted player."""
    drop_fact_probability: float = bounded(0.3, ge=0, le=1)
    """The imperfection: each summary leaves out each fact in the window
    independently with this probability (0 = perfect summaries)."""
    epochs: int = bounded(2, ge=1)
    """Passes over the demonstrations."""
    lr: float = bounded(1e-3, gt=0)
    """AdamW learning rate, decayed linearly to 0 (supervised; RL uses
    learner.lr). Copying a note's value into a summary appears after ~400
    steps at 1e-3; at 3e-3 the tiny model stayed on a plateau that never copies."""
    batch_sequences: int = bounded(16, ge=1)
    """Sequences (a summary segment with the execution segment it extends,
    or a final execution segment) per optimiser step."""
    seed: int = 0
    """Seeds the demonstrations, the recipe's coin flips and the data order."""

    def validate(self, section: str = "bootstrap") -> list[str]:
        return bound_problems(self, section)
