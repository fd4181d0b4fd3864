"""The BackPACK engine: the one place that knows BackPACK's savefields and internals.

The hub asks this module which extensions serve a step's needs
(:func:`extensions_for`, :func:`merge_extensions`), enters BackPACK's context for the
backward pass (:func:`backward_context`) with an :class:`ExtensionHook` that shows
each parameter to the quantities as a :class:`~cockpit.param_view.ParamView` and frees
BackPACK's buffers right away, and asks it to explain BackPACK failures
(:func:`explain_failure`). Quantities never read a savefield.

What this module and :mod:`cockpit.engines.backpack.rules` rely on beyond BackPACK's
documented API is listed in :data:`REQUIRED_API`; :func:`check_backpack_api` reports
what an installed BackPACK no longer provides (a test runs it).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from types import TracebackType
from typing import Iterable, Iterator, Mapping, Sequence

import torch
from backpack import backpack, disable, hook_run_extensions, hook_store_io
from backpack import (
    extend as extend,
)  # re-exported: `cockpit` imports BackPACK here only
from backpack.core.derivatives.convnd import weight_jac_t_save_memory
from backpack.extensions.backprop_extension import FAIL_SILENT, BackpropExtension
from torch import Tensor
from torch.nn import Module

from cockpit.engines.backpack.rules import (
    RULE_WRAPPERS,
    PerSampleGradients,
    SkipModules,
    lean_batch_l2,
    lean_diag_ggn_exact,
    lean_diag_ggn_mc,
    lean_diag_hessian,
    lean_sum_grad_squared,
    module_extension_table,
)
from cockpit.errors import quiet_warnings
from cockpit.needs import Need
from cockpit.param_view import Dispatcher, ParamResults
from cockpit.per_sample import (
    DenseGradients,
    FactoredLinearGradients,
    LinearFactors,
)
from cockpit.precision import compute_dtype, upcast

#: BackPACK's savefield for per-sample gradients (``BatchGrad``).
GRAD_BATCH = "grad_batch"
#: BackPACK's savefield for per-sample squared norms (``BatchL2Grad``).
BATCH_L2 = "batch_l2"
#: BackPACK's savefield for the sum of squared per-sample gradients.
SUM_GRAD_SQUARED = "sum_grad_squared"
#: Curvature labels (the quantities' ``curvature=`` argument) are savefields too.
CURVATURE_SAVEFIELDS = ("diag_h", "diag_ggn_exact", "diag_ggn_mc")

#: Savefields of first-order (per-sample gradient) extensions.
FIRST_ORDER_SAVEFIELDS = frozenset({GRAD_BATCH, BATCH_L2, SUM_GRAD_SQUARED})

#: Which needs each savefield serves (for messages naming who needs what).
SAVEFIELD_NEEDS: Mapping[str, frozenset[Need]] = {
    GRAD_BATCH: frozenset(
        {
            Need.INDIVIDUAL_GRADIENTS,
            Need.GRAM,
            Need.PROJECTIONS,
            Need.BATCH_L2,
            Need.SUM_GRAD_SQUARED,
        }
    ),
    BATCH_L2: frozenset({Need.BATCH_L2}),
    SUM_GRAD_SQUARED: frozenset({Need.SUM_GRAD_SQUARED}),
    "diag_h": frozenset({Need.DIAG_H}),
    "diag_ggn_exact": frozenset({Need.DIAG_GGN_EXACT}),
    "diag_ggn_mc": frozenset({Need.DIAG_GGN_MC}),
}

_CURVATURE_EXTENSIONS = {
    Need.DIAG_H: lean_diag_hessian,
    Need.DIAG_GGN_EXACT: lean_diag_ggn_exact,
    Need.DIAG_GGN_MC: lean_diag_ggn_mc,
}
#: Makers of the curvature extensions cockpit runs.
CURVATURE_EXTENSIONS = tuple(_CURVATURE_EXTENSIONS.values())

# Attributes of BackPACK extensions that are bookkeeping, not hyper-parameters.
_NOT_HYPERPARAMETERS = {"saved_quantities"}

#: What cockpit uses of BackPACK beyond its documented API: ``(module, attribute)``.
REQUIRED_API: tuple[tuple[str, str], ...] = (
    # the hooks backpack.extend registers (cockpit rewires them where they would
    # break a model: cockpit.engines.backpack.hooks)
    ("backpack", "hook_store_io"),
    ("backpack", "hook_run_extensions"),
    ("backpack.core.derivatives.convnd", "weight_jac_t_save_memory"),
    ("backpack.extensions.backprop_extension", "BackpropExtension"),
    ("backpack.extensions.firstorder.base", "FirstOrderModuleExtension"),
    ("backpack.extensions.firstorder.batch_grad.conv2d", "BatchGradConv2d"),
    ("backpack.extensions.secondorder.diag_ggn.conv2d", "DiagGGNConv2d"),
    ("backpack.extensions.secondorder.diag_hessian.conv2d", "DiagHConv2d"),
    ("backpack.utils.conv", "unfold_input"),
    # name-mangled table of module rules (cockpit wraps every rule in no_grad)
    ("backpack.extensions", "BatchGrad()._BackpropExtension__module_extensions"),
    # first-order extensions stay silent on layers the autograd engine covers
    ("backpack.extensions.backprop_extension", "FAIL_SILENT"),
    ("backpack.extensions", "BatchGrad()._fail_mode == 'WARNING'"),
    # settings checks of rules that accept only some layer settings (LSTM, RNN)
    ("backpack.core.derivatives.lstm", "callable(LSTMDerivatives._check_parameters)"),
    (
        "backpack.extensions.firstorder.batch_grad.rnn",
        "hasattr(BatchGradLSTM(), '_derivatives')",
    ),
    (
        "backpack.extensions.firstorder.batch_l2_grad.rnn",
        "hasattr(BatchL2LSTM(), 'derivatives')",
    ),
    ("backpack.core.derivatives.rnn", "callable(RNNDerivatives._check_parameters)"),
    # savefields BackPACK's extensions write, which cockpit reads
    ("backpack.extensions", "BatchGrad().savefield == 'grad_batch'"),
    ("backpack.extensions", "BatchL2Grad().savefield == 'batch_l2'"),
    ("backpack.extensions", "SumGradSquared().savefield == 'sum_grad_squared'"),
    ("backpack.extensions", "DiagHessian().savefield == 'diag_h'"),
    ("backpack.extensions", "DiagGGNExact().savefield == 'diag_ggn_exact'"),
    ("backpack.extensions", "DiagGGNMC().savefield == 'diag_ggn_mc'"),
)


def check_backpack_api() -> list[str]:
    """Return what the installed BackPACK lacks of :data:`REQUIRED_API` (empty: ok)."""
    problems = []
    for module_name, expression in REQUIRED_API:
        try:
            module = importlib.import_module(module_name)
            if "(" in expression or "==" in expression:
                ok = eval(expression, vars(module))  # noqa: S307 (our own constants)
            else:
                ok = hasattr(module, expression)
        except Exception as error:  # an import or attribute that moved
            problems.append(f"{module_name}: {expression} ({error})")
            continue
        if ok is False:
            problems.append(f"{module_name}: {expression} is false")
    return problems


#: BackPACK's forward hook (stores a module's inputs and output) and full backward
#: hook (runs the active extensions), as ``backpack.extend`` registers them.
STORE_IO_HOOK = hook_store_io
RUN_EXTENSIONS_HOOK = hook_run_extensions


# --- extensions -----------------------------------------------------------------------
def extensions_for(
    needs: Iterable[Need], low_precision: bool = False
) -> list[BackpropExtension]:
    """Return the cheapest BackPACK extensions that serve all ``needs`` at once.

    Per-sample gradients (cockpit's :class:`PerSampleGradients`) serve every
    first-order need when any need asks for them; otherwise ``BatchL2Grad`` and
    ``SumGradSquared`` give squared norms and second moments without materialising
    per-sample gradients. Curvature diagonals come from BackPACK's extensions with
    cockpit's memory-lean ``Conv2d`` rules.

    Args:
        needs: The union of the needs of all quantities due at a step.
        low_precision: Some parameters are bfloat16 or float16. BackPACK would
            round ``BatchL2Grad``'s and ``SumGradSquared``'s sums to that dtype
            (relative error ``2**-9`` in bfloat16, which the differences of
            NormTest and its kin turn into garbage), so per-sample gradients
            serve them: cockpit reduces those in float32.

    Returns:
        Extension instances, without duplicates; empty if nothing is needed.
    """
    needs = set(needs)
    extensions: list[BackpropExtension] = []
    per_sample = {Need.INDIVIDUAL_GRADIENTS, Need.GRAM, Need.PROJECTIONS}
    if low_precision:
        per_sample |= {Need.BATCH_L2, Need.SUM_GRAD_SQUARED}
    if needs & per_sample:
        extensions.append(PerSampleGradients())
    else:
        if Need.BATCH_L2 in needs:
            extensions.append(lean_batch_l2())
        if Need.SUM_GRAD_SQUARED in needs:
            extensions.append(lean_sum_grad_squared())
    for need, make in _CURVATURE_EXTENSIONS.items():
        if need in needs:
            extensions.append(make())
    return extensions


def extension_signature(extension: BackpropExtension) -> tuple:
    """Return a hashable description of an extension: its type and hyper-parameters.

    Two extensions with equal signatures compute the same thing and can be merged.
    """
    params = []
    for name, value in sorted(vars(extension).items()):
        if name in _NOT_HYPERPARAMETERS or name.endswith("__module_extensions"):
            continue
        if isinstance(value, (list, tuple)):
            value = tuple(value)
        if isinstance(value, (int, float, str, bool, type(None), tuple)):
            params.append((name, value))
    return (type(extension), tuple(params))


def merge_extensions(
    user: Sequence[BackpropExtension], requested: Sequence[BackpropExtension]
) -> list[BackpropExtension]:
    """Merge the user's extra extensions with those the quantities requested.

    Extensions are de-duplicated by type *and* hyper-parameters. Two different
    extensions that write the same savefield (for instance ``BatchGrad()`` and
    ``BatchGrad(subsampling=[0])``) cannot run together; that is an error, never a
    silent pick. The one exception is an extension that declares, through a
    ``served_by(other)`` method, that ``other`` provides everything it does
    (:class:`PerSampleGradients` and a plain ``BatchGrad()``): only ``other`` runs.

    Args:
        user: Extra extensions handed to ``cockpit(step, *extensions)``.
        requested: Extensions the quantities due at this step need.

    Returns:
        The merged list, user extensions first.

    Raises:
        TypeError: If a user extension is not a BackPACK extension instance.
        ValueError: On a conflict.
    """
    merged: list[BackpropExtension] = []
    by_savefield: dict[str, tuple] = {}
    for origin, extensions in (("your extra", user), ("a quantity's", requested)):
        for ext in extensions:
            if not isinstance(ext, BackpropExtension):
                raise TypeError(
                    f"Extra BackPACK extensions must be BackpropExtension instances, "
                    f"got {ext!r}. Pass e.g. backpack.extensions.BatchGrad()."
                )
            signature = extension_signature(ext)
            seen = by_savefield.get(ext.savefield)
            if seen is None:
                by_savefield[ext.savefield] = (signature, ext)
                merged.append(ext)
            elif seen[0] == signature or _served_by(ext, seen[1]):
                continue
            elif _served_by(seen[1], ext):
                merged[merged.index(seen[1])] = ext
                by_savefield[ext.savefield] = (signature, ext)
            else:
                raise ValueError(
                    f"Conflicting BackPACK extensions for savefield {ext.savefield!r}: "
                    f"{seen[1]!r} {dict(seen[0][1])} and {origin} {ext!r} "
                    f"{dict(signature[1])}. They cannot run in one backward pass; "
                    "drop your extra extension or make its settings match."
                )
    return merged


def _served_by(extension: BackpropExtension, other: BackpropExtension) -> bool:
    """Whether ``other`` provides everything ``extension`` does."""
    served_by = getattr(extension, "served_by", None)
    return served_by is not None and bool(served_by(other))


def savefields(extensions: Iterable[BackpropExtension]) -> list[str]:
    """Return the savefields the extensions write, in order, without duplicates."""
    return list(dict.fromkeys([ext.savefield for ext in extensions]))


def extension_names(extensions: Iterable[BackpropExtension], fields) -> str:
    """Name the extensions that write any of ``fields`` (for messages)."""
    return ", ".join(type(e).__name__ for e in extensions if e.savefield in fields)


# --- the backward pass ----------------------------------------------------------------
@contextlib.contextmanager
def backward_context(
    extensions: Sequence[BackpropExtension],
    hook: ExtensionHook,
    save_memory: bool,
    debug: bool = False,
) -> Iterator[None]:
    """Run the enclosed backward pass with ``extensions`` and ``hook``.

    Args:
        extensions: The merged extensions (nothing is entered if empty).
        hook: Called by BackPACK after each module.
        save_memory: Use BackPACK's low-memory convolution weight Jacobians.
        debug: Turn on BackPACK's debug output.
    """
    if not extensions:
        yield
        return
    with weight_jac_t_save_memory(save_memory):
        with backpack(*extensions, extension_hook=hook, debug=debug):
            yield


def quiet_backward() -> contextlib.AbstractContextManager:
    """Return a context for extra backward passes before the user's (no extension).

    BackPACK's backward hooks run in every backward pass through an extended
    module; outside of a ``backpack`` context they delete the inputs stored by the
    forward pass, which the user's backward pass still needs. Here they keep them,
    and PyTorch's warning that such a hook fires on a layer whose input needs no
    gradient (expected and harmless with BackPACK) is kept quiet.
    """
    stack = contextlib.ExitStack()
    stack.enter_context(quiet_warnings("Full backward hook is firing"))
    stack.enter_context(backpack(retain_graph=True))
    return stack


def rule_problem(module: Module, extension: BackpropExtension) -> str | None:
    """Why ``extension`` has no working rule for ``module`` (``None``: it has one).

    The rule is looked up by the module's exact type, as BackPACK does; rules that
    accept only some settings (BackPACK's LSTM and RNN rules: ``batch_first=True``,
    one layer, ...) are asked up front instead of failing in the backward pass.
    """
    rule = module_extension_table(extension).get(type(module))
    name = type(extension).__name__
    if rule is None:
        return f"BackPACK's {name} has no rule for {type(module).__name__}"
    while isinstance(rule, RULE_WRAPPERS):  # ask the rule itself
        rule = rule.wrapped
    supports = getattr(rule, "supports", None)  # cockpit's own rules
    if supports is not None:
        problem = supports(module)
        if problem is not None:
            return f"cockpit's {type(module).__name__} rule: {problem}"
        return None
    derivatives = getattr(rule, "_derivatives", None) or getattr(
        rule, "derivatives", None
    )
    check = getattr(derivatives, "_check_parameters", None)
    if check is not None:
        try:
            check(module)
        except NotImplementedError as error:
            return f"BackPACK's {name} rule for {type(module).__name__}: {error}"
    return None


def first_order(extensions: Iterable[BackpropExtension]) -> list[BackpropExtension]:
    """The per-sample gradient extensions among ``extensions``."""
    return [e for e in extensions if e.savefield in FIRST_ORDER_SAVEFIELDS]


_REFERENCE_FIRST_ORDER: list[BackpropExtension] = []


def reference_first_order() -> list[BackpropExtension]:
    """The per-sample gradient extension whose rules describe a step without one.

    Routes of a step that only needs curvature still say who *would* compute
    per-sample results (and a parameter without such a rule has no curvature
    rule either). Never run; built once.
    """
    if not _REFERENCE_FIRST_ORDER:
        _REFERENCE_FIRST_ORDER.append(PerSampleGradients())
    return list(_REFERENCE_FIRST_ORDER)


_FIRST_ORDER_REFERENCES: list[BackpropExtension] = []


def first_order_references() -> list[BackpropExtension]:
    """Every first-order extension cockpit may run (their rule tables; never run)."""
    if not _FIRST_ORDER_REFERENCES:
        _FIRST_ORDER_REFERENCES.extend(
            [PerSampleGradients(), lean_batch_l2(), lean_sum_grad_squared()]
        )
    return list(_FIRST_ORDER_REFERENCES)


def curvature(extensions: Iterable[BackpropExtension]) -> list[BackpropExtension]:
    """The curvature extensions among ``extensions``."""
    return [e for e in extensions if e.savefield in CURVATURE_SAVEFIELDS]


def leave_to_autograd(
    extensions: Iterable[BackpropExtension], modules: Iterable[Module]
) -> None:
    """Make the first-order ``extensions`` skip ``modules`` (and stay silent).

    The autograd engine computes these modules' results; BackPACK's rule would
    be wasted work or fail (e.g. its LSTM rule with ``batch_first=False``).
    Extensions without a rule for a layer no longer warn about it: the coverage
    report says who computes what.
    """
    skip = {id(m) for m in modules}
    for extension in first_order(extensions):
        extension._fail_mode = FAIL_SILENT
        table = module_extension_table(extension)
        for module_type, rule in list(table.items()):
            if isinstance(rule, SkipModules):
                rule.skip = skip
            else:
                table[module_type] = SkipModules(rule, skip)


def disabled() -> contextlib.AbstractContextManager:
    """Return a context in which BackPACK's hooks do nothing (extra backward passes)."""
    return disable()


def param_results(param: Tensor) -> ParamResults:
    """Wrap what BackPACK wrote onto ``param`` for the quantities to read.

    Half-precision results are converted to float32 (:mod:`cockpit.precision`).
    """
    individual = None
    batch_l2 = None
    grad_batch = getattr(param, GRAD_BATCH, None)
    if isinstance(grad_batch, LinearFactors):
        individual = FactoredLinearGradients(grad_batch)
    elif grad_batch is not None:
        individual = DenseGradients(grad_batch)
    scaled_l2 = upcast(getattr(param, BATCH_L2, None))
    if scaled_l2 is not None:
        batch_l2 = scaled_l2 * scaled_l2.shape[0] ** 2
    curvatures = {
        name: upcast(getattr(param, name))
        for name in CURVATURE_SAVEFIELDS
        if hasattr(param, name)
    }
    return ParamResults(
        individual=individual,
        batch_l2=batch_l2,
        scaled_sum_grad_squared=upcast(getattr(param, SUM_GRAD_SQUARED, None)),
        curvatures=curvatures,
    )


def zero_results(
    param: Tensor, fields: Iterable[str], batch_size: int | None
) -> ParamResults:
    """Results for a parameter the loss does not depend on: all zero, exact.

    Per-sample results need ``batch_size``; without it they are left out.
    """
    fields = set(fields)
    dtype = compute_dtype(param.dtype)
    individual = batch_l2 = second_moment = None
    if GRAD_BATCH in fields and batch_size is not None:
        individual = DenseGradients(
            param.new_zeros((batch_size, *param.shape), dtype=dtype)
        )
    if BATCH_L2 in fields and batch_size is not None:
        batch_l2 = param.new_zeros((batch_size,), dtype=dtype)
    if SUM_GRAD_SQUARED in fields:
        second_moment = torch.zeros_like(param, dtype=dtype)
    curvatures = {
        name: torch.zeros_like(param, dtype=dtype)
        for name in CURVATURE_SAVEFIELDS
        if name in fields
    }
    return ParamResults(individual, batch_l2, second_moment, curvatures)


def stored_per_sample(param: Tensor) -> Tensor:
    """BackPACK's ``BatchGrad`` result left on ``param`` (1.0.2-style readers).

    Raises:
        AttributeError: If no ``BatchGrad`` ran for ``param`` in this step.
    """
    return getattr(param, GRAD_BATCH)


def free_buffers(params: Iterable[Tensor], fields: Iterable[str]) -> None:
    """Delete the given BackPACK savefields from ``params`` where present."""
    for param in params:
        for name in fields:
            if hasattr(param, name):
                delattr(param, name)


def drop_stored_io(modules: Iterable[Module]) -> None:
    """Delete the inputs and output BackPACK's forward hook stored on ``modules``.

    ``hook_store_io`` keeps every extended module's last ``input0``, ``input1``, ...
    and ``output`` (with their autograd graph) until a backward pass runs its
    extensions. A step that stops before that (an error in the ``with`` block, a
    forward pass without a backward) would leave them: the graph holds the
    modules' backward hooks, which hold the modules, a cycle through autograd that
    Python's collector cannot see, so the model and its graph would never be
    freed. Only tensors stored on modules that carry BackPACK's hook go (a child
    module or parameter named ``output`` is not in the instance's ``__dict__``).
    """
    for module in modules:
        if STORE_IO_HOOK not in module._forward_hooks.values():
            continue
        stored = vars(module)
        names = [
            name
            for name, value in stored.items()
            if (name == "output" or (name[:5] == "input" and name[5:].isdigit()))
            and isinstance(value, Tensor)
        ]
        for name in names:
            del stored[name]


@dataclass
class Unsupported:
    """A module whose parameters lack results the quantities need.

    Attributes:
        module: The module BackPACK skipped.
        missing: The savefields it did not write.
        indices: The cockpit indices of its parameters.
    """

    module: Module
    missing: list[str]
    indices: list[int]


@dataclass
class ExtensionHook:
    """BackPACK's extension hook for one backward pass.

    After BackPACK has run the extensions on a module, the hook shows each of the
    module's cockpit parameters to the quantities (through the step's
    :class:`~cockpit.param_view.Dispatcher`) and deletes the savefields in ``free``,
    so large per-sample or curvature tensors exist for one module at a time. It
    also notes modules whose parameters lack a needed savefield (BackPACK skips
    modules it has no rule for); their parameters are not shown to the quantities.
    (BatchNorm layers in train mode are found before the backward pass:
    :func:`cockpit.engines.modules.batch_mixing`.)

    Attributes:
        index: ``id(param)`` -> cockpit index.
        dispatcher: Shows one parameter's results to the quantities.
        needed: Savefields the quantities read.
        free: Savefields to delete once a parameter is done.
        unsupported: Modules skipped although the quantities need them.
        elsewhere: Indices whose results another engine shows (BackPACK's are
            dropped).
    """

    index: Mapping[int, int]
    dispatcher: Dispatcher
    needed: Sequence[str]
    free: Sequence[str]
    unsupported: list[Unsupported] = field(default_factory=list)
    elsewhere: frozenset[int] = frozenset()

    def __call__(self, module: Module) -> None:
        """Show the module's parameters to the consumers, then free the buffers.

        Runs without recording an autograd graph: under ``create_graph=True`` the
        statistics would otherwise keep their inputs alive until the step ends.
        """
        mine, params, other = [], [], []
        for p in module.parameters(recurse=False):
            index = self.index.get(id(p))
            if index is None:
                continue
            if index in self.elsewhere:
                other.append(p)
            else:
                mine.append((index, p))
                params.append(p)
        if other:
            free_buffers(other, self.free)
        if not mine:
            return
        if self.needed:
            missing = []
            for name in self.needed:
                for p in params:
                    if not hasattr(p, name):
                        missing.append(name)
                        break
            if missing:
                self.unsupported.append(
                    Unsupported(module, missing, [i for i, _ in mine])
                )
                free_buffers(params, self.free)
                return
        with torch.no_grad():
            for index, param in mine:
                self.dispatcher.show(index, param, param_results(param))
            free_buffers(params, self.free)


# --- explaining failures --------------------------------------------------------------
@dataclass(frozen=True)
class Failure:
    """What BackPACK was doing when the backward pass raised.

    Attributes:
        kind: ``"unsupported"`` (no rule for a module), ``"loss_not_extended"``
            (second-order extensions got nothing from the loss) or
            ``"repeated_backward"`` (a second backward pass through extended
            modules, whose stored inputs BackPACK freed after the first).
        module: The module being processed, if known.
        savefield: The savefield of the extension that failed, if known.
        extension: The name of that extension, if known.
    """

    kind: str
    module: Module | None
    savefield: str | None
    extension: str | None


def explain_failure(error: BaseException) -> Failure | None:
    """Recognise a BackPACK failure inside the backward pass, or return ``None``."""
    if isinstance(error, NotImplementedError):
        module, extension = _find_in_traceback(error.__traceback__)
        if extension is None:
            return None
        return Failure(
            "unsupported", module, extension.savefield, type(extension).__name__
        )
    if isinstance(error, AttributeError) and any(
        f"attribute '{name}'" in str(error) for name in ("output", "input0")
    ):
        module, extension = _find_in_traceback(error.__traceback__)
        if module is not None:  # BackPACK freed what the forward pass stored
            return Failure("repeated_backward", module, None, None)
    if isinstance(error, AssertionError) and "backpropagation quantity" in str(error):
        _, extension = _find_in_traceback(error.__traceback__)
        return Failure(
            "loss_not_extended",
            None,
            extension.savefield if extension is not None else None,
            type(extension).__name__ if extension is not None else None,
        )
    return None


def _find_in_traceback(
    traceback: TracebackType | None,
) -> tuple[Module | None, BackpropExtension | None]:
    """Find the module and extension in BackPACK's frames (its hooks' locals)."""
    module, extension = None, None
    while traceback is not None:
        local = traceback.tb_frame.f_locals
        candidate = local.get("module")
        if isinstance(candidate, Module):
            module = candidate
        for name in ("self", "ext", "backpack_extension"):
            if isinstance(local.get(name), BackpropExtension):
                extension = local[name]
        traceback = traceback.tb_next
    return module, extension
