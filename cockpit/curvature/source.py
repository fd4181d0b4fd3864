"""Which curvature an estimated quantity reads, and how many draws it takes.

Where BackPACK cannot form a curvature diagonal (a model it cannot backpropagate
through), a quantity that accepts an estimate (``Quantity.estimable``) gets one of
two sources, chosen by :func:`choose` when the step is routed:

* the **GGN** of the cross-entropy (:mod:`cockpit.curvature.ggn`): for
  ``curvature="diag_ggn_exact"`` / ``"diag_ggn_mc"``, and, for the whole run, in
  place of the Hessian (``"diag_h"``, the default) whenever the loss reaches the
  model through one ``log_softmax``. Hutchinson's estimate of the Hessian trace
  needs 24 to 11663 products per step for a 10 % relative error on the Hugging Face
  zoo (``benchmarks/results/curvature_zoo.md``), far beyond any budget; the GGN is
  positive semi-definite, its estimate reaches 10 % in a few dozen backward passes,
  and the step says which curvature it used (the ``<key>_estimate`` record's
  ``"curvature"``, the coverage line, a :class:`~cockpit.errors.CockpitWarning`);
* **Hutchinson**'s estimate of the Hessian (:mod:`cockpit.curvature.hutchinson`) for
  ``curvature="hutchinson"`` (the Hessian, never replaced) and where the loss is
  not a cross-entropy.

A data-parallel run chooses as one process on the joined batch does: each process
forms its shard's part of the GGN, exactly where the *joined* batch's rows times
classes are at most :data:`EXACT_MAX_PRODUCTS`, otherwise from the labels one
process would draw for its rows (:class:`Share`: the uniform numbers of the whole
batch, this process's columns), with the draw count and the top-up decided on the
joined draws' traces; the quantities join the parts as they join any curvature.
The joined Monte-Carlo estimate is unbiased like one process's but not the same
numbers: one draw's vector sums over the rows, and a process's lacks the cross
terms with the other shards' rows (zero in expectation).

The GGN's diagonal is exact (:meth:`~cockpit.curvature.ggn.Head.exact`) where that
takes at most :data:`EXACT_MAX_PRODUCTS` backward passes (rows times classes: a
classifier on a small batch); otherwise it is the Monte-Carlo estimate
(:func:`monte_carlo`): as many drawn labels as make the relative standard error of
the summed trace about :data:`TARGET_RELATIVE_SE`, counted from the *previous*
estimate's spread (at the first step from a pilot estimate that is then discarded),
then topped up :data:`TOP_UP` draws at a time while the reported relative error
is above :data:`GOAL_RELATIVE_SE` (10 %), up to :data:`MAX_DRAWS`. A count chosen
from the draws it is reported with makes the reported error optimistic (stopping
when the draws happen to agree); starting from an independent count keeps the
top-up rare and small. Measured on the hand-written GPT (4000 simulated runs from
2000 draws per batch): the mean squared reported error is 0.94-0.98 of the
estimates' variance and the bias under 0.7 % of the trace, where drawing from 16
until 10 % would give 0.78-0.83 and 1 %; the count alone, without the top-up,
left 26-31 % of the steps above 10 %.

Quantities that divide elementwise by the diagonal (TICDiag:
``exact_curvature_only``) take only the exact diagonal.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from cockpit.curvature.ggn import (
    NotCrossEntropy,
    exact_method,
    ggn_method,
    log_probabilities,
)
from cockpit.curvature.hutchinson import hutchinson_method
from cockpit.needs import Need

#: The curvature needs (as ``cockpit.engines.coverage.CURVATURE_NEEDS``).
CURVATURE_NEEDS = frozenset({Need.DIAG_H, Need.DIAG_GGN_EXACT, Need.DIAG_GGN_MC})

#: Source names (also the ``"curvature"`` of the estimate records: ``"ggn"`` or
#: ``"hessian"``).
GGN = "ggn"
HUTCHINSON = "hutchinson"
#: The curvature label that asks for the Hessian always (Hutchinson's estimate
#: where BackPACK cannot form it), never the GGN in its place.
HESSIAN_ONLY = "hutchinson"

#: The GGN diagonal is formed exactly where it takes at most this many backward
#: passes (rows times classes). Chosen on the zoo (seed 0, batches 0-2): the
#: classifiers (4 rows, 3 classes) take 12, where 57-70 drawn labels would be needed
#: for a 10 % error; the language models (24 rows, 23 classes: 552) draw labels.
EXACT_MAX_PRODUCTS = 64
#: The relative standard error of the summed trace the draws aim at (the goal is
#: 10 %; the margin covers the step-to-step change of the spread and the noise of
#: the previous step's spread).
TARGET_RELATIVE_SE = 0.085
#: The reported relative standard error of the summed trace the top-up goes for.
GOAL_RELATIVE_SE = 0.10
#: Draws added at a time while the reported relative error exceeds the goal.
TOP_UP = 8
#: The fewest and the most drawn labels per step (the standard error of fewer
#: than 16 draws is itself too noisy to read; 128 costs about what 64 Hessian-vector
#: products do).
MIN_DRAWS = 16
MAX_DRAWS = 128

_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SPREADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: ``(weak reference to the last step's losses, their head size)``.
_LAST_SIZE: list = [None, None]


def chosen(quantity) -> str | None:
    """The source chosen for ``quantity`` (``None``: none yet)."""
    return _CHOICES.get(quantity)


def substitutes(quantity) -> bool:
    """Whether ``quantity`` reads the GGN in place of the Hessian it asked for."""
    return chosen(quantity) == GGN and getattr(quantity, "curvature", None) == "diag_h"


def fall_back(quantity) -> None:
    """Serve ``quantity`` with Hutchinson from now on (its loss is not read)."""
    _CHOICES[quantity] = HUTCHINSON


def head_size(losses, params) -> int | NotCrossEntropy:
    """Rows times classes of the loss's ``log_softmax`` (the exact GGN's passes).

    Read once per loss tensor (the graph is walked once per step).

    Returns:
        The size, or the :class:`NotCrossEntropy` error that says why the loss
        has no such head.
    """
    ref, known = _LAST_SIZE
    if ref is None or ref() is not losses:
        try:
            known = log_probabilities(losses, params)[0].numel()
        except NotCrossEntropy as error:
            known = error
        _LAST_SIZE[:] = [weakref.ref(losses), known]
    return known


def choose(plan, quantity, losses, params, parallel: bool) -> str | None:
    """The source of ``quantity``'s curvature at this step (``None``: none serves).

    Args:
        plan: The step's plan.
        quantity: An estimable quantity no engine forms the curvature for.
        losses: The step's per-sample losses, with their graph.
        params: The cockpit's parameters.
        parallel: Whether the run is data-parallel (a communicator joins it).
    """
    wanted = plan.needs_of(quantity) & CURVATURE_NEEDS
    if not wanted or not wanted <= quantity.estimable:
        return None
    exact_only = getattr(quantity, "exact_curvature_only", False)
    hessian = wanted == {Need.DIAG_H}
    if hessian and getattr(quantity, "hessian_only", False):
        return None if exact_only else HUTCHINSON
    known = _CHOICES.get(quantity)
    if known == HUTCHINSON:
        return None if exact_only else known
    size = head_size(losses, params)
    if isinstance(size, NotCrossEntropy):
        if hessian and not exact_only:
            _CHOICES[quantity] = HUTCHINSON
            return HUTCHINSON
        return None
    if exact_only and size > EXACT_MAX_PRODUCTS and not parallel:
        return None  # (data-parallel: decided on the joined batch's size, later)
    _CHOICES[quantity] = GGN
    return GGN


def estimate_method(
    plan, quantity, losses, params, probes: int, parallel: bool
) -> str | None:
    """How the step's estimate for ``quantity`` will be made (``None``: none serves).

    The source is chosen by :func:`choose` (the GGN of the cross-entropy where it
    can be read, else Hutchinson's estimate of the Hessian); these are the
    coverage report's words.

    Args:
        plan: The step's plan.
        quantity: The estimated quantity.
        losses: The step's per-sample losses, with their graph.
        params: The cockpit's parameters.
        probes: Hessian-vector products of a Hutchinson estimate.
        parallel: Whether the run is data-parallel.
    """
    source = choose(plan, quantity, losses, params, parallel)
    if source is None:
        return None
    if source != GGN:
        return hutchinson_method(probes)
    how = method(source, head_size(losses, params))
    if substitutes(quantity):
        how = f"{how}, in place of the Hessian (curvature='hutchinson' for it)"
    return how


def expected_method(quantity, probes: int) -> str:
    """How ``quantity``'s curvature will be estimated, before any step.

    The loss is not known yet: the words say what the first step will choose
    between (the coverage report before the first step).
    """
    wanted = set(quantity.needs) & CURVATURE_NEEDS
    hutchinson = f"Hutchinson, {probes} Hessian-vector products"
    if getattr(quantity, "hessian_only", False):
        return hutchinson
    ggn = "the GGN of the cross-entropy where the loss is one (chosen at step 1)"
    if getattr(quantity, "exact_curvature_only", False):
        return f"exactly: {ggn}, with at most {EXACT_MAX_PRODUCTS} rows times classes"
    if wanted == {Need.DIAG_H}:
        return f"{ggn}, else {hutchinson}"
    return ggn


def method(source: str, size: int | None) -> str:
    """How the source estimates the curvature (the coverage report's words)."""
    if source != GGN:
        return ""
    if size is not None and size <= EXACT_MAX_PRODUCTS:
        return exact_method(size)
    return (
        "Monte-Carlo GGN of the cross-entropy, drawn labels (one backward pass "
        f"each) for a relative error of the trace of at most "
        f"{GOAL_RELATIVE_SE:.0%}, {MIN_DRAWS}-{MAX_DRAWS}"
    )


def draws_for(keys) -> int | None:
    """Drawn labels for this step, from the previous estimate's spread.

    ``(relative spread of one draw's summed trace / TARGET_RELATIVE_SE)**2``,
    between :data:`MIN_DRAWS` and :data:`MAX_DRAWS`; ``None`` before any estimate
    (the step draws a pilot first).

    Args:
        keys: What the spread is kept under (the quantities the estimate serves;
            each keeps it in its ``state_dict``, so a resumed run goes on alike).
    """
    spreads = [_SPREADS[key] for key in keys if key in _SPREADS]
    if not spreads:
        return None
    return needed_draws(spreads[0])


def needed_draws(spread: float) -> int:
    """Draws for :data:`TARGET_RELATIVE_SE` given one draw's relative spread."""
    if not math.isfinite(spread):
        return MAX_DRAWS
    wanted = math.ceil((spread / TARGET_RELATIVE_SE) ** 2)
    return min(MAX_DRAWS, max(MIN_DRAWS, wanted))


def relative_spread(traces) -> float:
    """Relative standard deviation of one draw's summed trace (``[K, P]`` traces)."""
    sums = traces.sum(dim=1)
    mean = float(sums.mean())
    return float(sums.std()) / mean if mean > 0 else math.inf


def relative_error(traces) -> float:
    """Reported relative standard error of the summed trace (``[K, P]`` traces)."""
    return relative_spread(traces) / traces.shape[0] ** 0.5


@dataclass(frozen=True)
class Share:
    """A data-parallel process's part of the joined batch's GGN.

    Attributes:
        columns: ``(first row, rows of the joined batch)``: this process's rows
            among the joined batch's (in rank order).
        elements: ``log p``'s elements over the joined batch (the draws' chunks
            are chosen on it, so every process draws as one process would).
        join: Per-draw traces ``[K, P]`` of this process -> the joined batch's
            (a weighted sum over the processes: a collective).
    """

    columns: tuple[int, int]
    elements: int
    join: Callable[[torch.Tensor], torch.Tensor]


def monte_carlo(head, keys, generator, share: Share | None = None):
    """The Monte-Carlo GGN of this step (see the module for the count).

    Args:
        head: The loss's :class:`~cockpit.curvature.ggn.Head`.
        keys: What the previous estimate's spread is kept under (the quantities
            the estimate serves).
        generator: Random source of the labels.
        share: In a data-parallel run, this process's part: the count and the
            top-up are decided on the joined traces, the same on every process.

    Returns:
        The :class:`~cockpit.curvature.hutchinson.TraceEstimate` (of this
        process's rows).
    """
    keys = list(keys)

    columns = elements = None
    if share is not None:
        columns, elements = share.columns, share.elements

    def draw(count):
        return head.draws(count, generator, columns=columns, elements=elements)

    def joined(traces):
        return traces if share is None else share.join(traces)

    draws = draws_for(keys)
    if draws is None:  # a pilot, discarded: only its spread is used
        draws = needed_draws(relative_spread(joined(draw(MIN_DRAWS).traces)))
    estimate = draw(draws)
    traces = joined(estimate.traces)
    while estimate.products < MAX_DRAWS and relative_error(traces) > GOAL_RELATIVE_SE:
        more = draw(min(TOP_UP, MAX_DRAWS - estimate.products))
        estimate = _joined(estimate, more)
        traces = torch.cat([traces, joined(more.traces)])
    remember(keys, traces)
    return estimate


def _joined(first, second):
    """Two Monte-Carlo estimates of one GGN as one (their draws pooled)."""
    n, m = first.products, second.products
    return type(first)(
        [(a * n + b * m) / (n + m) for a, b in zip(first.diagonals, second.diagonals)],
        torch.cat([first.traces, second.traces]),
        n + m,
        ggn_method(n + m),
    )


def remember(keys, traces) -> None:
    """Keep the spread of this step's draws for the next step's count."""
    spread = relative_spread(traces)
    for key in keys:
        _SPREADS[key] = spread


def state_of(quantity) -> dict:
    """What a resumed run needs of ``quantity``'s source (its ``state_dict``).

    The source chosen for the run and the last Monte-Carlo spread: the resumed run
    chooses alike and draws the count (and with the saved random source the
    labels) of an uninterrupted run.
    """
    state = {}
    if quantity in _CHOICES:
        state["curvature_source"] = _CHOICES[quantity]
    if quantity in _SPREADS:
        state["ggn_spread"] = _SPREADS[quantity]
    return state


def restore(quantity, state) -> None:
    """Restore what :func:`state_of` saved."""
    if "curvature_source" in state:
        _CHOICES[quantity] = state["curvature_source"]
    if "ggn_spread" in state:
        _SPREADS[quantity] = float(state["ggn_spread"])
