"""Input validation and clear error messages for the cockpit.

Every check here is cheap: shape and attribute checks run before the backward pass;
the value checks (is the loss mean-reduced, are the loss and the gradients finite)
are gathered into one small tensor after the backward pass and read with a single
device synchronisation per tracked step (:func:`step_health`).

Each message names the problem and the fix. Problems that make the tracked values
wrong raise; problems that training can live with warn once with a
:class:`CockpitWarning` (filter them with ``warnings.filterwarnings("ignore",
category=cockpit.step.checks.CockpitWarning)``).
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.nn import Module

from cockpit.context import StepInfo, missing_info_message
from cockpit.errors import CockpitWarning
from cockpit.log.keys import NONFINITE_KEY
from cockpit.precision import LOW_PRECISION, compute_dtype

#: Where BackPACK lists the layers each extension supports.
SUPPORTED_LAYERS_URL = "https://docs.backpack.pt/en/master/supported-layers.html"


# ATen's reduction enum as saved on loss nodes of the autograd graph.
_REDUCTION_SUM = 2

# Relative and absolute tolerance when comparing the loss with the mean of the
# per-sample losses (float32 sums of a few thousand terms stay far inside).
_RTOL = 1e-3
_ATOL = 1e-7
# Half-precision losses: the loss and the mean of the per-sample losses are each
# rounded once to the loss dtype, so they may differ by two units in the last
# place; the tolerance is that many machine epsilons (bfloat16: 2 * 2**-7).
_ULPS = 2


# --- before the backward pass ---------------------------------------------------------
def check_step_info(step_info: StepInfo) -> None:
    """Check ``batch_size``, ``individual_losses`` and ``loss`` without reading values.

    Args:
        step_info: The step's info.

    Raises:
        ValueError: If ``batch_size`` is not a positive int, ``individual_losses``
            is not a tensor with a batch axis, the two disagree, or the loss node
            says it was sum-reduced.
    """
    step = step_info.global_step
    batch_size = step_info.get("batch_size")
    if step_info.has("batch_size"):
        if (
            isinstance(batch_size, bool)
            or not isinstance(batch_size, numbers.Integral)
            or batch_size < 1
        ):
            raise ValueError(
                f"info['batch_size'] must be a positive int (the number of samples "
                f"in the mini-batch), got {batch_size!r} at step {step}. Fix: pass "
                "info={'batch_size': inputs.shape[0], ...}."
            )
    if step_info.has("individual_losses"):
        losses = step_info.get("individual_losses")
        if not isinstance(losses, Tensor) or losses.dim() == 0:
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else None
            raise ValueError(
                "info['individual_losses'] must be a tensor of per-sample losses with "
                f"the batch axis first (shape [N]), got {type(losses).__name__} "
                f"{'of shape ' + str(shape) if shape is not None else ''} at step "
                f"{step}. Fix: compute them with reduction='none', e.g. "
                "torch.nn.CrossEntropyLoss(reduction='none')(outputs, targets)."
            )
        if batch_size is not None and losses.shape[0] != batch_size:
            raise ValueError(
                f"info['batch_size'] is {batch_size} but info['individual_losses'] "
                f"holds {losses.shape[0]} per-sample losses (shape "
                f"{tuple(losses.shape)}) at step {step}. Fix: pass the size of the "
                "mini-batch that went through the forward pass, "
                "info={'batch_size': inputs.shape[0], ...}, and the per-sample "
                "losses of that same batch."
            )
    if step_info.has("loss"):
        node = _loss_node(step_info.get("loss"))
        if getattr(node, "_saved_reduction", None) == _REDUCTION_SUM:
            raise ValueError(sum_reduced_message(step, type(node).__name__))


def _loss_node(loss: Any):
    """The autograd node that produced ``loss``, behind BackPACK's hook wrappers."""
    node = getattr(loss, "grad_fn", None)
    for _ in range(4):  # extended modules wrap their outputs in hook nodes
        if node is None or type(node).__name__ != "BackwardHookFunctionBackward":
            break
        node = node.next_functions[0][0] if node.next_functions else None
    return node


def sum_reduced_message(global_step: int, where: str) -> str:
    """The message for a loss that is summed over the mini-batch instead of averaged."""
    return (
        f"The loss at step {global_step} is sum-reduced ({where}), but cockpit "
        "needs the mean-reduced loss: BackPACK's per-sample gradients are scaled "
        "by the reduction, so every per-sample quantity would be off by a factor "
        "of the batch size. Fix: use reduction='mean' (the default), e.g. "
        "torch.nn.CrossEntropyLoss(), and pass per-sample losses computed with "
        "reduction='none' as info['individual_losses']."
    )


# --- after the backward pass ----------------------------------------------------------
@dataclass(frozen=True)
class StepHealth:
    """What the value checks of one step found.

    Attributes:
        loss: The loss as a float (``None`` if not handed in).
        mean_individual: The mean of ``individual_losses`` (``None`` if not both
            ``loss`` and ``individual_losses`` were handed in).
        grads_finite: Whether the norm of all gradients is finite (``None`` if no
            parameter has a gradient).
        rtol: Relative tolerance of the loss check (wider for half-precision
            losses, see :data:`_ULPS`).
    """

    loss: float | None
    mean_individual: float | None
    grads_finite: bool | None
    rtol: float = _RTOL

    @property
    def nonfinite(self) -> list[str]:
        """What was not finite: a sublist of ``["loss", "gradients"]``."""
        found = []
        if self.loss is not None and not math.isfinite(self.loss):
            found.append("loss")
        if self.grads_finite is False:
            found.append("gradients")
        return found


def _local(tensor: Tensor) -> Tensor:
    """This process's part of a ``DTensor``; any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _scalar(value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach().reshape(-1)[0]
    return torch.tensor(float(value))


def step_health(step_info: StepInfo, params: Sequence[Tensor]) -> StepHealth:
    """Read the loss, the mean per-sample loss and gradient finiteness at once.

    Everything is combined into one small tensor and copied to the host once.

    Args:
        step_info: The step's info.
        params: The parameters whose ``.grad`` is checked.

    Returns:
        The findings.
    """
    # a sharded (DTensor) gradient: this process's rows (no collective here)
    grads = [_local(p.grad) for p in params if p.grad is not None]
    pieces: list[Tensor] = []
    with torch.no_grad():
        has_loss = step_info.has("loss")
        if has_loss:
            pieces.append(_scalar(step_info.get("loss")))
        has_both = has_loss and step_info.has("individual_losses")
        rtol = _RTOL
        if has_both:
            losses = step_info.get("individual_losses").detach()
            pieces.append(losses.to(compute_dtype(losses.dtype)).mean())
            for value in (step_info.get("loss"), losses):
                if isinstance(value, Tensor) and value.dtype in LOW_PRECISION:
                    rtol = max(rtol, _ULPS * torch.finfo(value.dtype).eps)
        if grads:
            # non-finite iff an entry is NaN or inf, or the norm overflows the dtype
            # (then norm-based quantities are inf too); one fused kernel per device
            # and dtype, unlike the max-abs norm, which is slow on CPU
            pieces.append(torch.nn.utils.get_total_norm(grads, norm_type=2.0))
        if not pieces:
            return StepHealth(None, None, None)
        device = pieces[-1].device
        values = torch.stack([t.to(device=device, dtype=torch.float32) for t in pieces])
        values = values.tolist()
    loss = values.pop(0) if has_loss else None
    mean = values.pop(0) if has_both else None
    grads_finite = math.isfinite(values.pop(0)) if grads else None
    return StepHealth(loss, mean, grads_finite, rtol if has_both else _RTOL)


def reduction_problem(health: StepHealth, batch_size: int) -> str | None:
    """Compare the loss with the mean of the per-sample losses.

    Args:
        health: The step's findings (with ``loss`` and ``mean_individual``).
        batch_size: The number of per-sample losses N.

    Returns:
        ``"sum"`` if the loss equals N times the mean (a sum-reduced loss),
        ``"mismatch"`` if it equals neither the mean nor the sum, ``None`` if it
        matches the mean or cannot be checked (missing or non-finite values).
    """
    loss, mean = health.loss, health.mean_individual
    if (
        loss is None
        or mean is None
        or not (math.isfinite(loss) and math.isfinite(mean))
    ):
        return None
    if math.isclose(loss, mean, rel_tol=health.rtol, abs_tol=_ATOL):
        return None
    summed = batch_size * mean
    if (
        batch_size > 1
        and abs(mean) > _ATOL
        and math.isclose(loss, summed, rel_tol=_RTOL)
    ):
        return "sum"
    return "mismatch"


def mismatch_message(health: StepHealth, global_step: int) -> str:
    """The warning for a loss that differs from the mean of the per-sample losses."""
    return (
        f"At step {global_step}, info['loss'] ({health.loss:.6g}) differs from the "
        f"mean of info['individual_losses'] ({health.mean_individual:.6g}). "
        "Quantities that combine them (e.g. Alpha) will be inconsistent. Fix: pass "
        "the mean-reduced loss of the mini-batch and the per-sample losses of the "
        "same forward pass; keep penalty terms (e.g. weight decay) out of the loss. "
        "(Warned once.)"
    )


def nonfinite_message(what: Sequence[str], global_step: int, key: str) -> str:
    """The warning for a step with a NaN or infinite loss or gradient."""
    return (
        f"Step {global_step}: the {' and the '.join(what)} "
        f"{'is' if len(what) == 1 else 'are'} not finite (NaN or inf). cockpit keeps "
        f"going and records such steps under the history key {key!r}; quantities "
        "there may be NaN or missing. Fix: lower the learning rate, clip gradients "
        "(torch.nn.utils.clip_grad_norm_) or check the data for NaNs. "
        "(Warned once; later non-finite steps are only recorded.)"
    )


# --- naming things --------------------------------------------------------------------
def param_label(index: int, param: Tensor, name: str | None = None) -> str:
    """Describe a parameter by name (if known), position and shape."""
    shape = f"shape {tuple(param.shape)}"
    return f"{name!r} (#{index}, {shape})" if name else f"#{index} ({shape})"


def module_label(module: Module, owned: Sequence[tuple[int, str | None]]) -> str:
    """Describe a module by class and, if its parameters are named, by its name.

    Args:
        module: The module.
        owned: ``(index, name)`` of the cockpit parameters the module owns.

    Returns:
        E.g. ``"LayerNorm 'encoder.norm'"`` or ``"LayerNorm (owns parameter #2)"``.
    """
    cls = type(module).__name__
    names = [name for _, name in owned if name]
    if names:
        prefix = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
        return f"{cls} {prefix!r}" if prefix else f"{cls} (top-level module)"
    if owned:
        indices = ", ".join(f"#{i}" for i, _ in owned)
        return f"{cls} (owns parameter {indices})"
    children = [type(child).__name__ for child in module.children()]
    if children:
        return f"the module {cls} (with sub-modules {', '.join(children)})"
    return f"{cls} ({module!r})"


def batchnorm_message(label: str, who: str, global_step: int) -> str:
    """The error for a mini-batch-statistics BatchNorm layer BackPACK refused.

    (Routing sends the layers before such a layer to autograd, and cockpit's rule
    covers its weight and bias; this is what remains, e.g. a user's extension.)
    """
    return (
        f"{label} normalises with statistics of the whole mini-batch at step "
        f"{global_step} (train mode, or no running statistics), so per-sample "
        "gradients and curvature "
        f"mix samples; BackPACK refuses to compute the results needed by {who}. "
        "Fix: drop these quantities (on such models HessTrace and TICTrace are "
        "estimated from Hessian-vector products), replace BatchNorm (e.g. by "
        "GroupNorm), or, for a layer with running statistics, call model.eval() "
        "before the forward pass of tracked steps and model.train() after (those "
        "steps then train with the running statistics)."
    )


def unsupported_message(
    label: str,
    extension: str,
    who: str,
    global_step: int,
    first_order: bool,
    container: bool = False,
) -> str:
    """The message for a layer that BackPACK has no extension for.

    Args:
        label: The module, as described by :func:`module_label`.
        extension: Name of the BackPACK extension that failed.
        who: The quantities that need it.
        global_step: The step.
        first_order: Whether only first-order (per-sample gradient) results failed.
        container: Whether the module has sub-modules (a custom ``forward``).

    Returns:
        The message.
    """
    if container:
        fix = (
            "BackPACK passes curvature only through torch.nn.Sequential containers, "
            "not through a module with its own forward(); build the model from "
            "nn.Sequential, or extend it with backpack.extend(model, "
            "use_converter=True), or drop these quantities"
        )
    elif first_order:
        fix = (
            "replace the layer by one BackPACK supports, pass the Cockpit only the "
            "parameters of supported layers, or drop these quantities"
        )
    else:
        fix = (
            "curvature must flow back through every layer, so replace the layer by "
            "one BackPACK supports or drop these quantities"
        )
    return (
        f"BackPACK cannot compute {extension} for {label}, needed by {who} at step "
        f"{global_step}. Fix: {fix} (supported layers: {SUPPORTED_LAYERS_URL})."
    )


def unextended_loss_message(who: str, global_step: int) -> str:
    """The message for second-order extensions whose backpropagation never started."""
    return (
        f"BackPACK received no curvature information from the loss at step "
        f"{global_step}, needed by {who}. Either the loss function was not "
        "extended, or the model output passes through operations outside "
        "nn.Modules before the loss. Fix: loss_fn = backpack.extend(loss_fn) (e.g. "
        "extend(torch.nn.CrossEntropyLoss())) and compute the loss directly from "
        "the output of the extended model."
    )


def no_gradient_message(labels: Sequence[str]) -> str:
    """The warning for parameters that received no gradient in the backward pass."""
    return (
        f"Parameter(s) {', '.join(labels)} received no gradient (their .grad was not "
        "written by the backward pass, e.g. an unused layer). cockpit treats their "
        "gradients and curvature as zero. Fix: if that is intended, leave them out "
        "of the parameters handed to the Cockpit; otherwise make sure the loss "
        "depends on them. (Warned once.)"
    )


# --- the checks of one step -----------------------------------------------------------
def unreached_message(shapes: str, names: str) -> str:
    """A parameter whose gradient was computed but that no engine reached."""
    return (
        f"BackPACK produced no results for parameter(s) {shapes}, which "
        f"{names} need, although the backward pass computed their "
        "gradients. Fix: call backpack.extend() on the model and on the "
        "loss function before the forward pass, and use every parameter "
        "through the nn.Module that owns it (BackPACK cannot see parameters "
        "used in functional code, e.g. x @ layer.weight)."
    )


def in_place_message(labels: Sequence[str]) -> str:
    """In-place modules of the extended model, switched off by the cockpit."""
    more = f" and {len(labels) - 4} more" if len(labels) > 4 else ""
    return (
        f"Cockpit set inplace=False on {len(labels)} module(s) of the extended "
        f"model ({', '.join(labels[:4])}{more}): BackPACK's backward hooks make "
        "module outputs views that PyTorch forbids changing in place (the forward "
        "pass would stop with 'Output 0 of BackwardHookFunction is a view and is "
        "being modified inplace'). The values are the same unless forward code "
        "reads a module's input again after such a module changed it (it now "
        "reads the unchanged input); memory use grows a little. In-place calls "
        "in your own forward code cannot be seen from here. Fix for those: "
        "torch.relu(x) instead of x.relu_() or F.relu(x, inplace=True) on "
        "outputs of extended modules."
    )


def no_results_message(shapes: str, names: str) -> str:
    """Unextended modules and no per-sample losses for the autograd engine."""
    return (
        f"BackPACK produced no results for parameter(s) {shapes}, which {names} "
        "need: their modules are not extended. Fix: call backpack.extend() on "
        "the model and on the loss function before the forward pass, or pass "
        "info['individual_losses'] (reduction='none', with its graph) so that "
        "cockpit computes them with autograd."
    )


def repeated_backward_message(step: int, module_class: str) -> str:
    """A second backward pass through extended modules inside a tracked step."""
    return (
        f"Several backward passes ran inside the tracked step {step} "
        f"(BackPACK had already freed what {module_class} "
        "stored in the forward pass). Fix: call loss.backward() once inside "
        "`with cockpit(step, ...)`; accumulate micro-batches outside tracked "
        "steps, or track one micro-batch per optimizer step."
    )


class StepChecks:
    """The checks around a tracked step, and the warnings they give (each once).

    (Not the diagnosis of training, :mod:`cockpit.diagnosis`: these check the
    step's input and name each parameter and module in their messages.)

    Args:
        params: The cockpit's parameters.
        names: Their names where known (``named_parameters()``), else ``None``.
    """

    def __init__(self, params: Sequence[Tensor], names: Sequence[str | None]):
        self._params = params
        self._names = names
        self._index = {id(p): i for i, p in enumerate(params)}
        self._warned: set = set()

    def warn_once(self, key, message: str, stacklevel: int = 4) -> None:
        """Warn with ``message`` unless a warning with ``key`` was given already."""
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, CockpitWarning, stacklevel=stacklevel)

    def missing(
        self,
        recorder,
        steps: Sequence[int],
        key: str | Sequence[str],
        reason: str,
        once=None,
        stacklevel: int = 4,
    ) -> None:
        """Record quantity ``key`` as missing at ``steps`` with ``reason``; warn once.

        Args:
            recorder: Where the reason is noted (under ``missing``).
            steps: The steps without a value (the first is named in the warning).
            key: The quantity's key, or the keys of several missing for one reason:
                one warning names those not warned about before.
            reason: Why, with the fix where there is one.
            once: What makes the warning new (default: one per quantity); for
                several keys, a prefix that each key completes.
            stacklevel: Of the warning, counted from ``warn_once``.
        """
        keys = [key] if isinstance(key, str) else list(key)
        for step in steps:
            for name in keys:
                recorder.note_missing(step, name, reason)
        if isinstance(key, str):
            marks = {key: ("missing", key) if once is None else once}
        else:
            marks = {name: (*(once or ("missing",)), name) for name in keys}
        fresh = [name for name in keys if marks[name] not in self._warned]
        if not fresh:
            return
        self._warned.update(marks[name] for name in fresh[1:])
        self.warn_once(
            marks[fresh[0]],
            f"{', '.join(fresh)} {'has' if len(fresh) == 1 else 'have'} no value at "
            f"step {steps[0]}: {reason}. (Recorded under 'missing'; warned once.)",
            stacklevel=stacklevel,
        )

    def param_label(self, index: int) -> str:
        """Describe parameter ``index`` by name, position and shape."""
        return param_label(index, self._params[index], self._names[index])

    def module_label(self, module: Module) -> str:
        """Describe ``module`` by class and the names of its parameters."""
        owned = [
            (self._index[id(p)], self._names[self._index[id(p)]])
            for p in module.parameters(recurse=False)
            if id(p) in self._index
        ]
        return module_label(module, owned)

    # --- before the backward pass -------------------------------------------------
    def before(self, plan, step_info: StepInfo) -> None:
        """Check ``info`` before any work: types, shapes and the keys the plan needs.

        Raises:
            KeyError: If an active quantity needs an ``info`` key that is missing.
            ValueError: If ``info`` values are malformed or the loss is sum-reduced.
        """
        check_step_info(step_info)
        for key, who in plan.required_info():
            if not step_info.has(key):
                raise KeyError(missing_info_message(key, who, step_info.global_step))

    # --- after the backward pass --------------------------------------------------
    def nonfinite(self, step_info: StepInfo) -> list[str]:
        """Check the loss (reduction, finiteness) and the gradients; one sync.

        Returns:
            What was not finite (empty for a healthy step); warned once.

        Raises:
            ValueError: If the loss is the sum of the per-sample losses.
        """
        health = step_health(step_info, self._params)
        self._check_reduction(health, step_info)
        found = health.nonfinite
        if found:
            step = step_info.global_step
            self.warn_once(NONFINITE_KEY, nonfinite_message(found, step, NONFINITE_KEY))
        return found

    def _check_reduction(self, health: StepHealth, step_info: StepInfo) -> None:
        if health.mean_individual is None:
            return
        step = step_info.global_step
        batch_size = step_info.get("individual_losses").shape[0]
        problem = reduction_problem(health, batch_size)
        if problem == "sum":
            where = (
                f"info['loss'] = {health.loss:.6g} is {batch_size} times the mean "
                f"of info['individual_losses'] = {health.mean_individual:.6g}"
            )
            raise ValueError(sum_reduced_message(step, where))
        if problem == "mismatch":
            self.warn_once("loss-mismatch", mismatch_message(health, step))

    def unreached(self, plan, hook, grads_before) -> list[int]:
        """Sort parameters the engine did not reach into unused and unextended.

        A parameter whose ``.grad`` this backward pass did not write is unused
        (warned once): the quantities see zero results for it. One whose ``.grad``
        was written belongs to a module that is not extended: an error.

        Args:
            plan: The step's plan.
            hook: The engine's hook of the step (``visited`` indices).
            grads_before: ``(grad, version)`` of every parameter before the backward.

        Returns:
            The indices of unused parameters to show with zero results (only if
            some quantity reads inside the backward pass).

        Raises:
            RuntimeError: If an extended quantity lacks results for a parameter
                whose gradient was computed (model not extended).
        """
        unwritten = [
            i
            for i, (p, (grad, version)) in enumerate(
                zip(self._params, grads_before, strict=True)
            )
            if p.grad is grad and (grad is None or grad._version == version)
        ]
        if unwritten:
            labels = [self.param_label(i) for i in unwritten]
            self.warn_once(("no-grad", tuple(unwritten)), no_gradient_message(labels))
        if not plan.consumers:
            return []
        missed = [i for i in range(len(self._params)) if i not in hook.visited]
        unused = set(unwritten)
        unextended = [i for i in missed if i not in unused]
        if unextended:
            shapes = ", ".join(self.param_label(i) for i in unextended)
            names = ", ".join(q.key for q in plan.consumers)
            raise RuntimeError(unreached_message(shapes, names))
        return missed
