"""Exact per-sample gradients through batch norms with mini-batch statistics: designs.

Pure PyTorch (no cockpit): the alternatives to cockpit's batched backward pass per
sample that :mod:`benchmarks.studies.batchnorm_cost` times, part by part.

**The decomposition.** A batch norm that normalises with the mini-batch's statistics
makes sample ``i``'s loss depend on the other samples only through those statistics,
``s_k = (mean_k, var_k)`` per call ``k`` (``2 C_k`` numbers for ``C_k`` channels). Let
``F_i(theta, s)`` be sample ``i``'s loss with every statistic held at a given value (a
function of ``x_i`` alone) and ``s(theta)`` the statistics of the training forward
pass, so ``l_i(theta) = F_i(theta, s(theta))``. The chain rule gives::

    d l_i / d theta = u_i + sum_k J_k^T c_ik,
    u_i  = d F_i / d theta      (statistics held: per sample, one vmap(grad) pass)
    c_ik = d F_i / d s_k        (2 C_k numbers per sample, from the same pass)
    J_k  = d s_k / d theta      (2 C_k x D, the total derivative through the batch,
                                 the same for every sample)

(``c_ik`` is a partial derivative, the other statistics held; ``J_k`` is total, so a
statistic that depends on an earlier one is counted once.)

* :func:`stats_jacobian_gradients` (design A, "low rank") forms ``J_k`` row by row:
  ``S = sum_k 2 C_k`` vector-Jacobian products through the training graph (each over
  the part of the graph before call ``k``), then an ``N x S x D`` product. It beats
  one backward pass per sample (cockpit's engine, design B) only where ``S``,
  weighted by the share of the graph before each batch norm, is below ``N``. For the
  layer right before a batch norm ``J_k`` has a closed form (per channel, the summed
  layer input and the input weighted by the centred output: two batch-level
  matrices), but the statistics of every later batch norm depend on it as well, and
  those rows have no such form.
* :func:`inner_products` (design C): what ``economy`` reads that needs less than
  the per-sample gradients. ``g_i . v`` for one vector ``v`` (the mean gradient:
  InnerTest, OrthoTest) for all samples at once is one forward-mode pass through the
  batch. The squared norms (NormTest, OrthoTest) and the histogram of the ``N x D``
  values (GradHist1d) are not: they need every ``g_i``.

Both are exact (``tests/test_robustness.py`` checks design A against brute force in
float64 on nested, shared, functional and eval-mode batch norms).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.func import functional_call, grad, jvp, vmap

_F = torch.nn.functional


class BatchStatistics:
    """``F.batch_norm`` patched: record the mini-batch statistics, or hold them.

    Only calls that normalise with the batch's statistics (``training=True`` or no
    running statistics) are touched; the others run unchanged.

    Attributes:
        recorded: ``(mean, var)`` of each such call of a recording pass, in call
            order, with their autograd graph (the biased variance, as the norm uses).
        held: While not ``None``, the ``(mean, var)`` each call uses instead.
    """

    def __init__(self):
        self.recorded: list[tuple[Tensor, Tensor]] = []
        self.held: Sequence[tuple[Tensor, Tensor]] | None = None
        self._next = 0

    def start(self, held=None) -> None:
        """Begin a pass: record (``held`` None) or use ``held``, from the first call."""
        self.held, self._next = held, 0

    @contextlib.contextmanager
    def patch(self):
        """Replace ``torch.nn.functional.batch_norm`` inside the block."""
        original = _F.batch_norm

        def batch_norm(
            x,
            running_mean,
            running_var,
            weight=None,
            bias=None,
            training=False,
            momentum=0.1,
            eps=1e-5,
        ):
            if not training and running_mean is not None:
                return original(
                    x, running_mean, running_var, weight, bias, False, momentum, eps
                )
            dims = [d for d in range(x.dim()) if d != 1]
            if self.held is None:
                self.recorded.append((x.mean(dims), x.var(dims, unbiased=False)))
                return original(
                    x, running_mean, running_var, weight, bias, training, momentum, eps
                )
            mean, var = self.held[self._next]
            self._next += 1
            shape = [1, -1] + [1] * (x.dim() - 2)
            y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps)
            if weight is not None:
                y = y * weight.view(shape)
            if bias is not None:
                y = y + bias.view(shape)
            return y

        _F.batch_norm = batch_norm
        try:
            yield self
        finally:
            _F.batch_norm = original


@contextlib.contextmanager
def no_counters(model: torch.nn.Module):
    """BatchNorm layers update no running statistics inside (``torch.func`` passes).

    Train-mode layers then normalise with the batch's statistics as before; eval-mode
    layers keep using their running statistics.
    """
    layers = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        and m.track_running_stats
    ]
    for layer in layers:
        layer.track_running_stats = False
    try:
        yield
    finally:
        for layer in layers:
            layer.track_running_stats = True


def _split(model, names) -> tuple[dict, dict]:
    """Detached ``names`` (differentiated) and the other parameters (held).

    Every parameter is detached: a result that kept a graph to one of them would
    record each later in-place update of it.
    """
    wanted = set(names)
    primals, fixed = {}, {}
    for name, param in model.named_parameters():
        (primals if name in wanted else fixed)[name] = param.detach()
    return primals, fixed


def _frozen_pass(model, names, stats, x, y, loss_fn):
    """``u_i`` (per parameter name) and ``c_ik`` (``[N, 2 C_k]`` per call ``k``)."""
    primals, fixed = _split(model, names)
    held = [(m.detach(), v.detach()) for m, v in stats.recorded]

    def one(ps, st, xi, yi):
        stats.start(st)
        out = functional_call(model, {**fixed, **ps}, (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0)).sum()

    with no_counters(model), stats.patch():
        u, c = vmap(grad(one, argnums=(0, 1)), in_dims=(None, None, 0, 0))(
            primals, held, x, y
        )
    stats.start(None)
    return u, [torch.cat([cm, cv], dim=1) for cm, cv in c]


def _rows(mean: Tensor, var: Tensor, rows: Sequence[int]):
    """Cotangents selecting rows ``rows`` of ``(mean, var)`` (``[R, C]`` each)."""
    channels = mean.shape[0]
    cot_m = mean.new_zeros(len(rows), channels)
    cot_v = var.new_zeros(len(rows), channels)
    for r, row in enumerate(rows):
        (cot_m if row < channels else cot_v)[r, row % channels] = 1
    return cot_m, cot_v


def stats_jacobian_gradients(
    model: torch.nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    names: Sequence[str],
    chunk: int = 64,
) -> list[Tensor]:
    """Design A: ``g_i = u_i + sum_k J_k^T c_ik``, exact (see the module docstring).

    It assumes the batch norms are where the samples mix (other code that mixes
    them, e.g. subtracting the batch mean by hand, is not seen).

    Args:
        model: The model (its batch norms called through ``F.batch_norm``).
        x: The batch.
        y: The targets.
        loss_fn: ``(output, y) -> [N]`` per-sample losses.
        names: The parameters wanted (``model.named_parameters()`` names).
        chunk: Rows of the statistics' Jacobian per batched backward pass.

    Returns:
        ``[N, *shape]`` per name.
    """
    stats = BatchStatistics()
    with stats.patch():
        stats.start(None)
        model(x)  # the training graph, statistics recorded
    params = dict(model.named_parameters())
    wanted = [params[n] for n in names]
    u, c = _frozen_pass(model, names, stats, x, y, loss_fn)
    g = [u[n].clone() for n in names]
    for (mean, var), ck in zip(stats.recorded, c, strict=True):
        total = ck.shape[1]
        if mean.grad_fn is None:  # statistics of the data: no parameter moves them
            continue
        for start in range(0, total, chunk):
            rows = list(range(start, min(start + chunk, total)))
            jk = torch.autograd.grad(
                [mean, var],
                wanted,
                grad_outputs=list(_rows(mean, var, rows)),
                is_grads_batched=True,
                retain_graph=True,
                allow_unused=True,
            )
            for i, j in enumerate(jk):
                if j is not None:
                    g[i].view(len(g[i]), -1).addmm_(ck[:, rows], j.flatten(1))
    return g


def stats_jacobian_parts(
    model: torch.nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    names: Sequence[str],
    rows: int = 16,
    clock: Callable[[], float] = time.process_time,
) -> dict:
    """Time design A's parts; its Jacobian rows from ``rows`` rows per batch norm.

    The recording forward pass and the frozen ``vmap(grad)`` pass are timed whole.
    Of each call's ``2 C_k`` Jacobian rows the first ``rows`` are formed (one batched
    backward pass) and multiplied in; both times are scaled by ``2 C_k / rows``
    (the rows of one call cost alike: the same graph, one more cotangent each).

    Returns:
        Seconds: ``forward``, ``frozen`` (``u_i`` and ``c_ik``), ``jacobian``
        (all ``S`` rows, scaled) and ``product`` (scaled); ``rows`` (``S``), ``calls``
        and ``rows_timed``, and ``u`` (name -> ``u_i``, for the rank check).
    """
    stats = BatchStatistics()
    start = clock()
    with stats.patch():
        stats.start(None)
        model(x)
    forward = clock() - start
    params = dict(model.named_parameters())
    wanted = [params[n] for n in names]
    start = clock()
    u, c = _frozen_pass(model, names, stats, x, y, loss_fn)
    frozen = clock() - start
    g = [u[n].clone() for n in names]
    jacobian = product = 0.0
    total_rows = timed_rows = 0
    for (mean, var), ck in zip(stats.recorded, c, strict=True):
        total = ck.shape[1]
        if mean.grad_fn is None:
            continue
        chosen = list(range(min(rows, total)))
        start = clock()
        jk = torch.autograd.grad(
            [mean, var],
            wanted,
            grad_outputs=list(_rows(mean, var, chosen)),
            is_grads_batched=True,
            retain_graph=True,
            allow_unused=True,
        )
        jacobian += (clock() - start) * total / len(chosen)
        start = clock()
        for i, j in enumerate(jk):
            if j is not None:
                g[i].view(len(g[i]), -1).addmm_(ck[:, chosen], j.flatten(1))
        product += (clock() - start) * total / len(chosen)
        total_rows += total
        timed_rows += len(chosen)
        del jk
    return {
        "forward": forward,
        "frozen": frozen,
        "jacobian": jacobian,
        "product": product,
        "rows": total_rows,
        "calls": len(stats.recorded),
        "rows_timed": timed_rows,
        "u": u,
    }


def inner_products(
    model: torch.nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    names: Sequence[str],
    vector: Sequence[Tensor],
) -> Tensor:
    """Design C: ``g_i . v`` for every sample, by one forward-mode pass (exact).

    Args:
        model: The model, in the mode of the training step.
        x: The batch.
        y: The targets.
        loss_fn: ``(output, y) -> [N]``.
        names: The parameters ``v`` lives on.
        vector: ``v``, one tensor per name.

    Returns:
        ``[N]``: ``sum over names of <d l_i / d p, v_p>``.
    """
    primals, fixed = _split(model, names)
    tangents = {n: v.detach() for n, v in zip(names, vector, strict=True)}

    def losses(ps):
        return loss_fn(functional_call(model, {**fixed, **ps}, (x,)), y)

    with no_counters(model):
        _, products = jvp(losses, (primals,), (tangents,))
    return products
