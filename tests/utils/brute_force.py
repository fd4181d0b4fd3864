"""Brute-force references: quantities recomputed from their definitions.

Everything here uses plain autograd on a functional copy of the model (parameters
substituted with ``torch.func.functional_call``), loops over samples and works in
float64. Nothing from ``cockpit`` is imported.
"""

from __future__ import annotations

import torch
from torch.func import functional_call


def _named(problem):
    return [name for name, p in problem.model.named_parameters() if p.requires_grad]


def batch_loss(problem, params, x, y):
    """The mean-reduced loss at ``params`` on ``(x, y)``."""
    outputs = functional_call(problem.model, dict(zip(_named(problem), params)), (x,))
    return problem.individual_loss_fn(outputs, y).mean()


def individual_losses(problem, params, x, y):
    outputs = functional_call(problem.model, dict(zip(_named(problem), params)), (x,))
    return problem.individual_loss_fn(outputs, y)


def individual_gradients(problem, params, x, y):
    """``g_i`` per sample: a list (per parameter) of tensors ``[N, *shape]``."""
    per_param = [[] for _ in params]
    for i in range(x.shape[0]):
        leaves = [p.detach().clone().requires_grad_(True) for p in params]
        loss_i = individual_losses(problem, leaves, x[i : i + 1], y[i : i + 1]).sum()
        for k, g in enumerate(torch.autograd.grad(loss_i, leaves)):
            per_param[k].append(g)
    return [torch.stack(gs) for gs in per_param]


def gradient(problem, params, x, y):
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    return list(torch.autograd.grad(batch_loss(problem, leaves, x, y), leaves))


def flatten(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def hessian(problem, params, x, y):
    """The dense Hessian of the mini-batch loss w.r.t. all parameters, ``[D, D]``."""
    shapes = [p.shape for p in params]
    sizes = [p.numel() for p in params]

    def f(flat):
        pieces = torch.split(flat, sizes)
        return batch_loss(problem, [t.reshape(s) for t, s in zip(pieces, shapes)], x, y)

    return torch.autograd.functional.hessian(f, flatten(params).detach())


def ggn(problem, params, x, y):
    """The dense GGN matrix ``J^T H_out J`` of the mini-batch loss."""
    shapes = [p.shape for p in params]
    sizes = [p.numel() for p in params]
    names = _named(problem)

    def model_out(flat):
        pieces = torch.split(flat, sizes)
        ps = dict(zip(names, [t.reshape(s) for t, s in zip(pieces, shapes)]))
        return functional_call(problem.model, ps, (x,))

    flat = flatten(params).detach()
    out = model_out(flat)
    jac = torch.autograd.functional.jacobian(model_out, flat).reshape(out.numel(), -1)

    def loss_of_out(o):
        return problem.individual_loss_fn(o.reshape(out.shape), y).mean()

    h_out = torch.autograd.functional.hessian(loss_of_out, out.detach().reshape(-1))
    return jac.T @ h_out @ jac


def split_diagonal(matrix, params):
    """Split the diagonal of a ``[D, D]`` matrix into per-parameter pieces."""
    return list(torch.split(torch.diagonal(matrix), [p.numel() for p in params]))
