"""The generalised Gauss-Newton of a cross-entropy loss, estimated on any model.

BackPACK forms the GGN's diagonal only for models it can backpropagate through.
For the rest, the GGN of a loss built on log-probabilities is estimated from
first-order passes alone (no second derivative of the network, so fused attention
needs nothing special):

The loss ``L`` is read off its autograd graph: it must reach the parameters only
through one ``log_softmax`` (``F.cross_entropy``, ``nn.CrossEntropyLoss``, a custom
sequence loss) and be linear in its output ``log p`` (checked: the second
derivative of ``L`` with respect to ``log p`` vanishes). Then
``L = sum_r w_r^T log p_r`` over the rows ``r`` (tokens, samples) with
``w_r = dL / d log p_r``, and since every component of ``log_softmax`` has the
Hessian ``-(diag p - p p^T)`` in the logits ``z``, the GGN is exactly::

    G = sum_r c_r J_r^T (diag p_r - p_r p_r^T) J_r,   c_r = -sum_k w_rk >= 0

(any label smoothing, class weights or ignored rows are in ``c_r``). With a label
``y_r`` drawn from ``p_r``, ``s_r = sqrt(c_r) (p_r - e_{y_r})`` has
``E[s_r s_r^T] = c_r (diag p_r - p_r p_r^T)``, and ``v = sum_r J_r^T s_r`` is one
vector-Jacobian product, from ``log p`` with ``-sqrt(c_r) e_{y_r}`` (the backward of
``log_softmax`` turns it into ``s_r``). Rows are drawn independently and ``s_r`` has
mean zero, so ``E[v o v] = diag(G)``: the Monte-Carlo GGN, averaged over ``samples``
draws (one batched backward pass). Each draw's per-parameter ``||v_p||**2`` is an
unbiased trace; their spread is the standard error.

Where rows times classes are few, :meth:`Head.exact` forms the diagonal exactly
instead, one product per row and class. Both are tested against the dense float64
GGN (``tests/curvature/test_ggn_estimate.py``); :mod:`cockpit.curvature.source`
chooses them as the curvature of HessTrace and the TIC quantities where BackPACK
cannot form it (:mod:`cockpit.step.features.curvature` forms them at the step).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from cockpit.curvature.hutchinson import TraceEstimate, _block_sums
from cockpit.precision import compute_dtype, upcast

#: The most elements of output gradients of ``log p`` held at once (a batch of
#: drawn labels is as large as ``log p`` per draw: a language model's logits).
MAX_OUTPUT_ELEMENTS = 2**26


class NotCrossEntropy(ValueError):
    """The loss is not one the GGN estimate can read (the message says why)."""


def _walk(root, stop=None):
    """The nodes of the graph below ``root`` (not below ``stop``)."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        if node is not stop:
            stack.extend(child for child, _ in node.next_functions)


def log_probabilities(loss: Tensor, params: Sequence[Tensor]) -> tuple[Tensor, int]:
    """The ``log_softmax`` output that ``loss`` reaches the parameters through.

    Returns:
        ``(log p, class dimension)``.

    Raises:
        NotCrossEntropy: Without exactly one ``log_softmax``, or where the loss
            reaches a parameter another way (a penalty on the weights).
    """
    nodes = [
        n for n in _walk(loss.grad_fn) if type(n).__name__ == "LogSoftmaxBackward0"
    ]
    if len(nodes) != 1:
        raise NotCrossEntropy(
            f"its loss has {len(nodes)} log_softmax operations in its graph, not "
            "one (the GGN estimate needs a cross-entropy loss on the model's logits)"
        )
    (node,) = nodes
    wanted = {id(p) for p in params}
    for other in _walk(loss.grad_fn, stop=node):
        variable = getattr(other, "variable", None)
        if other is not node and variable is not None and id(variable) in wanted:
            raise NotCrossEntropy(
                "its loss depends on parameters other than through the model's "
                "log-probabilities (e.g. a penalty on the weights), whose curvature "
                "the GGN estimate leaves out"
            )
    log_p = node._saved_result
    dim = node._saved_dim % log_p.dim()
    return log_p, dim


def row_weights(loss: Tensor, log_p: Tensor, dim: int) -> Tensor:
    """``c_r = -sum_k dL / d log p_rk`` per row, checking ``L`` is linear in ``log p``.

    Raises:
        NotCrossEntropy: If ``L`` is not linear in ``log p`` or a weight is negative.
    """
    (grad,) = torch.autograd.grad(loss, log_p, retain_graph=True, create_graph=True)
    if grad.grad_fn is not None:
        direction = torch.randn_like(log_p)
        (second,) = torch.autograd.grad(
            grad, log_p, direction, retain_graph=True, allow_unused=True
        )
        if second is not None and bool(second.abs().max() > 0):
            raise NotCrossEntropy(
                "its loss is not linear in the log-probabilities (e.g. a focal "
                "loss), so the GGN is not that of a cross-entropy"
            )
    weights = -grad.detach().sum(dim)
    scale = float(grad.detach().abs().max())
    if bool((weights < -1e-6 * scale).any()):
        raise NotCrossEntropy(
            "its loss has negative weights on log-probabilities, so its GGN is not "
            "positive semi-definite"
        )
    return weights.clamp(min=0)


class Head:
    """The cross-entropy head of a loss: ``log p``, row weights and probabilities.

    Read once per step (:func:`log_probabilities`, :func:`row_weights`); the
    estimates below multiply vectors from ``log p`` back to the parameters.

    Args:
        loss: The mini-batch loss, with its graph.
        params: The parameters.

    Raises:
        NotCrossEntropy: Where the loss is not a cross-entropy on log-probabilities.
    """

    def __init__(self, loss: Tensor, params: Sequence[Tensor]):
        self.params = list(params)
        self.log_p, self.dim = log_probabilities(loss, self.params)
        weights = row_weights(loss, self.log_p, self.dim)
        self.moved_shape = self.log_p.movedim(self.dim, -1).shape
        self.classes = self.moved_shape[-1]
        #: ``sqrt(c_r)`` per row, on the loss's device.
        self.root = upcast(weights.reshape(-1)).sqrt()
        self.sizes = [p.numel() for p in self.params]
        self.shapes = [p.shape for p in self.params]
        self._cdf = None

    @property
    def rows(self) -> int:
        """Rows with a positive weight (tokens or samples the loss counts)."""
        return int((self.root > 0).sum())

    @property
    def exact_products(self) -> int:
        """Vector-Jacobian products of the exact diagonal (:meth:`exact`)."""
        return self.rows * self.classes

    def probabilities(self) -> Tensor:
        """``p`` as ``[rows, classes]`` (upcast, on the loss's device)."""
        moved = self.log_p.detach().movedim(self.dim, -1)
        return upcast(moved.reshape(-1, self.classes)).exp()

    def _chunk(self, chunk: int, elements: int | None = None) -> int:
        """Draws per pass: each holds an output gradient of ``log p``'s size.

        ``elements``: of the joined batch's ``log p`` (data-parallel), where the
        count must be the same on every process; default this one's.
        """
        elements = self.log_p.numel() if elements is None else elements
        return max(1, min(chunk, MAX_OUTPUT_ELEMENTS // max(1, elements)))

    def _products(self, outputs: Tensor):
        """``outputs`` ``[k, rows, classes]`` back to the parameters, squared."""
        count = outputs.shape[0]
        outputs = outputs.reshape(count, *self.moved_shape).movedim(-1, self.dim + 1)
        outputs = outputs.to(device=self.log_p.device, dtype=self.log_p.dtype)
        grads = _vector_jacobian(self.log_p, self.params, outputs)
        return [
            upcast(g.detach()) ** 2
            if g is not None
            else torch.zeros(count, *p.shape, dtype=compute_dtype(p.dtype),
                             device=p.device)
            for g, p in zip(grads, self.params, strict=True)
        ]  # fmt: skip

    def labels(self, count: int, generator, columns=None) -> Tensor:
        """``count`` labels per row drawn from ``p`` (``[count, rows]``).

        By the inverse of the cumulative distribution, on the loss's device, from
        uniform numbers of ``generator`` (drawn on its device, the parameters'):
        no copy of ``p`` leaves the device. ``columns`` ``(first, total)``: the
        rows are ``first, ...`` of a joined batch of ``total`` rows (data-parallel):
        the numbers are drawn for all of them, and this process's used, so every
        process draws the labels one process on the joined batch would.
        """
        if self._cdf is None:
            self._cdf = self.probabilities().cumsum(-1)
        cdf = self._cdf
        first, total = (0, cdf.shape[0]) if columns is None else columns
        uniform = torch.rand(count, total, generator=generator,
                             dtype=torch.float64, device=generator.device)  # fmt: skip
        uniform = uniform[:, first : first + cdf.shape[0]]
        uniform = uniform.to(device=cdf.device, dtype=cdf.dtype) * cdf[:, -1]
        found = torch.searchsorted(cdf, uniform.T.contiguous(), right=True)
        return found.clamp(max=self.classes - 1).T

    def draws(
        self, samples: int, generator, chunk: int = 4, columns=None, elements=None
    ) -> TraceEstimate:
        """The Monte-Carlo GGN from ``samples`` drawn labels per row (see the module).

        Args:
            samples: Draws (at least 2).
            generator: Random source of the labels (CPU).
            chunk: Draws per batched backward pass (memory: ``chunk`` gradients
                and output gradients of ``log p``'s size, fewer where that is
                large, :data:`MAX_OUTPUT_ELEMENTS`).
            columns: Data-parallel: this process's rows of the joined batch
                (:meth:`labels`).
            elements: Data-parallel: ``log p``'s elements over the joined batch.

        Returns:
            The estimate (``traces``: per draw, each parameter's ``||v_p||**2``).
        """
        samples = max(2, int(samples))
        chunk = self._chunk(chunk, elements)
        totals = [torch.zeros_like(p, dtype=compute_dtype(p.dtype))
                  for p in self.params]  # fmt: skip
        traces = []
        rows = self.root.shape[0]
        done = 0
        while done < samples:
            count = min(chunk, samples - done)
            labels = self.labels(count, generator, columns)
            outputs = torch.zeros(count, rows, self.classes, dtype=self.log_p.dtype,
                                  device=self.log_p.device)  # fmt: skip
            values = -self.root.to(self.log_p.dtype).expand(count, -1)
            outputs.scatter_(2, labels.unsqueeze(2), values.unsqueeze(2))
            squares = self._products(outputs)
            outputs = None
            for k, square in enumerate(squares):
                totals[k] += square.sum(0)
            flat = torch.cat([s.reshape(count, -1) for s in squares], dim=1)
            traces.extend(_block_sums(row, self.sizes) for row in flat)
            done += count
        return TraceEstimate(
            [t / samples for t in totals],
            torch.stack(traces),
            samples,
            ggn_method(samples),
        )

    def exact(self, chunk: int = 8) -> TraceEstimate:
        """The GGN's diagonal exactly: one product per row and class.

        ``diag(G) = sum_rk c_r p_rk (J_r^T (e_k - p_r))**2`` (the middle matrix
        is ``sum_k p_k (e_k - p)(e_k - p)^T``); the product of row ``r`` and class
        ``k`` starts from ``sqrt(c_r p_rk) e_k`` at ``log p_r`` (the backward of
        ``log_softmax`` subtracts ``p_r``). :attr:`exact_products` of them.

        Returns:
            The diagonal, with ``traces`` its block traces as a single row (no
            spread: the estimate is exact).
        """
        probs, root = self.probabilities(), self.root
        rows, classes = probs.shape
        device = probs.device
        scale = (probs * root.unsqueeze(1) ** 2).sqrt()  # sqrt(c_r p_rk)
        pairs = (root > 0).nonzero().reshape(-1)
        pairs = torch.cartesian_prod(pairs, torch.arange(classes, device=device))
        chunk = self._chunk(chunk)
        totals = [torch.zeros_like(p, dtype=compute_dtype(p.dtype))
                  for p in self.params]  # fmt: skip
        for start in range(0, pairs.shape[0], chunk):
            block = pairs[start : start + chunk]
            count = block.shape[0]
            outputs = torch.zeros(count, rows, classes, dtype=scale.dtype,
                                  device=device)  # fmt: skip
            row, column = block[:, 0], block[:, 1]
            draw = torch.arange(count, device=device)
            outputs[draw, row, column] = scale[row, column]
            for k, square in enumerate(self._products(outputs)):
                totals[k] += square.sum(0)
        flat = torch.cat([t.reshape(-1) for t in totals])
        return TraceEstimate(
            totals,
            _block_sums(flat, self.sizes).unsqueeze(0),
            pairs.shape[0],
            exact_method(pairs.shape[0]),
        )


def monte_carlo_ggn(
    loss: Tensor,
    params: Sequence[Tensor],
    samples: int,
    generator,
    chunk: int = 4,
) -> TraceEstimate:
    """Estimate the GGN's diagonal of ``loss`` (see the module).

    The graph of ``loss`` is kept (``retain_graph``) for the user's backward pass.

    Args:
        loss: The mini-batch loss, with its graph.
        params: The parameters.
        samples: Monte-Carlo draws (at least 2).
        generator: Random source of the drawn labels (CPU).
        chunk: Draws per batched backward pass (memory: ``chunk`` gradients).

    Returns:
        The estimate (``traces``: per draw, each parameter's ``||v_p||**2``).

    Raises:
        NotCrossEntropy: Where the loss is not a cross-entropy on log-probabilities.
    """
    return Head(loss, params).draws(samples, generator, chunk)


def exact_ggn(loss: Tensor, params: Sequence[Tensor], chunk: int = 8):
    """The exact GGN diagonal of ``loss`` (:meth:`Head.exact`)."""
    return Head(loss, params).exact(chunk)


def _vector_jacobian(log_p: Tensor, params, outputs: Tensor):
    """Products of ``outputs`` (batched) with ``d log p / d params``, per draw."""
    try:
        return torch.autograd.grad(
            log_p, params, outputs, retain_graph=True, allow_unused=True,
            is_grads_batched=True,
        )  # fmt: skip
    except RuntimeError as error:  # an operator without a batching rule
        if "vmap" not in str(error) and "batch" not in str(error).lower():
            raise
    rows = [
        torch.autograd.grad(log_p, params, o, retain_graph=True, allow_unused=True)
        for o in outputs
    ]
    return tuple(
        None if pieces[0] is None else torch.stack(pieces)
        for pieces in zip(*rows, strict=True)
    )


def exact_method(products: int) -> str:
    """How the exact GGN diagonal is made (the coverage report's words)."""
    return (
        f"exact GGN of the cross-entropy, {products} products (one per row and class)"
    )


def ggn_method(samples: int) -> str:
    """How a GGN estimate is made (the coverage report's words)."""
    return (
        f"Monte-Carlo GGN of the cross-entropy, {samples} drawn labels (one backward "
        "pass each)"
    )
