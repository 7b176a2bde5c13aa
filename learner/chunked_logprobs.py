"""The output layer's log-probabilities a chunk of positions at a time, so
that float32 logits of a whole sequence never exist at once. Imports only
torch: bench/gpu_check.py runs it from the checkout on a machine that has
nothing else of the project's dependencies, so that what it times is the
learner's own kernel."""

from __future__ import annotations

import torch
from torch.nn import functional as F


class ChunkedLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[target] per row of ``hidden`` [N, H],
    ``chunk`` rows at a time, in the shape of ``targets`` (N elements; a
    tensor of its own, not a view, as FSDP2 wants a module's output).
    Forward keeps nothing of a chunk but its results; backward computes the
    chunk's logits again. Per chunk the operations are those of the whole
    pass (logits in the weights' dtype, then float32; the log-softmax
    gradient, rounded back to the weights' dtype), so values and gradients
    differ from it by rounding only: sums over rows in another order. The
    output layer's gradient is summed over chunks in float32 and rounded to
    the weights' dtype once, as the whole pass's one product is: summed in
    bf16, each chunk's addition would round the running sum again."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, hidden: torch.Tensor,
                weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        out = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        flat_out, targets = out.view(-1), targets.reshape(-1)
        for start in range(0, len(targets), chunk):
            rows = slice(start, start + chunk)
            logp = torch.log_softmax(F.linear(hidden[rows], weight).float(), dim=-1)
            flat_out[rows] = logp.gather(-1, targets[rows, None])[:, 0]
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        hidden, weight, targets = ctx.saved_tensors
        grad = grad.reshape(-1)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, len(targets), ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            # d log_softmax(x)_t / dx = onehot(t) - softmax(x); softmax as
            # exp(log_softmax), as autograd's log-softmax backward takes it
            grad_logits = torch.log_softmax(F.linear(hidden[rows], weight).float(), dim=-1)
            grad_logits.exp_().mul_(-grad[rows, None])
            grad_logits.scatter_add_(1, targets[rows, None], grad[rows, None])
            grad_logits = grad_logits.to(weight.dtype)
            grad_hidden[rows] = grad_logits @ weight
            if weight.dtype == torch.float32:
                grad_weight.addmm_(grad_logits.t(), hidden[rows])
            else:  # the chunk's product as the whole pass rounds it, summed in float32
                grad_weight += (grad_logits.t() @ hidden[rows]).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None
