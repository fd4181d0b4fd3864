"""Who computes what: the coverage report of :meth:`Cockpit.coverage`.

For every parameter it says which engine computes its per-sample results (and why
that one), and for every quantity whether its value for that parameter is exact,
estimated or not covered at all (with the reason). ``Cockpit(..., strict=True)``
turns anything but "exact" into a :class:`CoverageError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from cockpit.curvature.source import expected_method
from cockpit.engines.base import AUTOGRAD, BACKPACK, UNUSED, EngineStep, Route
from cockpit.needs import Need

EXACT = "exact"
ESTIMATED = "estimated"
MISSING = "not covered"

#: Needs served by per-sample gradients (from either engine).
PER_SAMPLE_NEEDS = frozenset(
    {
        Need.INDIVIDUAL_GRADIENTS,
        Need.GRAM,
        Need.PROJECTIONS,
        Need.BATCH_L2,
        Need.SUM_GRAD_SQUARED,
    }
)
#: Needs served by BackPACK's curvature diagonals.
CURVATURE_NEEDS = frozenset({Need.DIAG_H, Need.DIAG_GGN_EXACT, Need.DIAG_GGN_MC})

_RANK = {EXACT: 0, ESTIMATED: 1, MISSING: 2}


class CoverageError(RuntimeError):
    """``Cockpit(..., strict=True)`` met a value that would be estimated or missing."""


@dataclass(frozen=True)
class Status:
    """How one quantity's value for one parameter is obtained.

    Attributes:
        kind: :data:`EXACT`, :data:`ESTIMATED` or :data:`MISSING`.
        how: The engine or method (``"backpack"``, ``"autograd"``, ...), or why
            it is missing.
    """

    kind: str
    how: str

    def __str__(self) -> str:
        return f"{self.kind} ({self.how})"


@dataclass(frozen=True)
class ParamCoverage:
    """One parameter's row of the report.

    Attributes:
        index: Its position among the cockpit's parameters.
        label: Name (where known), position and shape.
        route: Which engine computes its per-sample results, and why.
        quantities: Quantity key -> :class:`Status`.
    """

    index: int
    label: str
    route: Route
    quantities: Mapping[str, Status] = field(default_factory=dict)


@dataclass(frozen=True)
class Coverage:
    """The coverage report of a step (or of the model's structure before any step).

    Attributes:
        step: The step it describes (``None``: before the first tracked step, from
            the model's structure; tying and batch layouts are checked per step).
        params: One row per parameter.
    """

    step: int | None
    params: Sequence[ParamCoverage]

    def merged(self, newer: Coverage) -> Coverage:
        """Return this report updated by a later step's.

        Quantities inactive at the later step keep their earlier status; the
        routes are the later ones.
        """
        if len(newer.params) != len(self.params):
            return newer
        rows = [
            ParamCoverage(
                new.index,
                new.label,
                new.route,
                {**dict(old.quantities), **dict(new.quantities)},
            )
            for old, new in zip(self.params, newer.params, strict=True)
        ]
        return Coverage(newer.step, rows)

    def with_methods(self, methods: Mapping[int, str]) -> Coverage:
        """Return the report with the autograd engine's method of some parameters."""
        rows = [
            replace(row, route=replace(row.route, method=methods[row.index]))
            if row.index in methods
            else row
            for row in self.params
        ]
        return Coverage(self.step, rows)

    def with_status(self, key: str, status: Status) -> Coverage:
        """Return the report with quantity ``key``'s status replaced everywhere."""
        rows = [
            replace(row, quantities={**dict(row.quantities), key: status})
            if key in row.quantities
            else row
            for row in self.params
        ]
        return Coverage(self.step, rows)

    def problems(self) -> list[str]:
        """Everything not exact: ``"<quantity> for <parameter>: <status>"``."""
        found = []
        for row in self.params:
            for key, status in row.quantities.items():
                if status.kind != EXACT:
                    found.append(f"{key} for {row.label}: {status}")
        return found

    def engines(self) -> dict[str, int]:
        """How many parameters each engine computes."""
        counts: dict[str, int] = {}
        for row in self.params:
            counts[row.route.engine] = counts.get(row.route.engine, 0) + 1
        return counts

    def summary(self) -> str:
        """One line: parameters per engine and anything not exact, with the fix.

        Quantities not covered are grouped by what would cover them (the fix of
        their reason, or the reason where it names none).
        """
        engines = ", ".join(f"{n} from {e}" for e, n in sorted(self.engines().items()))
        worst: dict[str, Status] = {}
        for row in self.params:
            for key, status in row.quantities.items():
                if _RANK[status.kind] > _RANK[worst.get(key, _EXACT).kind]:
                    worst[key] = status
        groups: dict[tuple[str, str], list[str]] = {}
        for key, status in worst.items():
            note = _remedy(status.how) if status.kind == MISSING else ""
            if status.kind == ESTIMATED and "in place of the Hessian" in status.how:
                note = "the GGN, in place of the Hessian"
            groups.setdefault((status.kind, note), []).append(key)
        flagged = "; ".join(
            f"{' and '.join(keys)} {kind}" + (f" ({note})" if note else "")
            for (kind, note), keys in groups.items()
        )
        tail = f"; {flagged}" if flagged else "; every quantity exact"
        when = "" if self.step is None else f" at step {self.step}"
        return (
            f"cockpit coverage{when}: per-sample results for {len(self.params)} "
            f"parameter tensors ({engines}){tail}. See cockpit.coverage()."
        )

    def __str__(self) -> str:
        lines = [self.summary()]
        for row in self.params:
            why = f" ({row.route.reason})" if row.route.reason else ""
            how = f", {row.route.method}" if row.route.method else ""
            lines.append(f"  {row.label}: {row.route.engine}{how}{why}")
            for key, status in row.quantities.items():
                lines.append(f"    {key}: {status}")
        return "\n".join(lines)


_EXACT = Status(EXACT, "")


def _remedy(how: str) -> str:
    """What covers a quantity missing for reason ``how``: its fix, or the reason."""
    _, found, fix = how.partition("Fix: ")
    return f"fix: {fix.rstrip('.')}" if found else how


def with_fix(reason: str, fix: str) -> str:
    """A not-covered status's text: the reason and, if any, the fix."""
    return f"{reason}. Fix: {fix}" if fix else reason


def status_for(
    needs: frozenset[Need],
    route: Route,
    curvature: str | None,
) -> Status:
    """The status of a quantity with ``needs`` for a parameter routed by ``route``.

    Args:
        needs: What the quantity reads at the step.
        route: The parameter's route.
        curvature: Why BackPACK's curvature is unavailable (``None``: available).
    """
    statuses = [Status(EXACT, "gradient")]
    if needs & PER_SAMPLE_NEEDS:
        how = {BACKPACK: "backpack", AUTOGRAD: "autograd", UNUSED: "zero: unused"}
        statuses.append(Status(EXACT, how.get(route.engine, route.engine)))
    if needs & CURVATURE_NEEDS:
        if curvature is not None:
            statuses.append(Status(MISSING, curvature))
        elif Need.DIAG_GGN_MC in needs:
            statuses.append(Status(ESTIMATED, "backpack, Monte-Carlo GGN"))
        else:
            statuses.append(Status(EXACT, "backpack"))
    if Need.HESSIAN_VECTOR_PRODUCTS in needs:
        statuses.append(Status(EXACT, "Hessian-vector products"))
    return max(statuses, key=lambda s: (_RANK[s.kind], s.how != "gradient"))


def static_coverage(
    router, quantities: Sequence, labels: Sequence[str], probes: int = 16
) -> Coverage:
    """The report before any step, from the model's structure alone.

    Args:
        router: The cockpit's :class:`~cockpit.engines.routing.Router`.
        quantities: The cockpit's quantities (all their needs, whatever the step).
        labels: A label per parameter.
        probes: Hessian-vector products of a Hutchinson estimate.
    """
    needs = {id(q): frozenset(q.needs) for q in quantities}
    every = frozenset().union(*needs.values())
    routes = router.static_routes(every)
    problem = None
    if every & CURVATURE_NEEDS:
        step = EngineStep(-1, router.params, needs=every)
        decline = router.curvature_decline(routes, step)
        problem = with_fix(decline.message, decline.fix) if decline else None
    rows = []
    for index, route in enumerate(routes):
        statuses = {}
        for q in quantities:
            wanted = needs[id(q)] & CURVATURE_NEEDS
            if problem is not None and wanted and wanted <= q.estimable:
                statuses[q.key] = Status(ESTIMATED, expected_method(q, probes))
            else:
                statuses[q.key] = status_for(needs[id(q)], route, problem)
        rows.append(ParamCoverage(index, labels[index], route, statuses))
    return Coverage(None, rows)
