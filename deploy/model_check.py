"""Check an engine's generations against a transformers forward pass.

The learner's importance weights divide by the actors' log-probabilities, so
the engine and the training code must agree on them. ``compactionrl model
sample --check`` and the tests use this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: |delta log p| allowed between an engine and a float32 reference: bf16 has
#: 8 mantissa bits (relative error 2^-8 ~ 0.004 per op); a few layers of
#: accumulated rounding stay well under this.
BF16_LOGPROB_TOLERANCE = 0.05


@dataclass
class Agreement:
    """How one generation compares with the reference."""

    max_logprob_error: float
    """Largest |engine log p - reference log p| over generated tokens."""
    greedy_mismatches: int
    """Generated tokens that are not the reference's argmax, beyond ties:
    the reference puts the engine's token within ``tolerance`` of its max."""
    tokens: int


def reference_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int],
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p of each completion token, max log p at each position) under
    ``model`` in float32 at ``temperature`` (0 = greedy, unscaled),
    teacher-forced on the engine's own tokens."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0], logp.max(dim=-1).values


def compare(model: torch.nn.Module, prompt: list[int], completion: list[int],
            engine_logprobs: list[float], tolerance: float, temperature: float) -> Agreement:
    """Compare one generation (sampled with top_p = 1) with the reference."""
    chosen, best = reference_logprobs(model, prompt, completion, temperature)
    error = (chosen - torch.tensor(engine_logprobs)).abs().max().item() if completion else 0.0
    mismatches = int((best - chosen > tolerance).sum()) if temperature == 0 else 0
    return Agreement(error, mismatches, len(completion))
