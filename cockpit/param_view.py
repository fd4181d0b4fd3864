"""Read-only access to one parameter's BackPACK results inside the extension hook.

A :class:`ParamView` is created for every parameter as soon as BackPACK has finished
the module that owns it. Quantities read statistics from it; each statistic is
computed at most once per parameter and shared by all quantities (one pass over the
per-sample gradients feeds every statistic). All statistics are in terms of the
*unscaled* individual gradients ``g_i = N * b_i`` (``b_i`` is BackPACK's ``grad_batch``
under a mean-reduced loss), so ``g = mean_i g_i`` is the mini-batch gradient.

Where per-sample gradients come from is decided by one object, the *source*
(:class:`BackpackGradBatch` today); another engine (e.g. ``torch.func``) can be plugged
in by handing a different source to the view. The source may hand over a materialised
``[N, *shape]`` tensor or, for ``Linear`` weights under the cockpit's own extension
(:class:`cockpit.extensions.PerSampleGradients`), a
:class:`~cockpit.extensions.LinearFactors` object; statistics are then computed from
the factors and the per-sample tensor is built only if a quantity asks for it.

Statistics are computed from BackPACK's scaled ``b_i`` and rescaled at the end (one
multiplication of a small result) instead of from a scaled copy of the per-sample
tensor, unless that copy exists already.
"""

from __future__ import annotations

from typing import Callable, Iterator, Union

import torch
from torch import Tensor

from cockpit.extensions import LinearFactors

#: What a source hands over: per-sample gradients, materialised or factored.
PerSample = Union[Tensor, LinearFactors]


class BackpackGradBatch:
    """Per-sample gradients from BackPACK's ``BatchGrad`` savefield ``grad_batch``."""

    savefield = "grad_batch"

    def available(self, param: Tensor) -> bool:
        """Return whether per-sample gradients exist for ``param`` right now."""
        return hasattr(param, self.savefield)

    def scaled(self, param: Tensor) -> PerSample:
        """Return ``b_i``, BackPACK's per-sample gradients, ``[N, *param.shape]``.

        For ``Linear`` weights under :class:`~cockpit.extensions.PerSampleGradients`
        this is a :class:`~cockpit.extensions.LinearFactors` object.
        """
        return getattr(param, self.savefield)


DEFAULT_SOURCE = BackpackGradBatch()


class ParamView:
    """Statistics of one parameter's per-sample gradients and curvature.

    Args:
        param: The parameter tensor (BackPACK results are attributes of it).
        index: Position of ``param`` in the cockpit's parameter list.
        source: Where per-sample gradients come from.
    """

    def __init__(self, param: Tensor, index: int, source=DEFAULT_SOURCE):
        self.param = param
        self.index = index
        self._source = source
        self._cache: dict[str, Tensor] = {}

    def _cached(self, name: str, compute: Callable[[], Tensor]) -> Tensor:
        if name not in self._cache:
            self._cache[name] = compute()
        return self._cache[name]

    def _missing(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"No {what} for parameter #{self.index} (shape {tuple(self.param.shape)}): "
            "the BackPACK extension that provides it did not run for this parameter."
        )

    @property
    def has_individual_gradients(self) -> bool:
        """Whether per-sample gradients are available for this parameter."""
        return self._source.available(self.param)

    @property
    def batch_size(self) -> int:
        """The number of samples N, read off the per-sample results."""
        if self.has_individual_gradients:
            return self._scaled().shape[0]
        if hasattr(self.param, "batch_l2"):
            return self.param.batch_l2.shape[0]
        raise self._missing("per-sample result")

    def _scaled(self) -> PerSample:
        """BackPACK's scaled per-sample gradients ``b_i`` (tensor or factors)."""
        return self._source.scaled(self.param)

    def _flat_scaled(self) -> Tensor:
        """``b_i`` as a ``[N, D]`` tensor; only for a materialised source."""
        return self._scaled().flatten(start_dim=1)

    def individual_gradients(self) -> Tensor:
        """Return ``g_i`` for every sample, shape ``[N, *param.shape]``."""

        def compute() -> Tensor:
            if not self.has_individual_gradients:
                raise self._missing("per-sample gradients")
            scaled = self._scaled()
            if isinstance(scaled, LinearFactors):
                return scaled.materialize(scale=scaled.batch_size)
            return scaled * scaled.shape[0]

        return self._cached("individual_gradients", compute)

    def individual_gradient_chunks(
        self, max_elements: int = 1 << 18
    ) -> Iterator[Tensor]:
        """Yield ``g_i`` in blocks of consecutive samples, ``[k, *param.shape]`` each.

        Concatenated along the first axis, the blocks equal
        :meth:`individual_gradients` (bit for bit). Only one block exists at a time
        (unless :meth:`individual_gradients` was already built; then its slices are
        yielded), so a statistic reduced block by block, such as a histogram, needs
        about ``max_elements`` values of extra memory instead of ``N * D``, and its
        temporaries stay in the processor's cache. For ``Linear`` weights the blocks
        are built from the factors and the whole per-sample tensor never exists.

        Args:
            max_elements: Target size of a block; a block holds at least one sample.

        Yields:
            Blocks of unscaled per-sample gradients.
        """
        if not self.has_individual_gradients:
            raise self._missing("per-sample gradients")
        scaled = self._scaled()
        n = scaled.shape[0]
        rows = max(1, max_elements // max(1, self.param.numel()))
        cached = self._cache.get("individual_gradients")
        for start in range(0, n, rows):
            samples = slice(start, min(start + rows, n))
            if cached is not None:
                yield cached[samples]
            elif isinstance(scaled, LinearFactors):
                yield scaled.materialize(scale=n, samples=samples)
            else:
                yield scaled[samples] * n

    def _flat_individual(self) -> Tensor:
        return self.individual_gradients().flatten(start_dim=1)

    def mean_gradient(self) -> Tensor:
        """Return ``g = mean_i g_i`` from the per-sample gradients, shape of param."""

        def compute() -> Tensor:
            scaled = self._scaled()
            if isinstance(scaled, LinearFactors):
                return scaled.sum()
            return scaled.sum(0)

        return self._cached("mean_gradient", compute)

    def project(self, direction: Tensor) -> Tensor:
        """Return ``g_i . direction`` for every sample, shape ``[N]``.

        For ``Linear`` weights this never builds the per-sample gradients.

        Args:
            direction: A tensor of the parameter's shape.
        """
        if not self.has_individual_gradients:
            raise self._missing("per-sample gradients")
        scaled = self._scaled()
        n = scaled.shape[0]
        if isinstance(scaled, LinearFactors):
            return scaled.project(direction) * n
        if "individual_gradients" in self._cache:
            return self._flat_individual() @ direction.reshape(-1)
        return (self._flat_scaled() @ direction.reshape(-1)) * n

    def batch_l2(self) -> Tensor:
        """Return ``||g_i||^2`` for every sample, shape ``[N]``."""

        def compute() -> Tensor:
            if self.has_individual_gradients:
                scaled = self._scaled()
                n = scaled.shape[0]
                if isinstance(scaled, LinearFactors):
                    return scaled.batch_l2() * n**2
                if "individual_gradients" in self._cache:
                    flat = self._flat_individual()
                    return torch.linalg.vector_norm(flat, dim=1).square()
                norms = torch.linalg.vector_norm(self._flat_scaled(), dim=1)
                return norms.square() * n**2
            if hasattr(self.param, "batch_l2"):
                n = self.param.batch_l2.shape[0]
                return self.param.batch_l2 * n**2
            raise self._missing("per-sample squared norms")

        return self._cached("batch_l2", compute)

    def sum_grad_squared(self, batch_size: int | None = None) -> Tensor:
        """Return ``sum_i g_i**2`` elementwise, shape of param.

        Args:
            batch_size: N; needed only when the value comes from BackPACK's
                ``SumGradSquared`` (which carries no batch axis).

        Returns:
            The elementwise second moment times N.
        """

        def compute() -> Tensor:
            if self.has_individual_gradients:
                return self.scaled_sum_grad_squared() * self.batch_size**2
            if hasattr(self.param, "sum_grad_squared"):
                if batch_size is None:
                    raise ValueError("batch_size is needed to unscale sum_grad_squared")
                return self.param.sum_grad_squared * batch_size**2
            raise self._missing("sum of squared per-sample gradients")

        return self._cached("sum_grad_squared", compute)

    def scaled_sum_grad_squared(self) -> Tensor:
        """Return ``sum_i b_i**2 = (1/N**2) sum_i g_i**2`` elementwise, shape of param.

        This is BackPACK's ``SumGradSquared`` convention. Unlike
        :meth:`sum_grad_squared` it needs no batch size, whichever extension ran, so
        a quantity can reduce it inside the hook and multiply by ``N`` later.
        """

        def compute() -> Tensor:
            if self.has_individual_gradients:
                scaled = self._scaled()
                if isinstance(scaled, LinearFactors):
                    return scaled.sum_grad_squared()
                if "individual_gradients" in self._cache:
                    g = self.individual_gradients()
                    return (g * g).sum(0) / g.shape[0] ** 2
                return (scaled * scaled).sum(0)
            if hasattr(self.param, "sum_grad_squared"):
                return self.param.sum_grad_squared
            raise self._missing("sum of squared per-sample gradients")

        return self._cached("scaled_sum_grad_squared", compute)

    def gram(self) -> Tensor:
        """Return the Gram matrix ``G_ij = g_i . g_j``, shape ``[N, N]``."""

        def compute() -> Tensor:
            if not self.has_individual_gradients:
                raise self._missing("per-sample gradients")
            scaled = self._scaled()
            n = scaled.shape[0]
            if isinstance(scaled, LinearFactors):
                return scaled.gram() * n**2
            if "individual_gradients" in self._cache:
                flat = self._flat_individual()
                return flat @ flat.T
            flat = self._flat_scaled()
            return (flat @ flat.T) * n**2

        return self._cached("gram", compute)

    def curvature(self, savefield: str) -> Tensor:
        """Return a curvature diagonal (``diag_h``, ``diag_ggn_exact``, ...)."""
        if not hasattr(self.param, savefield):
            raise self._missing(f"curvature diagonal {savefield!r}")
        return getattr(self.param, savefield)

    def release(self) -> None:
        """Drop every cached statistic (called once all quantities have read them)."""
        self._cache.clear()


def empty_like_param(param: Tensor) -> Tensor:
    """Return a zero scalar on ``param``'s device and dtype (an accumulator seed)."""
    return torch.zeros((), device=param.device, dtype=param.dtype)
