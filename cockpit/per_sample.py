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

    @property
    def formed(self) -> bool:
        """Whether ``g_i`` exist as a tensor (statistics of them cost no forming)."""
        return False

    def centered(self, mean: Tensor, elementwise: bool = False) -> Centered:
        """Statistics of ``c_i = g_i - mean``, formed from ``g_i`` block by block.

        The two-pass form of the spread: the mean is subtracted from each
        per-sample gradient before anything is squared, so nothing cancels
        (unlike ``sum_i ||g_i||^2 - N ||g||^2``). ``mean`` is the rounded mean
        ``g + d``; the drift ``sum_i c_i = -N d`` lets callers remove its
        contribution ``N ||d||^2`` exactly (Chan, Golub and LeVeque's corrected
        two-pass algorithm; :class:`Centered`).

        Args:
            mean: ``g`` as computed (the parameter's shape).
            elementwise: Also return ``sum_i c_i**2`` elementwise.

        Returns:
            The centered statistics.
        """
        mean = mean.to(self.dtype)
        flat_mean = mean.reshape(-1)
        norms, dots, drift, squares = [], [], None, None
        for block in self.chunks(1 << 20):
            centred = block - mean
            flat = centred.reshape(centred.shape[0], -1)
            norms.append(torch.linalg.vector_norm(flat, dim=1).square())
            dots.append(flat @ flat_mean)
            part = centred.sum(0)
            drift = part if drift is None else drift + part
            if elementwise:
                part = centred.square_().sum(0)
                squares = part if squares is None else squares + part
        return Centered(torch.cat(norms), torch.cat(dots), drift, squares)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype statistics are computed in."""
        return self.mean().dtype


class Centered:
    """Statistics of the centred per-sample gradients ``c_i = g_i - mean``.

    Attributes:
        norms: ``||c_i||^2`` per sample, ``[N]``.
        dots: ``c_i . mean`` per sample, ``[N]``.
        drift: ``sum_i c_i`` (the parameter's shape): ``-N`` times the rounding
            error of ``mean``.
        squares: ``sum_i c_i**2`` elementwise, if asked for.
    """

    __slots__ = ("norms", "dots", "drift", "squares")

    def __init__(self, norms, dots, drift, squares=None):
        self.norms, self.dots, self.drift, self.squares = norms, dots, drift, squares

    @property
    def batch_size(self) -> int:
        """N, the number of samples."""
        return self.norms.shape[0]

    def spread(self) -> Tensor:
        """``sum_i ||g_i - g||^2`` with the mean's rounding removed (``>= 0``)."""
        n = self.batch_size
        spread = self.norms.sum() - self.drift.square().sum() / n
        return spread.clamp(min=0)

    def elementwise_spread(self) -> Tensor:
        """``sum_i (g_i,d - g_d)^2`` for every coordinate ``d`` (``>= 0``)."""
        spread = self.squares - self.drift.square() / self.batch_size
        return spread.clamp(min=0)


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

    @property
    def formed(self) -> bool:
        """Always: the (scaled) per-sample gradients are a tensor."""
        return True

    @property
    def dtype(self) -> torch.dtype:
        """The dtype statistics are computed in."""
        return self._b.dtype

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

    @property
    def formed(self) -> bool:
        """Whether :meth:`materialize` was called."""
        return self._unscaled is not None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype statistics are computed in."""
        return self._factors.inputs.dtype

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


class OuterTerm:
    """One use of a weight: ``b_i = sum_t rows[i, t] (outer) cols[i, t]``.

    A linear map on sequences gets such a gradient from each call: for
    ``torch.nn.Linear`` (weight ``[out, in]``) ``rows`` is the gradient at the output
    and ``cols`` the input; for the transposed layout of Hugging Face's ``Conv1D``
    (weight ``[in, out]``) the two swap. An embedding's rows are one-hot: ``rows``
    then holds the indices (an integer tensor ``[N, T]``) and ``num_rows`` the size
    of the table.

    Args:
        rows: ``[N, T, R]`` floating, or ``[N, T]`` integer indices into ``R`` rows.
        cols: ``[N, T, C]``.
        num_rows: ``R`` (read off ``rows`` unless they are indices).
    """

    __slots__ = ("rows", "cols", "num_rows")

    def __init__(self, rows: Tensor, cols: Tensor, num_rows: int | None = None):
        self.cols = upcast(cols.detach())
        if rows.is_floating_point():
            self.rows = upcast(rows.detach())
            self.num_rows = rows.shape[-1]
        else:
            if num_rows is None:
                raise ValueError("indexed rows need num_rows (the table's size)")
            self.rows = rows.detach()
            self.num_rows = num_rows

    @property
    def indexed(self) -> bool:
        """Whether the rows are one-hot (given by indices)."""
        return not self.rows.is_floating_point()

    @property
    def positions(self) -> int:
        """``T``, the positions summed over per sample."""
        return self.cols.shape[1]

    def row_products(self, other: OuterTerm, pairwise: bool = False) -> Tensor:
        """Products of the rows of two terms.

        ``rows[i, t] . other.rows[i, u]``, ``[N, T, U]``; pairwise
        ``rows[i, t] . other.rows[j, u]``, ``[N, N, T, U]``.
        """
        if self.indexed and other.indexed:
            a, b = self.rows, other.rows
            if pairwise:
                return (a[:, None, :, None] == b[None, :, None, :]).to(self.cols.dtype)
            return (a[:, :, None] == b[:, None, :]).to(self.cols.dtype)
        if self.indexed or other.indexed:
            index, dense = (self, other) if self.indexed else (other, self)
            if pairwise:  # dense.rows[j, u, index.rows[i, t]]
                picked = dense.rows.permute(2, 0, 1)[index.rows]  # [N, T, N, U]
                picked = picked.permute(0, 2, 1, 3)  # [N(i), N(j), T, U]
                return picked if index is self else picked.permute(1, 0, 3, 2)
            # dense.rows[i, u, index.rows[i, t]] -> [N, T, U]
            gathered = torch.gather(
                dense.rows.transpose(1, 2),
                1,
                index.rows.unsqueeze(-1).expand(-1, -1, dense.positions),
            )
            return gathered if index is self else gathered.transpose(1, 2)
        if pairwise:
            return torch.einsum("ntr,mur->nmtu", self.rows, other.rows)
        return torch.bmm(self.rows, other.rows.transpose(1, 2))

    def col_products(self, other: OuterTerm, pairwise: bool = False) -> Tensor:
        """Products of the columns of two terms (shapes as :meth:`row_products`)."""
        if pairwise:
            return torch.einsum("ntc,muc->nmtu", self.cols, other.cols)
        return torch.bmm(self.cols, other.cols.transpose(1, 2))

    def dot(self, other: OuterTerm) -> Tensor:
        """``b_i . other.b_i`` for every sample, ``[N]``, without forming ``b_i``."""
        rows = self.row_products(other)
        rows.mul_(self.col_products(other))
        return rows.sum(dim=(1, 2))

    def pairwise_dot(self, other: OuterTerm) -> Tensor:
        """``b_i . other.b_j`` for every pair of samples, ``[N, N]``."""
        rows = self.row_products(other, pairwise=True)
        rows.mul_(self.col_products(other, pairwise=True))
        return rows.sum(dim=(2, 3))

    def add_to(self, out: Tensor | None, samples: slice, scale: float) -> Tensor:
        """Add ``scale * b_i`` of ``samples`` to ``out`` (``[k, R, C]``, in place).

        ``out=None`` starts a new buffer. The scale multiplies the smaller factor.
        """
        rows, cols = self.rows[samples], self.cols[samples]
        k, t = cols.shape[:2]
        if not self.indexed:
            if scale != 1:
                if rows.shape[-1] <= cols.shape[-1]:
                    rows = rows * scale
                else:
                    cols = cols * scale
            if out is None:
                return torch.bmm(rows.transpose(1, 2), cols)
            return out.baddbmm_(rows.transpose(1, 2), cols)
        if out is None:
            out = cols.new_zeros(k, self.num_rows, cols.shape[-1])
        if scale != 1:
            cols = cols * scale
        offsets = torch.arange(k, device=cols.device).unsqueeze(1) * self.num_rows
        flat = (rows + offsets).reshape(-1)
        out.view(-1, out.shape[-1]).index_add_(0, flat, cols.reshape(k * t, -1))
        return out

    def project(self, direction: Tensor) -> Tensor:
        """``b_i . direction`` for every sample (``direction``: ``[R, C]``).

        ``sum_t rows_it . (direction cols_it)``: one product of the size of the
        layer's forward pass, mapped to the smaller of the two sides.
        """
        direction = direction.to(self.cols.dtype)
        if self.indexed:
            picked = direction[self.rows]  # [N, T, C]
            return (picked * self.cols).sum(dim=(1, 2))
        if self.num_rows < self.cols.shape[-1]:
            mapped, other = self.cols @ direction.T, self.rows  # [N, T, R]
        else:
            mapped, other = self.rows @ direction, self.cols  # [N, T, C]
        return mapped.mul_(other).sum(dim=(1, 2))

    def total(self) -> Tensor:
        """``sum_i b_i``, ``[R, C]``."""
        cols = self.cols.reshape(-1, self.cols.shape[-1])
        if self.indexed:
            out = cols.new_zeros(self.num_rows, cols.shape[-1])
            return out.index_add_(0, self.rows.reshape(-1), cols)
        return self.rows.reshape(-1, self.rows.shape[-1]).T @ cols

    # --- costs, in multiply-adds --------------------------------------------------
    def materialize_cost(self) -> int:
        """Multiply-adds to add ``b_i`` of every sample to a buffer."""
        n, t, c = self.cols.shape
        return n * t * c * (1 if self.indexed else self.num_rows)

    def dot_cost(self, other: OuterTerm, pairs: int = 1) -> int:
        """Multiply-adds of :meth:`dot` (``pairs = N``: :meth:`pairwise_dot`)."""
        n, t, c = self.cols.shape
        rows = 1 if self.indexed or other.indexed else self.num_rows
        return n * pairs * t * other.positions * (rows + c)


class OuterProductGradients(IndividualGradients):
    """Per-sample gradients of a weight as a sum of :class:`OuterTerm` s.

    ``g_i = scale * b_i`` with ``b_i`` the sum of the terms (one per use of the
    weight in the forward pass). Norms, Gram matrices and projections come from the
    factors where that is cheaper than forming ``b_i`` (for norms of a layer on
    sequences of length ``T``: ``T^2 (R + C)`` against ``T R C`` multiply-adds per
    sample, the "ghost norm" of Li et al. 2022 and Bu et al. 2023); the elements
    (histograms, second moments) are formed and kept once (:meth:`densify`) or
    block by block.

    Args:
        terms: The uses of the weight.
        shape: The weight's shape ``(R, C)``.
        scale: ``s`` in ``g_i = s * b_i`` (``N`` for the gradient of a mean loss).
        total: ``sum_i b_i`` if known (the weight's gradient in the backward pass),
            else it is summed from the factors when asked for.
    """

    def __init__(
        self,
        terms: list[OuterTerm],
        shape: torch.Size,
        scale: float,
        total: Tensor | None = None,
    ):
        if not terms:
            raise ValueError("OuterProductGradients needs at least one term")
        self._terms = terms
        self._shape = torch.Size(shape)
        self._scale = scale
        self._total = None if total is None else upcast(total.detach())
        self._dense: Tensor | None = None  # g_i, once formed

    @property
    def batch_size(self) -> int:
        """N, the number of samples."""
        return self._terms[0].cols.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype statistics are computed in."""
        return self._terms[0].cols.dtype

    def _numel(self) -> int:
        return self._shape.numel()

    def _block(self, samples: slice) -> Tensor:
        """``g_i`` of ``samples``, freshly formed: ``[k, *shape]``."""
        k = len(range(*samples.indices(self.batch_size)))
        out = None
        for term in sorted(self._terms, key=lambda term: term.indexed):
            out = term.add_to(out, samples, self._scale)
        return out.view(k, *self._shape)

    def densify(self) -> Tensor:
        """Form ``g_i`` of all samples once; every statistic reads them from then on."""
        if self._dense is None:
            self._dense = self._block(slice(0, self.batch_size))
        return self._dense

    @property
    def dense(self) -> bool:
        """Whether ``g_i`` were formed (:meth:`densify`)."""
        return self._dense is not None

    @property
    def formed(self) -> bool:
        """Whether ``g_i`` were formed (:meth:`densify`)."""
        return self._dense is not None

    def materialize(self) -> Tensor:
        """Return ``g_i`` (formed once, then shared by the other statistics)."""
        return self.densify()

    def chunks(self, max_elements: int) -> Iterator[Tensor]:
        """Yield blocks of ``g_i``; all of them at once if :meth:`densify` was called.

        Formed ``g_i`` take no further memory, and one block costs a reduction
        less time than many.
        """
        n = self.batch_size
        if self._dense is not None:
            yield self._dense
            return
        rows = max(1, max_elements // max(1, self._numel()))
        for start in range(0, n, rows):
            yield self._block(slice(start, min(start + rows, n)))

    def mean(self) -> Tensor:
        """Return ``g = (1/N) sum_i g_i``."""
        factor = self._scale / self.batch_size
        if self._dense is not None and self._total is None:
            return self._dense.sum(0) / self.batch_size
        total = self._total
        if total is None:
            total = sum(term.total() for term in self._terms).view(self._shape)
        return total if factor == 1 else total * factor

    def _materialize_cost(self, pairs: int = 1) -> int:
        n = self.batch_size
        formed = sum(term.materialize_cost() for term in self._terms)
        return formed + n * pairs * self._numel()

    def _dot_cost(self, pairs: int = 1) -> int:
        terms = self._terms
        return sum(
            terms[k].dot_cost(terms[m], pairs)
            for k in range(len(terms))
            for m in range(k, len(terms))
        )

    def _flat(self) -> Tensor:
        """``g_i`` as rows: the kept ones, or formed for this statistic only."""
        n = self.batch_size
        formed = self._dense if self._dense is not None else self._block(slice(0, n))
        return formed.reshape(n, -1)

    def project(self, direction: Tensor) -> Tensor:
        """Return ``g_i . direction`` (from the factors unless ``g_i`` were formed)."""
        direction = direction.to(self.dtype)
        if self._dense is not None:
            return self._flat() @ direction.reshape(-1)
        matrix = direction.reshape(self._terms[0].num_rows, -1)
        dots = sum(term.project(matrix) for term in self._terms)
        return dots * self._scale

    def batch_l2(self) -> Tensor:
        """Return ``||g_i||^2`` (ghost norms where cheaper than forming ``g_i``)."""
        if self._dense is None and self._dot_cost() < self._materialize_cost():
            terms = self._terms
            total = None
            for k in range(len(terms)):
                for m in range(k, len(terms)):
                    part = terms[k].dot(terms[m])
                    if m != k:
                        part = part * 2
                    total = part if total is None else total + part
            return total * self._scale**2
        if self._dense is None:  # block by block, nothing kept
            norms = [
                torch.linalg.vector_norm(block.reshape(block.shape[0], -1), dim=1)
                for block in self.chunks(1 << 22)
            ]
            return torch.cat(norms).square()
        return torch.linalg.vector_norm(self._flat(), dim=1).square()

    def gram(self) -> Tensor:
        """Return ``g_i . g_j`` (from the factors where cheaper)."""
        n = self.batch_size
        if self._dense is None and self._dot_cost(n) < self._materialize_cost(n):
            terms = self._terms
            total = None
            for k in range(len(terms)):
                for m in range(k, len(terms)):
                    part = terms[k].pairwise_dot(terms[m])
                    if m != k:
                        part = part + part.T
                    total = part if total is None else total + part
            return total * self._scale**2
        flat = self._flat()
        return flat @ flat.T

    def scaled_sum_grad_squared(self) -> Tensor:
        """Return ``(1/N^2) sum_i g_i**2`` elementwise."""
        n = self.batch_size
        total = None
        for block in self.chunks(1 << 22):
            squares = (block * block).sum(0)
            total = squares if total is None else total + squares
        return total / n**2

    def linear_factors(self) -> LinearFactors | None:
        """A single dense term at one position with ``scale = N``, as factors."""
        if len(self._terms) != 1 or self._scale != self.batch_size:
            return None
        term = self._terms[0]
        if term.indexed or term.positions != 1:
            return None
        return LinearFactors(term.cols, term.rows)


def sample_losses(individual_losses: Tensor) -> Tensor:
    """Return one loss per sample: further axes are averaged, as the quantities do."""
    if individual_losses.dim() > 1:
        return individual_losses.flatten(start_dim=1).mean(1)
    return individual_losses
