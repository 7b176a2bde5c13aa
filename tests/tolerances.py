"""Tolerances for comparing two computations that differ only in the order of
their floating-point operations (shared prefixes or separate sequences, 1
rank or 2, a vectorised scan or a loop, different batching or padding).

Such a difference is rounding, and how it falls depends on the CPU's vector
width, the BLAS blocking and the thread count: a comparison that passes on one
machine with a hand-picked ``atol`` may fail on another. The tolerance has to
follow from the size of what is summed, in the precision it is summed in.
"""

from __future__ import annotations

import torch


def rounding_tolerance(magnitude: float, terms: int, dtype: torch.dtype = torch.float32
                       ) -> float:
    """How far two evaluations of the same sum of ``terms`` numbers can lie
    apart when only their order differs: ``eps(dtype) * terms * magnitude``.

    ``magnitude`` is the sum of the summands' absolute values (or a bound on
    it). Summing n terms in any order errs by at most (n - 1) u sum|x_i|, with
    u = eps / 2 the unit roundoff (Higham, *Accuracy and Stability of
    Numerical Algorithms*, 2nd ed., §4.2); two orders differ by at most twice
    that, and using n rather than n - 1 leaves room for the rounding of each
    term itself (a product, an exp: a few u of it). It is a worst case: errors
    of different sign cancel and typically grow like sqrt(n). A real bug (a
    token in or out of the loss, a wrong weight) changes the sum by a whole
    term, orders of magnitude above this.

    Only for results that are sums: anything that divides by a near-zero
    quantity afterwards (Adam's ``m / (sqrt(v) + 1e-8)``, a normalisation by a
    small std) amplifies the rounding without bound. Compare what goes into
    such a step (the gradients), not what comes out."""
    return torch.finfo(dtype).eps * max(terms, 1) * magnitude


def logprob_tolerance(policy: torch.nn.Module, ids: torch.Tensor) -> float:
    """How far two computations of the log-probabilities of ``ids`` that
    differ in the order of their sums only can lie apart. A logit sums
    hidden_size products, and the log-softmax moves an error in its logits by
    at most twice that, plus its own rounding over the vocabulary (each
    exp(x - max) at most 1)."""
    from learner.families import body_of

    with torch.no_grad():
        hidden = body_of(policy)(input_ids=ids).last_hidden_state
        weight = policy.get_output_embeddings().weight
        products = (hidden.abs() @ weight.abs().T).max().item()
    config = policy.config
    return (2 * rounding_tolerance(products, config.hidden_size)
            + 2 * rounding_tolerance(1.0, config.vocab_size))
