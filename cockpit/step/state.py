"""What a step feature may read of a tracked step, and what it hands back.

A step feature (:mod:`cockpit.step.features`) sees the step through a
:class:`StepState`: a small, read-only object made once when the step opens. It
does not write to it. What a feature produces for the rest of the step (the
data-parallel collectives' state, values computed from the forward graph,
quantities shown an estimated curvature, the estimate's per-probe traces, the
joined batch's context, ...) it *returns* as a :class:`Produced`, which the step
(:class:`~cockpit.step.run.StepRun`) folds into what it has so far and hands to the
features that run after it. Data flows one way: from the state to the features,
from the features to the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from torch import Tensor

from cockpit.context import StepInfo
from cockpit.engines.base import Engine, EngineStep
from cockpit.step.ledger import Ledger
from cockpit.step.plan import StepPlan


@dataclass(frozen=True, slots=True)
class StepState:
    """One tracked step as the step features see it (read-only).

    Attributes:
        step: The global step.
        params: The cockpit's parameters.
        info: The step's ``info``.
        plan: The step's plan (after the routing left out what no engine serves).
        probes: Hessian-vector products of a Hutchinson estimate
            (``Cockpit.HUTCHINSON_PROBES``).
        generator: The cockpit's random source of probes and drawn labels.
        communicator: The data-parallel communicator, or ``None``.
        no_sync: The backward pass runs inside DDP's ``no_sync()``.
        ledger: The step's account: what is estimated, left out, recorded.
        engine: What the engines read of the step (the per-sample losses,
            ``quiet()`` for extra backward passes before the user's).
        engines: The cockpit's engines, in their order.
        dispatcher: Hands per-parameter results to the quantities.
        checks: The cockpit's step checks (labels, warnings said once).
        recorder: Where the step's values go.
    """

    step: int
    params: Sequence[Tensor]
    info: StepInfo
    plan: StepPlan
    probes: int
    generator: Any
    communicator: Any
    no_sync: bool
    ledger: Ledger
    engine: EngineStep
    engines: tuple[Engine, ...]
    dispatcher: Any
    checks: Any
    recorder: Any


@dataclass(frozen=True)
class Produced:
    """What step features hand back to the step (each field: who writes it).

    Attributes:
        comm: The data-parallel step's collective state (when the step opens);
            the quantities begin the step with it.
        early: ``(id(quantity), (results, error))`` of quantities tracked from
            the forward graph before the backward pass.
        guards: The quantities' errors while reading the backward pass's results
            or an estimated curvature, kept for after it
            (:class:`~cockpit.step.features.backward_checks.Guarded`).
        estimates: ``(quantities, traces)`` of each curvature estimate drawn at
            this step: the quantities it served and its traces per draw and
            parameter (a data-parallel step joins each for its own quantities'
            standard errors; an exact diagonal has none).
        undifferentiable: ``(quantity, error)`` of quantities whose second
            derivatives PyTorch cannot compute (the step says the fix).
        context: The joined batch's context of a data-parallel step (the
            quantities are tracked with it).
        tolerant: The step is not finite: a quantity that fails is left out.
        stop: End the step without tracking anything.
    """

    comm: Any = None
    early: tuple = ()
    guards: tuple = ()
    estimates: tuple = ()
    undifferentiable: tuple = ()
    context: Any = None
    tolerant: bool = False
    stop: bool = False

    def then(self, later: Produced | None) -> Produced:
        """What the step has after ``later`` (a feature's result) joined it."""
        if later is None:
            return self
        return Produced(
            comm=later.comm if later.comm is not None else self.comm,
            early=self.early + tuple(later.early),
            guards=self.guards + tuple(later.guards),
            estimates=self.estimates + tuple(later.estimates),
            undifferentiable=self.undifferentiable + tuple(later.undifferentiable),
            context=later.context if later.context is not None else self.context,
            tolerant=self.tolerant or later.tolerant,
            stop=self.stop or later.stop,
        )
