"""Per-sample gradients of one parameter, whatever engine produced them.

Quantities never see how an engine stores per-sample gradients. They read
statistics (squared norms, Gram matrix, projections, ...) through the
:class:`IndividualGradients` protocol, of which this module has two
implementations:

* :class:`DenseGradients`: a materialised ``[N, *shape]`` tensor ``b_i = g_i / s``
  (BackPACK's ``BatchGrad`` under a mean-reduced loss has ``s = N``; an engine that
  computes ``g_i`` directly has ``s = 1``);
* :class:`FactoredLinearGradients`: a ``Linear`` weight's ``b_i`` kept as the two
  factors of :class:`LinearFactors`, from which most statistics are far cheaper than
  from the materialised tensor.

A further engine plugs in by handing one of these (or a new implementation of the
protocol) to :class:`~cockpit.param_view.ParamView`; no quantity changes.

All statistics are in terms of the *unscaled* individual gradients ``g_i``, so that
``g = (1/N) sum_i g_i`` is the mini-batch gradient. Implementations compute them from
the stored ``b_i`` and rescale the (small) result, unless the unscaled tensor was
materialised already. Half-precision inputs (bfloat16, float16) are converted to
float32 when wrapped, so every statistic is computed in float32 at least
(:mod:`cockpit.precision`).
"""

from __future__ import annotations

import abc
from typing import Iterator

import torch
from torch import Tensor

from cockpit.precision import upcast


class IndividualGradients(abc.ABC):
    """The per-sample gradients ``g_i`` (``i = 1..N``) of one parameter."""

    @property
    @abc.abstractmethod
    def batch_size(self) -> int:
        """N, the number of samples."""

    @abc.abstractmethod
    def materialize(self) -> Tensor:
        """Return ``g_i`` for every sample, shape ``[N, *param.shape]``."""

    @abc.abstractmethod
    def chunks(self, max_elements: int) -> Iterator[Tensor]:
        """Yield ``g_i`` in blocks of consecutive samples (at least one each).

        Concatenated, the blocks equal :meth:`materialize` bit for bit.
        """

    @abc.abstractmethod
    def mean(self) -> Tensor:
        """Return ``g = (1/N) sum_i g_i``, the parameter's shape."""

    @abc.abstractmethod
    def project(self, direction: Tensor) -> Tensor:
        """Return ``g_i . direction`` for every sample, shape ``[N]``."""

    @abc.abstractmethod
    def batch_l2(self) -> Tensor:
        """Return ``||g_i||^2`` for every sample, shape ``[N]``."""

    @abc.abstractmethod
    def gram(self) -> Tensor:
        """Return ``G_ij = g_i . g_j``, shape ``[N, N]``."""

    @abc.abstractmethod
    def scaled_sum_grad_squared(self) -> Tensor:
        """Return ``(1/N^2) sum_i g_i**2`` elementwise, the parameter's shape.

        This is BackPACK's ``SumGradSquared`` convention (the sum of squares of
        ``g_i / N``); it needs no batch size to reduce.
        """

    def linear_factors(self) -> LinearFactors | None:
        """The factors ``g_i = N * b_i`` of a ``Linear`` weight, if kept as such.

        Statistics that profit from the outer-product structure (histograms)
        use them; ``None`` for any other representation.
        """
        return None


class DenseGradients(IndividualGradients):
    """Per-sample gradients as one tensor ``b`` with ``g_i = scale * b_i``.

    Args:
        scaled: ``b``, shape ``[N, *param.shape]``.
        scale: ``s`` in ``g_i = s * b_i``; ``None`` means ``N`` (BackPACK's
            ``BatchGrad`` under a mean-reduced loss).
    """

    def __init__(self, scaled: Tensor, scale: float | None = None):
        self._b = upcast(scaled)
        self._scale = scaled.shape[0] if scale is None else scale
        self._unscaled: Tensor | None = None

    @property
    def batch_size(self) -> int:
        """N, the number of samples."""
        return self._b.shape[0]

    def _flat_b(self) -> Tensor:
        return self._b.flatten(start_dim=1)

    def _flat_g(self) -> Tensor:
        return self.materialize().flatten(start_dim=1)

    def materialize(self) -> Tensor:
        """Return ``g_i`` (built once, then shared by the other statistics)."""
        if self._unscaled is None:
            self._unscaled = self._b * self._scale if self._scale != 1 else self._b
        return self._unscaled

    def chunks(self, max_elements: int) -> Iterator[Tensor]:
        """Yield blocks of ``g_i``; slices of :meth:`materialize` if it was built."""
        n = self.batch_size
        rows = max(1, max_elements // max(1, self._b[0].numel()))
        for start in range(0, n, rows):
            samples = slice(start, min(start + rows, n))
            if self._unscaled is not None:
                yield self._unscaled[samples]
            else:
                yield self._b[samples] * self._scale

    def mean(self) -> Tensor:
        """Return ``g``."""
        total = self._b.sum(0)
        factor = self._scale / self.batch_size
        return total if factor == 1 else total * factor

    def project(self, direction: Tensor) -> Tensor:
        """Return ``g_i . direction``."""
        flat = direction.reshape(-1).to(self._b.dtype)
        if self._unscaled is not None:
            return self._flat_g() @ flat
        return (self._flat_b() @ flat) * self._scale

    def batch_l2(self) -> Tensor:
        """Return ``||g_i||^2``."""
        if self._unscaled is not None:
            return torch.linalg.vector_norm(self._flat_g(), dim=1).square()
        norms = torch.linalg.vector_norm(self._flat_b(), dim=1)
        return norms.square() * self._scale**2

    def gram(self) -> Tensor:
        """Return ``g_i . g_j``."""
        if self._unscaled is not None:
            flat = self._flat_g()
            return flat @ flat.T
        flat = self._flat_b()
        return (flat @ flat.T) * self._scale**2

    def scaled_sum_grad_squared(self) -> Tensor:
        """Return ``(1/N^2) sum_i g_i**2``."""
        n = self.batch_size
        if self._unscaled is not None:
            g = self._unscaled
            return (g * g).sum(0) / n**2
        squares = (self._b * self._b).sum(0)
        factor = (self._scale / n) ** 2
        return squares if factor == 1 else squares * factor


class LinearFactors:
    """The per-sample gradients of a ``Linear`` weight, kept as two factors.

    ``b_i = sum_l grad_output[i, l]^T input[i, l]`` with ``input`` of shape
    ``[N, L, in]`` and ``grad_output`` of shape ``[N, L, out]`` (``L = 1`` when the
    layer sees plain ``[N, in]`` inputs). Under a mean-reduced loss and BackPACK's
    convention ``b_i = g_i / N``.

    Args:
        inputs: The layer input, shape ``[N, *, in]``.
        grad_output: The gradient of the loss with respect to the layer output, shape
            ``[N, *, out]``.

    Half-precision factors are kept in float32 (their products are then exact).
    """

    __slots__ = ("inputs", "grad_output")

    def __init__(self, inputs: Tensor, grad_output: Tensor):
        n = inputs.shape[0]
        self.inputs = upcast(inputs.detach().reshape(n, -1, inputs.shape[-1]))
        self.grad_output = upcast(
            grad_output.detach().reshape(n, -1, grad_output.shape[-1])
        )

    @property
    def batch_size(self) -> int:
        """N, the number of samples."""
        return self.inputs.shape[0]

    @property
    def positions(self) -> int:
        """L, the number of positions summed over per sample (1 for 2-D inputs)."""
        return self.inputs.shape[1]

    @property
    def shape(self) -> torch.Size:
        """The shape of the materialised per-sample gradients, ``[N, out, in]``."""
        return torch.Size(
            (self.batch_size, self.grad_output.shape[-1], self.inputs.shape[-1])
        )

    def materialize(self, scale: float = 1.0, samples: slice | None = None) -> Tensor:
        """Return ``scale * b_i``, shape ``[N, out, in]``.

        Args:
            scale: Factor applied to the result (``N`` gives unscaled ``g_i``).
            samples: Only these samples (a slice of the batch axis); all by default.
        """
        delta, x = self.grad_output, self.inputs
        if samples is not None:
            delta, x = delta[samples], x[samples]
        out = torch.bmm(delta.transpose(1, 2), x)  # [N, out, L] @ [N, L, in]
        if scale != 1.0:
            out.mul_(scale)
        return out

    def sum(self) -> Tensor:
        """Return ``sum_i b_i``, shape ``[out, in]``."""
        delta = self.grad_output.reshape(-1, self.grad_output.shape[-1])
        return delta.T @ self.inputs.reshape(-1, self.inputs.shape[-1])

    def _materialize_is_cheaper(self, pairwise: bool) -> bool:
        """Whether contracting the factors costs more than materialising ``b_i``."""
        n, positions = self.batch_size, self.positions
        out, inp = self.grad_output.shape[-1], self.inputs.shape[-1]
        pairs = n if pairwise else 1
        factored = n * pairs * positions**2 * (out + inp)
        materialised = n * positions * out * inp + n * pairs * out * inp
        return materialised < factored

    def batch_l2(self) -> Tensor:
        """Return ``||b_i||^2`` for every sample, shape ``[N]``."""
        if self.positions == 1:
            delta, x = self.grad_output[:, 0], self.inputs[:, 0]
            return delta.square().sum(1) * x.square().sum(1)
        if self._materialize_is_cheaper(pairwise=False):
            b = self.materialize().flatten(start_dim=1)
            return torch.linalg.vector_norm(b, dim=1).square()
        # ||b_i||^2 = sum_{l,k} (delta_il . delta_ik) (x_il . x_ik)
        dd = torch.bmm(self.grad_output, self.grad_output.transpose(1, 2))
        xx = torch.bmm(self.inputs, self.inputs.transpose(1, 2))
        return (dd * xx).sum(dim=(1, 2))

    def gram(self) -> Tensor:
        """Return ``G_ij = b_i . b_j``, shape ``[N, N]``."""
        if self.positions == 1:
            delta, x = self.grad_output[:, 0], self.inputs[:, 0]
            return (delta @ delta.T) * (x @ x.T)
        if self._materialize_is_cheaper(pairwise=True):
            b = self.materialize().flatten(start_dim=1)
            return b @ b.T
        # G_ij = sum_{l,k} (delta_il . delta_jk) (x_il . x_jk)
        dd = torch.einsum("nlo,mko->nmlk", self.grad_output, self.grad_output)
        xx = torch.einsum("nli,mki->nmlk", self.inputs, self.inputs)
        return (dd * xx).sum(dim=(2, 3))

    def sum_grad_squared(self) -> Tensor:
        """Return ``sum_i b_i**2`` elementwise, shape ``[out, in]``."""
        if self.positions == 1:
            delta, x = self.grad_output[:, 0], self.inputs[:, 0]
            return delta.square().T @ x.square()
        return self.materialize().square_().sum(0)

    def project(self, direction: Tensor) -> Tensor:
        """Return ``b_i . direction`` for every sample, shape ``[N]``.

        Args:
            direction: A tensor of shape ``[out, in]``.
        """
        direction = direction.to(self.inputs.dtype)
        mapped = self.inputs @ direction.T  # b_i . D = sum_l delta_il^T D x_il
        return (mapped * self.grad_output).sum(dim=(1, 2))


class FactoredLinearGradients(IndividualGradients):
    """A ``Linear`` weight's per-sample gradients from :class:`LinearFactors`.

    Under BackPACK's convention (``b_i = g_i / N``). The ``[N, out, in]`` tensor is
    built only if a quantity asks for it (:meth:`materialize`, :meth:`chunks`).

    Args:
        factors: The factors of ``b_i``.
    """

    def __init__(self, factors: LinearFactors):
        self._factors = factors
        self._unscaled: Tensor | None = None

    @property
    def batch_size(self) -> int:
        """N, the number of samples."""
        return self._factors.batch_size

    def materialize(self) -> Tensor:
        """Return ``g_i`` (built once)."""
        if self._unscaled is None:
            self._unscaled = self._factors.materialize(scale=self.batch_size)
        return self._unscaled

    def chunks(self, max_elements: int) -> Iterator[Tensor]:
        """Yield blocks of ``g_i`` built from the factors, one block at a time."""
        n = self.batch_size
        shape = self._factors.shape
        rows = max(1, max_elements // max(1, shape[1] * shape[2]))
        for start in range(0, n, rows):
            samples = slice(start, min(start + rows, n))
            if self._unscaled is not None:
                yield self._unscaled[samples]
            else:
                yield self._factors.materialize(scale=n, samples=samples)

    def mean(self) -> Tensor:
        """Return ``g = sum_i b_i``."""
        return self._factors.sum()

    def project(self, direction: Tensor) -> Tensor:
        """Return ``g_i . direction`` without building ``g_i``."""
        return self._factors.project(direction) * self.batch_size

    def batch_l2(self) -> Tensor:
        """Return ``||g_i||^2`` from the factors."""
        return self._factors.batch_l2() * self.batch_size**2

    def gram(self) -> Tensor:
        """Return ``g_i . g_j`` from the factors."""
        return self._factors.gram() * self.batch_size**2

    def scaled_sum_grad_squared(self) -> Tensor:
        """Return ``sum_i b_i**2 = (1/N^2) sum_i g_i**2``."""
        return self._factors.sum_grad_squared()

    def linear_factors(self) -> LinearFactors:
        """The factors of ``b_i`` (``g_i = N * b_i``)."""
        return self._factors
