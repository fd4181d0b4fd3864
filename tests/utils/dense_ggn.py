"""The GGN of a model's mini-batch loss by brute force, for the curvature tests.

``G = J^T H J`` with ``J`` the Jacobian of all logits in the parameters (one
vector-Jacobian product per logit, through the math attention kernel) and ``H``
the Hessian of the loss in the logits (``torch.autograd.functional.hessian`` of the
mean of the per-sample losses). Nothing of cockpit's reading of the loss (its
``log_softmax``, the row weights) is used. Float64, tiny models only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass
class DenseGGN:
    """What the curvature quantities read, formed from definitions.

    Attributes:
        diagonal: ``diag(G)``, all parameters flattened, float64.
        traces: Per parameter tensor, its block's trace.
        moments: ``M_d = (1/N) sum_i g_{i,d}**2`` (per-sample gradients by a
            loop over the samples), flattened.
    """

    diagonal: torch.Tensor
    traces: torch.Tensor
    moments: torch.Tensor

    def tic_trace(self, epsilon: float = 1e-7) -> float:
        """``sum_d M_d / (sum_d G_dd + epsilon)``."""
        return float(self.moments.sum() / (self.diagonal.sum() + epsilon))

    def tic_diag(self, epsilon: float = 1e-7) -> float:
        """``sum_d M_d / (G_dd + epsilon)``."""
        return float((self.moments / (self.diagonal + epsilon)).sum())


def dense_ggn(case, snapshot, kwargs, targets, chunk: int = 64) -> DenseGGN:
    """The GGN of ``case``'s mean per-sample loss at parameter values ``snapshot``.

    Args:
        case: A :class:`tests.utils.hf_models.Case` (float64 model).
        snapshot: The parameters' values (those with ``requires_grad``).
        kwargs: The model's inputs.
        targets: The targets.
        chunk: Logits per batched vector-Jacobian product.
    """
    names = [n for n, p in case.model.named_parameters() if p.requires_grad]
    leaves = [p.detach().clone().requires_grad_() for p in snapshot]
    sizes = [p.numel() for p in leaves]

    def flat(grads):
        return torch.cat([
            (torch.zeros_like(p) if g is None else g).reshape(-1)
            for g, p in zip(grads, leaves, strict=True)
        ])  # fmt: skip

    with sdpa_kernel(SDPBackend.MATH):
        out = functional_call(case.model, dict(zip(names, leaves)), (), kwargs)
        logits = case.logits(out)
        rows = []
        count = logits.numel()
        for start in range(0, count, chunk):
            eye = torch.eye(count, dtype=logits.dtype)[start : start + chunk]
            if count <= chunk:  # a loop: vmap over a small model's backward is slow
                for vector in eye:
                    grads = torch.autograd.grad(
                        logits, leaves, vector.view_as(logits), retain_graph=True,
                        allow_unused=True,
                    )  # fmt: skip
                    rows.append(flat(grads).unsqueeze(0))
                continue
            grads = torch.autograd.grad(
                logits, leaves, eye.view(-1, *logits.shape), retain_graph=True,
                allow_unused=True, is_grads_batched=True,
            )  # fmt: skip
            rows.append(torch.cat([
                (torch.zeros(len(eye), p.numel(), dtype=p.dtype) if g is None
                 else g.reshape(len(eye), -1))
                for g, p in zip(grads, leaves, strict=True)
            ], 1))  # fmt: skip
        jacobian = torch.cat(rows)  # [logits, D]

        def loss_of(z):
            return case.individual_loss_fn(z.view_as(logits), targets).mean()

        hessian = torch.autograd.functional.hessian(
            loss_of, logits.detach().reshape(-1), vectorize=True
        )
        diagonal = (jacobian * (hessian @ jacobian)).sum(0)

        losses = case.individual_loss_fn(logits, targets)
        moments = torch.zeros_like(diagonal)
        for i in range(losses.shape[0]):
            grads = torch.autograd.grad(
                losses[i], leaves, retain_graph=True, allow_unused=True
            )
            moments += flat(grads) ** 2
        moments /= losses.shape[0]
    traces = torch.stack([block.sum() for block in diagonal.split(sizes)])
    return DenseGGN(diagonal.detach(), traces.detach(), moments.detach())
