"""The ghost engine: per-sample statistics from each layer's input and output gradient.

For the layers that carry most parameters of real models (``nn.Linear``, Hugging
Face's ``Conv1D``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``), sample
``i``'s gradient is a function of what the layer saw and what reached its output:

* a linear map on sequences: ``g_i = N sum_t delta_it (outer) x_it`` with ``x`` the
  input and ``delta = d loss / d output`` of the mean loss of the backward pass
  (its slice ``i`` is ``(1/N) d l_i / d output_i`` when samples do not mix after
  the layer); an embedding the same with one-hot rows; a bias ``N sum_t
  delta_it``; a normalisation weight ``N sum_t delta_it * x_hat_it``;
* so norms, inner products and projections of per-sample gradients follow from
  ``x`` and ``delta`` without forming ``g_i`` (``||g_i||^2 = N^2 sum_{t,s} (x_it .
  x_is)(delta_it . delta_is)``: "ghost norms", Li et al. 2022; Bu et al., ICML
  2023), which for sequences costs less than the training step's own weight
  gradient; where a quantity reads the elements (histograms), ``g_i`` are formed
  once per parameter (up to :data:`DENSE_MAX_ELEMENTS` numbers, else in blocks of
  samples by each reader) and freed as soon as the quantities have read them.

Forward hooks keep each call's input; a tensor hook on the output (registered in
the forward pass, so in-place changes of the output later stay legal) receives
``delta`` during the user's ``loss.backward()``; a hook on the parameter receives
its gradient once every use of it is done (weight tying and layers used twice sum
their calls' terms) and shows the parameter to the quantities. No module backward
hooks, no extra backward pass (except a two-sample check of each layer's sample
axis, once per layer and shapes).

A parameter is served only when that is exact: every owner is one of the layers
above (exact type, settings the formulas cover), every use in the graph of the
step's losses is a call the hooks saw, with its input unchanged since, outside
``torch.autocast``, with the sample axis first (the same check as BackPACK's
routing) and no batch norm with mini-batch statistics after it. Everything else
goes to the next engine.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.nn import Module

from cockpit.engines.base import (
    DEFAULT_MAX_ELEMENTS,
    Decline,
    Engine,
    EngineStep,
    Why,
    register_engine,
)
from cockpit.engines.calls import watch
from cockpit.engines.ghost_layers import (  # noqa: F401  (ghost.register_layer)
    LAYERS,
    Layer,
    layer_of,
    register_layer,
)
from cockpit.engines.modules import batch_mixing, batchnorms, describe, roots_of
from cockpit.needs import Need
from cockpit.param_view import ParamResults
from cockpit.per_sample import DenseGradients, OuterProductGradients, OuterTerm
from cockpit.precision import compute_dtype, upcast
from cockpit.torch_state import autocast_on, in_transform

#: The engine's name in the coverage report.
GHOST = "ghost"
#: Needs that read the elements of per-sample gradients (see DENSE_MAX_ELEMENTS).
ELEMENT_NEEDS = frozenset({Need.INDIVIDUAL_GRADIENTS, Need.SUM_GRAD_SQUARED})
#: Per-sample gradients of a parameter formed at once (``N x D`` numbers) where a
#: quantity reads their elements; larger ones are formed in blocks of samples by
#: each reader. Measured (``benchmarks.fsdp``, 2 ranks, 1200-wide MLP, 32 samples,
#: economy): at ``1 << 26`` a tracked step took 7.1-7.3x a plain one and 609-772 MB
#: of peak memory per rank, at ``1 << 20`` 2.7-3.2x and 164-195 MB.
DENSE_MAX_ELEMENTS = 1 << 20
#: Calls of one module kept between forgets (older ones are dropped).
MAX_CALLS = 64


def _first_tensor(args, kwargs, name: str) -> Tensor | None:
    value = args[0] if args else kwargs.get(name)
    return value if isinstance(value, Tensor) else None


# --- calls ----------------------------------------------------------------------------
class Call:
    """One call of a watched layer: its input, and the gradient at its output.

    The output's tensor hook holds the call, so it lives as long as the call's
    autograd graph; the engine holds it weakly.
    """

    __slots__ = ("module", "x", "node", "autocast", "delta", "engine",
                 "consumer", "handle", "passed", "pending", "hook",
                 "__weakref__")  # fmt: skip

    def __init__(self, engine, module: Module, x: Tensor, node, autocast: bool):
        self.engine = weakref.ref(engine)
        self.module = module
        self.x = x  # autograd saves it too: changing it in place fails backward
        self.node = node
        self.autocast = autocast
        self.delta: Tensor | None = None
        #: For an output broadcast over the samples (first axis 1): the node that
        #: broadcasts it, whose gradient holds one slice per sample.
        self.consumer = None
        self.handle = None
        #: The handle of :meth:`receive` on the output (removed on release).
        self.hook = None
        #: A backward pass the engine did not listen to went through the call.
        self.passed = False
        #: Served parameters still to be shown that read this call.
        self.pending: set[int] = set()

    def receive(self, grad: Tensor) -> None:
        """The output's tensor hook: keep ``delta`` if the engine is listening."""
        engine = self.engine()
        if engine is not None and self.consumer is None:
            engine.received(self, grad)

    def receive_broadcast(self, grad_outputs) -> None:
        """The broadcasting node's pre-hook: its gradient is ``delta`` per sample."""
        engine = self.engine()
        if engine is not None and grad_outputs and grad_outputs[0] is not None:
            engine.received(self, grad_outputs[0])

    def inputs(self, n: int) -> Tensor:
        """The input, with a broadcast first axis expanded to the ``n`` samples."""
        x = self.x.detach()
        return x.expand(n, *x.shape[1:]) if self.consumer is not None else x

    def release(self) -> None:
        """Drop the tensors, the module and the hooks (the call is done).

        An output that outlives its step (a graph the user keeps) then holds
        nothing of the model's.
        """
        for handle in (self.handle, self.hook):
            if handle is not None:
                handle.remove()
        self.x = self.node = self.delta = self.consumer = self.handle = None
        self.module = self.hook = None


@dataclass
class _Served:
    """What the engine serves at a step: per parameter, its calls and its use."""

    calls: dict[int, list[Call]]
    attribute: dict[int, list[tuple[Module, str, Layer]]]


@register_engine(order=150)
class GhostEngine(Engine):
    """Per-sample results of common layers from their inputs and output gradients.

    Tried after BackPACK (which keeps what it serves, and the curvature diagonals
    it forms only when it serves every parameter) and before the replay and
    autograd engines, which need extra backward passes.
    """

    name = GHOST

    def __init__(self, params, modules):
        super().__init__(params, modules)
        self._owners: dict[int, list[tuple[Module, str, Layer]]] = {}
        watched: dict[int, Module] = {}
        for index, param in enumerate(params):
            owners = modules.owners.get(id(param), [])
            found = []
            for module, attribute in owners:
                layer = layer_of(module)
                if layer is None or attribute not in layer.params:
                    break
                found.append((module, attribute, layer))
            else:
                if found:
                    self._owners[index] = found
                    for module, _, _ in found:
                        watched[id(module)] = module
        self._calls: dict[int, list] = {key: [] for key in watched}
        self._handles = [h for m in watched.values() for h in watch(m, self)]
        self._probed: dict[tuple, bool] = {}
        #: (module, input shape, dtype) -> whether ``y = w * f(x)`` (ScaleLayer).
        self._scales: dict[tuple, bool] = {}
        self._listening = False
        self._probe: dict | None = None
        self._step: EngineStep | None = None
        self._served: _Served | None = None
        self._pending: dict[int, int] = {}
        self._leaf_handles: list = []
        self._dense = False
        self._batchnorms: list | None = None
        self._failures: list[str] = []
        self._shown: set[int] = set()

    def zero_results(self, index: int, batch_size: int | None):
        """Exact zero results of a parameter the loss does not depend on: ``_zeros``."""
        return _zeros(self.params[index], batch_size, index in self._owners)

    # --- the forward pass -------------------------------------------------------------
    def returned(self, module, args, kwargs, output) -> None:
        """A watched module's forward returned (:func:`cockpit.engines.calls.watch`)."""
        self.record(module, args, kwargs, output)

    def record(self, module, args, kwargs, output) -> None:
        """The forward hook: keep the call's input, listen at its output."""
        if not torch.is_grad_enabled() or in_transform():
            return
        if not isinstance(output, Tensor) or output.grad_fn is None:
            return
        layer = layer_of(module)
        x = _first_tensor(args, kwargs, layer.input_name)
        if x is None:
            return
        if layer.checked:
            key = (id(module), tuple(x.shape), x.dtype)
            if key not in self._scales:
                self._scales[key] = layer.fits(module, x, output)
        call = Call(self, module, x, output.grad_fn, autocast_on())
        call.hook = output.register_hook(call.receive)
        calls = self._calls[id(module)]
        kept = []
        for ref in calls:
            old = ref()
            if old is not None and old.passed:  # a new step began: as autograd
                old.release()  # freed what that backward pass read
            elif old is not None:
                kept.append(ref)
        calls[:] = kept[-MAX_CALLS + 1 :]
        calls.append(weakref.ref(call))

    def _live_calls(self, module: Module) -> list[Call]:
        calls = [ref() for ref in self._calls.get(id(module), [])]
        return [c for c in calls if c is not None and c.node is not None]

    # --- which parameters -------------------------------------------------------------
    def static_claim(self, index: int, step: EngineStep) -> Decline | None:
        """Every owner must be a layer of :data:`LAYERS` with settings it covers."""
        owners = self.modules.owners.get(id(self.params[index]), [])
        if not owners:
            return Decline(Why.FREE_TENSOR, "not owned by any module (a free tensor)")
        if index not in self._owners:
            names = " and ".join(describe(m, a) for m, a in owners)
            return Decline(
                Why.NO_RULE,
                f"the ghost engine has no rule for {names} (it serves Linear, "
                "Conv1D, Embedding, LayerNorm and RMSNorm layers)",
                passive=True,
            )
        for module, _, layer in self._owners[index]:
            problem = layer.problem(module)
            if problem is not None:
                return Decline(Why.NO_RULE, f"{describe(module)}: {problem}")
        return None

    def claim(self, step: EngineStep, indices: Sequence[int]) -> dict[int, Decline]:
        """Static rules, then this step's calls (see the module docstring)."""
        refused = super().claim(step, indices)
        if not step.nodes:  # before a step: the structure alone
            return refused
        if step.losses is None:  # no probe of the sample axis without them
            why = Decline(
                Why.NO_LOSSES,
                "the ghost engine checks each layer's sample axis with the "
                "per-sample losses",
                "pass info['individual_losses'] with their autograd graph",
            )
            return {i: refused.get(i, why) for i in indices}
        n = step.losses.shape[0]
        pending = [i for i in indices if i not in refused]
        mixed = (
            batch_mixing(self.params, step.nodes, self.batchnorms()) if pending else {}
        )
        candidates: dict[int, list[Call]] = {}
        for index in pending:
            if index in mixed:
                refused[index] = Decline(
                    Why.MIXED_BY_BATCHNORM,
                    f"samples mix through {mixed[index]} after it (normalised with "
                    "mini-batch statistics)",
                    "track fewer steps (a sparser track_schedule), normalise per "
                    "sample (GroupNorm, LayerNorm) instead, or give the Cockpit "
                    "only the parameters after the last BatchNorm",
                )
                continue
            calls, decline = self._step_calls(step, index, n)
            if decline is not None:
                refused[index] = decline
            else:
                candidates[index] = calls
        if n >= 2 and candidates:
            failed = self._probe_axes(step, candidates)
            for index, calls in candidates.items():
                if any(id(c.module) in failed for c in calls):
                    refused[index] = Decline(
                        Why.SAMPLE_AXIS,
                        "the first axis of "
                        f"{describe(calls[0].module)}'s output is not the sample "
                        "axis (the gradient of one sample's loss reaches other "
                        "slices)",
                    )
        return refused

    def _step_calls(self, step, index: int, n: int | None):
        """The calls that use parameter ``index`` in the step's graph, or a decline."""
        param = self.params[index]
        calls = []
        for module, _, _ in self._owners[index]:
            calls += [c for c in self._live_calls(module) if c.node in step.nodes]
        uses = step.uses.get(id(param), 0)
        if not calls:
            return None, Decline(
                Why.NOT_RUN,
                f"{describe(self._owners[index][0][0])} did not run in this forward "
                "pass with gradients",
            )
        if len(calls) != uses:
            return None, Decline(
                Why.SHARED_USE,
                f"used {uses} times in the forward pass, {len(calls)} of them by "
                "the layers that own it (other code reads the parameter)",
            )
        for call in calls:
            if call.autocast:
                return None, Decline(Why.AUTOCAST, Why.AUTOCAST.value)
            key = (id(call.module), tuple(call.x.shape), call.x.dtype)
            if layer_of(call.module).checked and not self._scales.get(key):
                return None, Decline(
                    Why.NO_RULE,
                    f"the output of {describe(call.module)} is not its weight "
                    "times a function of its input",
                )
            size = call.x.shape[0] if call.x.dim() else "none"
            if size == 1 and n is not None and n > 1:
                decline = self._broadcast(step, call, n)
                if decline is not None:
                    return None, decline
            elif call.x.dim() < 2 or (n is not None and size != n):
                return None, Decline(
                    Why.SAMPLE_AXIS,
                    f"the first axis of {describe(call.module)}'s input has size "
                    f"{size}, not the batch size {n}",
                )
            if call.x.is_floating_point() and call.x.dtype != param.dtype:
                return None, Decline(
                    Why.OTHER,
                    f"{describe(call.module)} got {call.x.dtype} inputs for "
                    f"{param.dtype} parameters",
                )
        return calls, None

    def _broadcast(self, step: EngineStep, call: Call, n: int) -> Decline | None:
        """Find the node that broadcasts a call's output over the samples.

        A position embedding of ``[1, T]`` positions added to ``[N, T, d]`` token
        embeddings: the gradient at the sum's output is ``delta`` of each sample
        (the addition passes it on unchanged and sums it over the first axis for
        the broadcast operand). Served when exactly one node reads the output and
        it is such an addition (``alpha = 1``) or an ``expand``.
        """
        if call.consumer is not None:
            return None
        node, kind = call.node, "BackwardHookFunctionBackward"
        while kind == "BackwardHookFunctionBackward":  # module hooks pass it on
            readers = [
                reader
                for reader in step.nodes
                if any(child is node for child, _ in reader.next_functions)
            ]
            kind = type(readers[0]).__name__ if len(readers) == 1 else ""
            node = readers[0] if readers else None
        fits = kind == "ExpandBackward0" or (
            kind == "AddBackward0" and getattr(node, "_saved_alpha", 1) == 1
        )
        if not fits or call.x.dim() < 1:
            return Decline(
                Why.SAMPLE_AXIS,
                f"the first axis of {describe(call.module)}'s input has size 1, not "
                f"the batch size {n}, and its output is not simply added to a "
                "tensor of all samples",
            )
        call.consumer = node
        call.handle = node.register_prehook(call.receive_broadcast)
        return None

    def batchnorms(self) -> list:
        """The BatchNorm layers around the parameters (found once)."""
        if self._batchnorms is None:
            roots = roots_of(self.modules.owners, self.modules.parents)
            self._batchnorms = batchnorms(roots)
        return self._batchnorms

    def _probe_axes(self, step: EngineStep, candidates) -> set[int]:
        """Ids of modules whose output's first axis is not the sample axis.

        The gradient of sample ``a``'s loss must reach only slice ``a`` of the
        output (checked for the first and the last sample, once per module and
        shapes), as BackPACK's routing checks its layers.
        """
        calls = {id(c): c for cs in candidates.values() for c in cs}
        keys = {
            id(c): (id(c.module), tuple(c.x.shape), c.x.dtype) for c in calls.values()
        }
        todo = [c for c in calls.values() if keys[id(c)] not in self._probed]
        if todo:
            from cockpit.engines.autograd import sample_losses

            flat = sample_losses(step.losses)
            ok = {id(c): True for c in todo}
            inputs = list({id(p): p for c in todo for p in _own(c.module)}.values())
            quiet = step.quiet() if step.quiet is not None else contextlib.nullcontext()
            with quiet:
                for a in (0, flat.shape[0] - 1):
                    self._probe = {"sample": a, "ok": ok, "n": flat.shape[0]}
                    try:
                        torch.autograd.grad(
                            flat[a], inputs, retain_graph=True, allow_unused=True
                        )
                    finally:
                        self._probe = None
            for call in todo:
                self._probed[keys[id(call)]] = ok[id(call)]
        return {
            id(c.module) for c in calls.values() if not self._probed.get(keys[id(c)])
        }

    # --- the backward pass ------------------------------------------------------------
    def received(self, call: Call, grad: Tensor) -> None:
        """A watched output's gradient arrived (any backward pass)."""
        probe = self._probe
        if probe is not None:
            if id(call) in probe["ok"]:
                a = probe["sample"]
                if grad.shape[0] != probe["n"]:
                    probe["ok"][id(call)] = False
                    return
                elsewhere = grad[:a].count_nonzero() + grad[a + 1 :].count_nonzero()
                if int(elsewhere) > 0:
                    probe["ok"][id(call)] = False
            return
        if self._listening and call.node is not None:
            call.delta = grad.detach()
        elif not self._listening:
            call.passed = True

    def backward_context(self, step: EngineStep, indices: Sequence[int]):
        """Listen for the served parameters' output and parameter gradients."""
        return self._listening_to(step, list(indices))

    @contextlib.contextmanager
    def _listening_to(self, step: EngineStep, indices: list[int]):
        if not indices:
            yield
            return
        served = _Served({}, {})
        for index in indices:
            calls = []
            for module, _, _ in self._owners[index]:
                calls += [c for c in self._live_calls(module) if c.node in step.nodes]
            served.calls[index] = calls
            served.attribute[index] = self._owners[index]
            for call in calls:
                call.pending.add(index)
        self._step, self._served = step, served
        self._dense = bool(step.needs & ELEMENT_NEEDS)
        self._failures = []
        self._shown: set[int] = set()
        self._listening = True
        for index in indices:
            hook = self._leaf_hook(index)
            self._leaf_handles.append(self.params[index].register_hook(hook))
        try:
            yield
        finally:
            self._listening = False
            for handle in self._leaf_handles:
                handle.remove()
            self._leaf_handles = []
            self._step = self._served = None

    def _leaf_hook(self, index: int) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            if self._listening and self._served is not None:
                self._show(index, grad)

        return hook

    def _show(self, index: int, grad: Tensor) -> None:
        step, served = self._step, self._served
        if index in self._shown:  # a second backward pass in the step: say so
            step.show(index, ParamResults())
            return
        self._shown.add(index)
        calls = served.calls.get(index, [])
        param = self.params[index]
        if any(c.delta is None for c in calls):
            self._failures.append(
                f"parameter #{index} (shape {tuple(param.shape)}): the gradient at "
                "the output of a layer using it did not arrive"
            )
            return
        with torch.no_grad():
            results = self._results(index, calls, grad.detach())
        step.show(index, results)
        for call in calls:  # free a layer's input and gradient once it is done
            call.pending.discard(index)
            if not call.pending:
                call.release()

    def _results(self, index: int, calls: list[Call], grad: Tensor) -> ParamResults:
        budget = self._step.options.get("max_elements", DEFAULT_MAX_ELEMENTS)
        dense_up_to = min(budget, DENSE_MAX_ELEMENTS) if self._dense else -1
        return layer_results(
            self.params[index], self._owners[index], calls, grad, dense_up_to
        )

    def after_backward(self, step: EngineStep) -> None:
        """Fail if a served parameter's results could not be formed (a bug)."""
        failures, self._failures = self._failures, []
        if failures:
            raise RuntimeError(
                "cockpit's ghost engine could not compute per-sample results: "
                + "; ".join(failures[:3])
                + ". Fix: report this with the model; meanwhile "
                "cockpit.engines.base.unregister_engine(GhostEngine) leaves these "
                "parameters to the other engines."
            )

    # --- housekeeping -----------------------------------------------------------------
    def free(self, late: bool = False) -> None:
        """Drop the served calls' tensors (the step's results were shown)."""
        if late:
            self._release_all()

    def _release_all(self) -> None:
        for calls in self._calls.values():
            for ref in calls:
                call = ref()
                if call is not None:
                    call.release()
            calls.clear()

    def forget(self) -> None:
        """Drop what the step's forward pass left."""
        self._release_all()

    def close(self) -> None:
        """Remove the forward hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._release_all()


def layer_results(param, owners, calls, grad, dense_up_to: int) -> ParamResults:
    """A parameter's per-sample results from the calls of the layers that use it.

    Args:
        param: The parameter.
        owners: ``(module, attribute, layer rule)`` of each module that holds it.
        calls: The module calls of the step that used it (inputs and output
            gradients at hand).
        grad: Its gradient (the mean over the batch).
        dense_up_to: Outer-product results are formed densely when ``N x D`` is
            at most this (``-1``: never).

    Returns:
        Dense per-sample gradients where a layer rule gave dense terms (summed
        with the outer-product terms of other calls, if any), else the
        outer-product form.
    """
    attribute = {id(m): (a, layer) for m, a, layer in owners}
    n = calls[0].delta.shape[0]
    terms, dense = [], None
    for call in calls:
        name, layer = attribute[id(call.module)]
        term = layer.term(call.module, name, call.inputs(n), call.delta)
        if isinstance(term, OuterTerm):
            terms.append(term)
        else:
            term = upcast(term).reshape(n, *param.shape)
            dense = term if dense is None else dense + term
    if dense is not None and not terms:
        return ParamResults(DenseGradients(dense, scale=n))
    if dense is not None:  # a weight used both ways: form the sum
        individual = OuterProductGradients(terms, param.shape, n, grad)
        dense = dense + individual.materialize() / n
        return ParamResults(DenseGradients(dense, scale=n))
    individual = OuterProductGradients(terms, param.shape, n, grad)
    if n * param.numel() <= dense_up_to:
        individual.densify()
    return ParamResults(individual)


def _own(module: Module) -> list[Tensor]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def _zeros(param: Tensor, batch_size: int | None, served: bool):
    """Zero per-sample gradients of ``param``, one zero expanded over ``[N, *shape]``.

    (No memory per sample.) ``None`` without ``batch_size`` or for a parameter
    the ghost engine does not serve.
    """
    if batch_size is None or not served:
        return None
    zero = param.new_zeros((), dtype=compute_dtype(param.dtype))
    return ParamResults(DenseGradients(zero.expand(batch_size, *param.shape), 1))
