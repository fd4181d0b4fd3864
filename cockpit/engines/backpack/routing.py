"""When BackPACK's per-layer rules are right: the BackPACK engine's routing rules.

Like opacus' validators, each rule is a small function registered with
:func:`rule` (structure alone) or :func:`step_rule` (this step's graph); the
BackPACK engine serves a parameter only where no rule declines it:

1. exactly one module owns it (not tied to a second module),
2. that module is ``backpack.extend``-ed and BackPACK has a rule for its exact type
   in every first-order extension of the step, and the rule accepts its settings
   (e.g. BackPACK's LSTM rule needs ``batch_first=True`` and one layer),
3. the graph of the per-sample losses uses the parameter once (a second use, as
   with weight tying, a shared layer or ``x @ layer.weight`` in forward code, is
   invisible to the module's rule), and the module ran in its parameters' dtype
   (not under ``torch.autocast``),
4. no batch norm that normalises with mini-batch statistics comes after it
   (:func:`batch_mixing`): that mixes the samples,
5. the first axis of its output is the sample axis: the gradient of sample ``a``'s
   loss reaches only slice ``a`` of it (:class:`SampleAxisProbe`, checked for the
   first and the last sample, the first time a module is seen with given shapes).

Everything declined goes to the next engine (replay, then batched autograd), with
the :class:`~cockpit.engines.base.Decline` recorded for ``Cockpit.coverage()``.
BackPACK's curvature diagonals backpropagate through every layer, so they are used
only when BackPACK serves every parameter and the modules form an
``nn.Sequential`` (:func:`curvature_decline`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.nn import Module, Sequential

from cockpit.engines.backpack.hooks import TAKEN_OFF, hooked_node, rewired
from cockpit.engines.base import Decline, EngineStep, Route, Why
from cockpit.engines.modules import ancestors, common_container, describe, graph_uses

#: Rules on the model's structure: ``(module, attribute, requested, rule_problem)``.
STATIC_RULES: list[Callable] = []
#: Rules on this step's graph: ``(step, index, module, count) -> Decline | None``.
STEP_RULES: list[Callable] = []

_CURVATURE_FIX = (
    "build the model from nn.Sequential with layers BackPACK supports, or drop the "
    "quantity"
)
_AUTOCAST_CURVATURE_FIX = (
    "run the forward pass of tracked steps outside torch.autocast, e.g. "
    "`torch.autocast(device_type, dtype=..., enabled=not "
    "cockpit.plan(step).active)` (those steps then compute in the parameters' "
    "dtype), or drop the quantity"
)


def rule(function: Callable) -> Callable:
    """Register a structural rule (asked before every step and for the report)."""
    STATIC_RULES.append(function)
    return function


def step_rule(function: Callable) -> Callable:
    """Register a rule on the step's graph of the per-sample losses."""
    STEP_RULES.append(function)
    return function


def extended(module: Module) -> bool:
    """Whether ``backpack.extend`` was called on ``module``."""
    return bool(getattr(module, "_backpack_extend", False))


# --- structural rules -----------------------------------------------------------------
@rule
def _extended(module, attribute, requested, rule_problem) -> Decline | None:
    if not extended(module):
        return Decline(
            Why.NOT_EXTENDED,
            f"{describe(module)} is not backpack.extend-ed",
            "call backpack.extend() on the model and the loss function",
        )
    return None


@rule
def _has_rules(module, attribute, requested, rule_problem) -> Decline | None:
    for extension in requested:
        problem = rule_problem(module, extension)
        if problem is not None:
            return Decline(Why.NO_RULE, problem)
    return None


@rule
def _hooks_kept(module, attribute, requested, rule_problem) -> Decline | None:
    found = rewired(module)
    if found is not None and found[0] == TAKEN_OFF:
        return Decline(
            Why.OTHER,
            f"cockpit took BackPACK's hooks off {describe(module)}: {found[1]}",
        )
    return None


# --- rules on the step's graph --------------------------------------------------------
@step_rule
def _used_once(step: EngineStep, index, module, count) -> Decline | None:
    if count > 1 and not isinstance(module, torch.nn.RNNBase):
        return Decline(
            Why.SHARED_USE,
            f"used {count} times in the forward pass (weight tying, a shared "
            "layer or forward code reading the parameter)",
        )
    output = getattr(module, "output", None)
    if not isinstance(output, Tensor) or output.grad_fn not in step.nodes:
        return Decline(
            Why.NOT_RUN,
            f"{describe(module)} did not run in this forward pass (its parameters "
            "are used by other code)",
        )
    return None


@step_rule
def _hook_reached(step: EngineStep, index, module, count) -> Decline | None:
    node = hooked_node(module)
    if node is not None and node not in step.nodes:
        return Decline(
            Why.NOT_RUN,
            f"{describe(module)}'s output was changed in place through a view, "
            "where BackPACK's hook cannot see its gradient",
        )
    return None


@step_rule
def _one_dtype(step: EngineStep, index, module, count) -> Decline | None:
    """BackPACK's rules cannot take a module's mixed dtypes (autocast)."""
    own = {p.dtype for p in module.parameters(recurse=False)}
    seen = {}
    for what in ("input0", "output"):
        tensor = getattr(module, what, None)
        if isinstance(tensor, Tensor) and tensor.is_floating_point():
            seen[what] = tensor.dtype
    if not own or all(dtype in own for dtype in seen.values()):
        return None
    name = {"input0": "input", "output": "output"}
    found = ", ".join(f"{name[w]} {_dtype_name(d)}" for w, d in seen.items())
    params = "/".join(sorted(_dtype_name(d) for d in own))
    return Decline(
        Why.AUTOCAST,
        f"{Why.AUTOCAST.value} ({found}, parameters {params}): BackPACK's rules "
        "need one dtype; autograd differentiates the autocast graph",
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- samples that mix: batch norms with mini-batch statistics -------------------------
def is_training_batchnorm(module: Module) -> bool:
    """Whether ``module`` is a BatchNorm layer normalising with mini-batch statistics.

    In train mode it always does; in eval mode only without running statistics
    (``track_running_stats=False``).
    """
    if not isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        return False
    return module.training or module.running_mean is None


def batchnorms(roots: Sequence[Module]) -> list[tuple[str, Module]]:
    """``(label, layer)`` of the BatchNorm layers in ``roots``.

    With or without parameters of their own (``affine=False``); the label is the
    class and the qualified name, e.g. ``BatchNorm2d 'b.0.bn'``.
    """
    layers: dict[int, tuple[str, Module]] = {}
    for root in roots:
        for name, module in root.named_modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                label = f"{type(module).__name__} {name!r}" if name else ""
                layers.setdefault(id(module), (label or type(module).__name__, module))
    return list(layers.values())


def batch_mixing(
    params: Sequence[Tensor], nodes: set, layers: list[tuple[str, Module]]
) -> dict[int, str]:
    """Parameters whose BackPACK per-sample results mix samples, with why.

    A batch norm that normalises with mini-batch statistics (a BatchNorm layer in
    train mode, or without running statistics; ``F.batch_norm`` with
    ``training=True``) makes sample ``i``'s loss depend on every sample's input to
    it. BackPACK forms a layer's per-sample results from its input and the
    gradient of the mini-batch loss at its output; for the layers before such a
    batch norm these split the mini-batch gradient by input sample (they sum to
    it) instead of giving ``d l_i / d theta``. The layers after it, and its own
    weight and bias, are not affected. The batch norms are found among the
    autograd nodes of the step's losses (every call, also of a shared layer or a
    functional one); "before" means reached by the graph of a node's input.

    Args:
        params: The cockpit's parameters.
        nodes: The autograd nodes of the step's (per-sample) losses.
        layers: The BatchNorm layers around the model (labels of their calls).

    Returns:
        Parameter index -> the batch norms responsible, e.g.
        ``"BatchNorm2d 'blocks.0.bn' and 3 more batch norms"``.
    """
    known_calls = {}  # node -> (label, layer) of the extended layers' last calls
    for label, module in layers:
        output = getattr(module, "output", None)
        if isinstance(output, Tensor) and output.grad_fn is not None:
            known_calls.setdefault(output.grad_fn, (label, module))
    roots, labels = [], set()
    for node in nodes:
        if "BatchNormBackward" not in type(node).__name__:
            continue
        known = known_calls.get(node)
        training = getattr(node, "_saved_training", None)
        if training is None:  # a kernel that does not save it: ask the layer
            training = is_training_batchnorm(known[1]) if known else True
        if not training:
            continue
        labels.add(known[0] if known else "a batch_norm call")
        source = node.next_functions[0][0] if node.next_functions else None
        if source is not None:
            roots.append(source)
    if not roots:
        return {}
    first, *others = sorted(labels)
    who = f"{first} and {len(others)} more batch norms" if others else first
    _, reached = graph_uses(roots)
    for root in roots:  # a parameter normalised directly
        if getattr(root, "variable", None) is not None:
            reached[id(root.variable)] += 1
    return {i: who for i, p in enumerate(params) if id(p) in reached}


def mixing_decline(who: str) -> Decline:
    """The decline of a parameter before batch norms ``who``."""
    return Decline(
        Why.MIXED_BY_BATCHNORM,
        f"samples mix through {who} after it (normalised with mini-batch "
        "statistics), so BackPACK's per-sample results would split the mini-batch "
        "gradient by input sample instead of giving d l_i / d theta",
        "track fewer steps (a sparser track_schedule), normalise per sample "
        "(GroupNorm, LayerNorm) instead, or give the Cockpit only the parameters "
        "after the last BatchNorm",
    )


# --- the sample axis ------------------------------------------------------------------
class SampleAxisProbe:
    """Finds modules whose output's first axis is not the sample axis (cached).

    Args:
        quiet: A context for the probes' extra backward passes.
    """

    def __init__(self, quiet):
        self._quiet = quiet
        self._probed: dict[tuple, bool] = {}

    def failed(self, losses: Tensor, modules: list[Module]) -> set[int]:
        """Return ids of ``modules`` whose output's first axis is not the sample axis.

        The gradient of sample ``a``'s loss must reach only slice ``a`` of the
        output's first axis (checked for the first and the last sample, once per
        module and shapes).
        """
        from cockpit.engines.autograd import sample_losses

        n = losses.shape[0]
        keys = {id(m): _probe_key(m) for m in modules}
        todo = [m for m in modules if keys[id(m)] not in self._probed]
        if todo:
            flat = sample_losses(losses)
            ok = {id(m): True for m in todo}
            outputs = [m.output for m in todo]
            with self._quiet():
                for a in (0, n - 1):
                    grads = torch.autograd.grad(
                        flat[a], outputs, retain_graph=True, allow_unused=True
                    )
                    for module, grad in zip(todo, grads, strict=True):
                        if grad is None:
                            continue
                        elsewhere = (
                            grad[:a].count_nonzero() + grad[a + 1 :].count_nonzero()
                        )
                        if int(elsewhere) > 0:
                            ok[id(module)] = False
            for module in todo:
                self._probed[keys[id(module)]] = ok[id(module)]
        return {id(m) for m in modules if not self._probed[keys[id(m)]]}


def sample_axis_decline(module: Module, n: int) -> Decline:
    """The decline of a module whose probe failed (names a wrong first axis)."""
    for what in ("input0", "output"):
        tensor = getattr(module, what, None)
        if isinstance(tensor, Tensor) and (tensor.dim() == 0 or tensor.shape[0] != n):
            size = tensor.shape[0] if tensor.dim() else "none"
            return Decline(
                Why.SAMPLE_AXIS,
                f"the first axis of {describe(module)}'s "
                f"{'input' if what == 'input0' else 'output'} has size {size}, "
                f"not the batch size {n} (e.g. a batch_first=False layout)",
            )
    return Decline(
        Why.SAMPLE_AXIS,
        f"the first axis of {describe(module)}'s output is not the sample axis "
        "(e.g. a batch_first=False layout)",
    )


def _probe_key(module: Module) -> tuple:
    inputs = getattr(module, "input0", None)
    shape = tuple(inputs.shape) if isinstance(inputs, Tensor) else None
    return (id(module), shape, tuple(module.output.shape))


# --- curvature ------------------------------------------------------------------------
def curvature_decline(
    routes: Sequence[Route],
    owners: list[Module],
    parents: dict,
    requested: Sequence,
    rule_problem,
) -> Decline | None:
    """Why BackPACK's curvature extensions ``requested`` cannot run (``None``: can)."""
    problem, autocast = None, False
    for route in routes:
        if route.engine not in ("backpack", "unused"):
            autocast = route.declined(Why.AUTOCAST)
            problem = (
                f"{route.module or 'a parameter'} gets its per-sample gradients "
                f"from {route.engine} ({route.reason}), and BackPACK's curvature "
                "needs a BackPACK rule for every layer"
            )
            break
    if problem is None:
        root = common_container(owners, parents)
        if root is None:
            problem = "the parameters do not belong to one model"
        else:
            problem = _structure_problem(root, requested, rule_problem)
    if problem is None:
        return None
    message = f"BackPACK cannot compute curvature diagonals for this model: {problem}"
    if autocast:
        return Decline(Why.AUTOCAST, message, _AUTOCAST_CURVATURE_FIX)
    return Decline(Why.NO_RULE, message, _CURVATURE_FIX)


def curvature_possible(root: Module, extensions: Sequence, rule_problem) -> bool:
    """Whether BackPACK could compute curvature diagonals of ``root`` at all.

    True if one of the curvature ``extensions`` has a rule for every layer and
    every container is an ``nn.Sequential`` (or a converted ``GraphModule``):
    :func:`curvature_decline` would not refuse the model's structure.
    """
    return any(_structure_problem(root, [e], rule_problem) is None for e in extensions)


def _structure_problem(root: Module, requested, rule_problem) -> str | None:
    for module in root.modules():
        if any(True for _ in module.children()):
            if type(module) is not Sequential and not isinstance(
                module, torch.fx.GraphModule
            ):
                return (
                    f"{describe(module)} has its own forward(); BackPACK's "
                    "curvature passes only through nn.Sequential containers "
                    "(or a model converted by backpack.extend(model, "
                    "use_converter=True))"
                )
            continue
        for extension in requested:
            problem = rule_problem(module, extension)
            if problem is not None:
                return problem
    return None


# --- in-place modules -----------------------------------------------------------------
def in_place_modules(roots: Sequence[Module]) -> list[tuple[str, Module]]:
    """In-place modules among extended layers, as ``(label, module)``.

    Modules with ``inplace=True`` (ReLU, Dropout, ...) change their input; those
    that are extended or sit beside an extended layer are returned (a model
    without extended layers, e.g. a teacher network, is left alone). BackPACK's
    backward hooks return a module's output (and take its input) as a view that
    autograd forbids changing in place, so such a module stops the forward pass
    with "Output 0 of BackwardHookFunction is a view and is being modified
    inplace".
    """
    found, seen = [], set()
    for root in roots:
        if extended(root) and getattr(root, "inplace", None) is True:
            found.append((type(root).__name__, root))
        for name, parent in root.named_modules():
            children = list(parent.named_children())
            # beside an extended layer it changes that layer's hooked output
            near = any(extended(child) for _, child in children)
            for child_name, child in children:
                if id(child) in seen or getattr(child, "inplace", None) is not True:
                    continue
                if extended(child) or near:
                    seen.add(id(child))
                    where = f"{name}.{child_name}" if name else child_name
                    found.append((f"{type(child).__name__} '{where}'", child))
    return found


def roots_of(owners: dict, parents: dict) -> list[Module]:
    """The outermost modules holding the parameters' owners."""
    roots: dict[int, Module] = {}
    for found in owners.values():
        for module, _ in found:
            top = ancestors(module, parents)[-1]
            roots.setdefault(id(top), top)
    return list(roots.values())
