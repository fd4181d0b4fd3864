"""What quantities read about one parameter inside the backward pass.

A :class:`ParamView` is made for every parameter as soon as the engine has finished
the module that owns it (for BackPACK: in the extension hook), and dropped right
after every quantity has read it. Quantities read statistics from it; each is
computed at most once per parameter and shared by all quantities. All statistics are
in terms of the *unscaled* individual gradients ``g_i``, so that ``g = mean_i g_i``
is the mini-batch gradient.

The view knows nothing about engines: it is handed what the engine produced for the
parameter (see :class:`ParamResults`). Per-sample gradients come through the
:class:`~cockpit.per_sample.IndividualGradients` protocol.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

from torch import Tensor

from cockpit.per_sample import Centered, IndividualGradients

#: Per-sample gradients of at most this many numbers (``N`` times the parameter's
#: size) are centred even where factors would give their norms without forming
#: them (:attr:`ParamView.centers_cheaply`).
SMALL = 1 << 16


@dataclass
class ParamResults:
    """What an engine computed for one parameter in the backward pass.

    Attributes:
        individual: The per-sample gradients, if computed.
        batch_l2: ``||g_i||^2`` per sample (``[N]``), if computed without them.
        scaled_sum_grad_squared: ``(1/N^2) sum_i g_i**2`` (the parameter's shape),
            if computed without the per-sample gradients.
        curvatures: Curvature diagonals by label (``"diag_h"``, ...).
    """

    individual: IndividualGradients | None = None
    batch_l2: Tensor | None = None
    scaled_sum_grad_squared: Tensor | None = None
    curvatures: Mapping[str, Tensor] = field(default_factory=dict)


class ParamView:
    """Statistics of one parameter's per-sample gradients and curvature.

    Args:
        param: The parameter tensor.
        index: Position of ``param`` in the cockpit's parameter list.
        results: What the engine computed for it.
    """

    def __init__(self, param: Tensor, index: int, results: ParamResults):
        self.param = param
        self.index = index
        self._results = results
        self._cache: dict[str, Tensor] = {}

    def _cached(self, name: str, compute: Callable[[], Tensor]) -> Tensor:
        if name not in self._cache:
            self._cache[name] = compute()
        return self._cache[name]

    def _missing(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"No {what} for parameter #{self.index} (shape {tuple(self.param.shape)}): "
            "the engine computed no such result for this parameter at this step. "
            "Fix: declare the matching Need in the quantity's `needs`."
        )

    def _individual(self) -> IndividualGradients:
        if self._results.individual is None:
            raise self._missing("per-sample gradients")
        return self._results.individual

    @property
    def has_second_moment(self) -> bool:
        """Whether :meth:`scaled_sum_grad_squared` has a result to read."""
        results = self._results
        return (
            results.individual is not None
            or results.scaled_sum_grad_squared is not None
        )

    def has_curvature(self, kind: str) -> bool:
        """Whether the curvature diagonal ``kind`` was computed for this parameter."""
        return kind in self._results.curvatures

    @property
    def has_individual_gradients(self) -> bool:
        """Whether per-sample gradients are available for this parameter."""
        return self._results.individual is not None

    @property
    def batch_size(self) -> int:
        """The number of samples N, read off the per-sample results."""
        if self._results.individual is not None:
            return self._results.individual.batch_size
        if self._results.batch_l2 is not None:
            return self._results.batch_l2.shape[0]
        raise self._missing("per-sample result")

    def individual_gradients(self) -> Tensor:
        """Return ``g_i`` for every sample, shape ``[N, *param.shape]``."""
        return self._individual().materialize()

    def individual_gradient_chunks(
        self, max_elements: int = 1 << 18
    ) -> Iterator[Tensor]:
        """Yield ``g_i`` in blocks of consecutive samples, ``[k, *param.shape]`` each.

        Concatenated along the first axis, the blocks equal
        :meth:`individual_gradients` bit for bit. Only one block exists at a time
        (unless :meth:`individual_gradients` was already built; then its slices are
        yielded), so a statistic reduced block by block, such as a histogram, needs
        about ``max_elements`` values of extra memory instead of ``N * D``.

        Args:
            max_elements: Target size of a block; a block holds at least one sample.

        Yields:
            Blocks of unscaled per-sample gradients.
        """
        return self._individual().chunks(max_elements)

    def keep_individual(self) -> IndividualGradients:
        """Return the per-sample gradients to read after the backward pass.

        Only for data-parallel runs, where some statistics need the joined batch's
        gradient, known only once every process is done: the caller holds them
        (``N`` times the parameter, or its factors for ``Linear``) until then.
        """
        return self._individual()

    def mean_gradient(self) -> Tensor:
        """Return ``g = mean_i g_i`` from the per-sample gradients, shape of param."""
        return self._cached("mean_gradient", lambda: self._individual().mean())

    def project(self, direction: Tensor) -> Tensor:
        """Return ``g_i . direction`` for every sample, shape ``[N]``.

        Args:
            direction: A tensor of the parameter's shape.
        """
        return self._individual().project(direction)

    def mean_dots(self) -> Tensor:
        """Return ``g_i . g`` for every sample (``g`` the mean gradient), ``[N]``.

        Computed once per parameter and shared: the gradient tests and Alpha's
        plain-SGD direction both project onto ``g``.
        """
        return self._cached(
            "mean_dots", lambda: self._individual().project(self.mean_gradient())
        )

    def centered(self, elementwise: bool = False) -> Centered:
        """Statistics of ``g_i - g`` (two-pass: the mean subtracted first).

        Computed once per parameter and shared (see
        :meth:`cockpit.per_sample.IndividualGradients.centered`); spreads formed
        from them do not cancel, unlike ``sum_i ||g_i||^2 - N ||g||^2``.

        Args:
            elementwise: Also ``sum_i (g_i - g)**2`` elementwise (its
                :meth:`~cockpit.per_sample.Centered.elementwise_spread`).
        """
        kept = self._cache.get("centered")
        if kept is None or (elementwise and kept.squares is None):
            kept = self._individual().centered(self.mean_gradient(), elementwise)
            self._cache["centered"] = kept
        return kept

    @property
    def centers_cheaply(self) -> bool:
        """Whether :meth:`centered` costs no forming of per-sample gradients.

        True when they exist as a tensor already, were centred for another
        quantity at this parameter, or number at most :data:`SMALL` (forming
        so few is cheap next to a backward pass). Statistics
        that can also be had from factors (squared norms, projections) use the
        centred form only then.
        """
        individual = self._results.individual
        if individual is None:
            return False
        if "centered" in self._cache or individual.formed:
            return True
        return individual.batch_size * self.param.numel() <= SMALL

    def batch_l2(self) -> Tensor:
        """Return ``||g_i||^2`` for every sample, shape ``[N]``."""

        def compute() -> Tensor:
            if self._results.individual is not None:
                return self._results.individual.batch_l2()
            if self._results.batch_l2 is not None:
                return self._results.batch_l2
            raise self._missing("per-sample squared norms")

        return self._cached("batch_l2", compute)

    def sum_grad_squared(self, batch_size: int | None = None) -> Tensor:
        """Return ``sum_i g_i**2`` elementwise, shape of param.

        Args:
            batch_size: N; needed only when no per-sample result carries it.

        Returns:
            The elementwise second moment times N.

        Raises:
            ValueError: If N is needed but not given.
        """

        def compute() -> Tensor:
            if self._results.individual is not None:
                return self.scaled_sum_grad_squared() * self.batch_size**2
            if batch_size is None:
                raise ValueError("batch_size is needed to unscale sum_grad_squared")
            return self.scaled_sum_grad_squared() * batch_size**2

        return self._cached("sum_grad_squared", compute)

    def scaled_sum_grad_squared(self) -> Tensor:
        """Return ``(1/N^2) sum_i g_i**2`` elementwise, shape of param.

        BackPACK's ``SumGradSquared`` convention: unlike :meth:`sum_grad_squared`
        it needs no batch size, so a quantity can reduce it inside the backward
        pass and multiply by ``N`` later.
        """

        def compute() -> Tensor:
            if self._results.individual is not None:
                return self._results.individual.scaled_sum_grad_squared()
            if self._results.scaled_sum_grad_squared is not None:
                return self._results.scaled_sum_grad_squared
            raise self._missing("sum of squared per-sample gradients")

        return self._cached("scaled_sum_grad_squared", compute)

    def gram(self) -> Tensor:
        """Return the Gram matrix ``G_ij = g_i . g_j``, shape ``[N, N]``."""
        return self._cached("gram", lambda: self._individual().gram())

    def linear_factors(self):
        """The factors of a ``Linear`` weight's ``b_i = g_i / N``, or ``None``.

        See :meth:`cockpit.per_sample.IndividualGradients.linear_factors`.
        """
        individual = self._results.individual
        return None if individual is None else individual.linear_factors()

    def curvature(self, kind: str) -> Tensor:
        """Return a curvature diagonal (``"diag_h"``, ``"diag_ggn_exact"``, ...)."""
        try:
            return self._results.curvatures[kind]
        except KeyError:
            raise self._missing(f"curvature diagonal {kind!r}") from None

    def release(self) -> None:
        """Drop every cached statistic (called once all quantities have read them)."""
        self._cache.clear()
        self._results = ParamResults()


class Dispatcher:
    """Shows each parameter's results to the quantities, whichever engine made them.

    Every engine hands results through :meth:`show`: a :class:`ParamView` is made,
    every consumer reads it (``accumulate(global_step, view)``) and it is released.

    Args:
        consumers: Objects with ``accumulate(global_step, view)``.
        global_step: The step.
        sized: Whether to note the batch size from the first view.

    Attributes:
        visited: Indices shown so far.
        repeated: Whether a parameter was shown twice (a second backward pass).
        batch_size: The batch size read off the first view (``sized``), if any.
    """

    def __init__(self, consumers, global_step: int, sized: bool = False):
        self.consumers = consumers
        self.global_step = global_step
        self.sized = sized
        self.visited: set[int] = set()
        self.repeated = False
        self.batch_size: int | None = None

    def show(self, index: int, param: Tensor, results: ParamResults) -> None:
        """Show parameter ``index``'s results to every consumer (once per step)."""
        if index in self.visited:  # a second backward in the same step
            self.repeated = True
            return
        self.visited.add(index)
        view = ParamView(param, index, results)
        if self.batch_size is None and self.sized:
            with contextlib.suppress(RuntimeError):
                self.batch_size = view.batch_size
        for consumer in self.consumers:
            consumer.accumulate(self.global_step, view)
        view.release()
