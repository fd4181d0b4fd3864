"""The replay engine: per-sample gradients by re-running one module, sample by sample.

The autograd engine (:mod:`cockpit.engines.autograd`) differentiates every
per-sample loss through the whole batch's graph: one backward pass of the batch per
sample. Most parameters BackPACK has no rule for (attention, recurrent layers,
positional parameters, tied embeddings, custom layers) are used inside the
``forward`` of one module, though, and the gradient of sample ``i``'s loss with
respect to that module's output is slice ``i`` of one ordinary backward pass of
``sum_i l_i`` (samples do not mix). The per-sample gradients then follow from the
module alone:

``g_i = J_theta(module(x_i))^T (d l_i / d module(x_i))``,

a vector-Jacobian product of the module on sample ``i``'s inputs, which
``torch.func`` batches over the samples (``vmap`` of ``vjp`` of ``functional_call``;
each sample runs as a batch of one, so layers that insist on a batch axis work). The
cost is one backward pass of the batch plus about one forward and backward pass of
the module on the batch: for a whole model about what ``vmap(grad(...))`` costs,
instead of ``N`` backward passes.

Watched modules record their last call (inputs, output) in forward hooks. At a
tracked step, each parameter goes to the smallest watched module (its owner, or a
module containing it) whose last call contains *every* use of the parameter in the
graph of the per-sample losses (so weight tying and shared layers are summed over
their uses) and reads no tensor of the graph other than its inputs. The sample axis
of each output comes from two backward passes (the gradient of the first and the
last sample's loss must stay in their own slice: no mixing), that of each input from
its sizes, and a layout is accepted only if re-running the module sample by sample
reproduces the recorded outputs, which is checked again at every step. Whatever
fails a check (dropout or other random operations, BatchNorm in train mode, inputs
changed in place afterwards, operators ``vmap`` cannot batch, ...) is left to the
autograd engine, which is exact for any graph; nothing here guesses.

The search costs two backward passes per module, so it runs once per module, input
shapes and train/eval modes: a refusal is remembered like a layout, and where a
module is refused the next larger one is searched at the same step (a parameter's
search ends at its first step). Parameters before a batch norm that normalises with
mini-batch statistics are never searched: no module replayed sample by sample can
reproduce those statistics.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch.func import functional_call, vjp, vmap
from torch.nn import Module
from torch.utils._pytree import tree_flatten, tree_unflatten

from cockpit.engines.autograd import (
    _VMAP_FALLBACK_WARNING,
    parameter_groups,
    sample_losses,
)
from cockpit.engines.base import (
    AUTOGRAD,
    DEFAULT_MAX_ELEMENTS,
    REPLAY,
    Engine,
    EngineStep,
    Route,
    register_engine,
)
from cockpit.engines.calls import Call, CallRecorder
from cockpit.engines.modules import ancestors, graph_uses, mixed_by_batch_statistics
from cockpit.errors import quiet_warnings
from cockpit.param_view import ParamResults
from cockpit.per_sample import DenseGradients

_LOG = logging.getLogger(__name__)

#: Hook dictionaries of a module that a replay must not trigger (BackPACK stores a
#: layer's input and output in a forward hook; the watch hooks themselves).
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
#: Layouts tried for a module whose inputs' sample axes are ambiguous.
MAX_LAYOUTS = 16
#: Wrappers whose ``forward`` does more than their module's (collectives, buffers).
_WRAPPERS = (
    torch.nn.parallel.DistributedDataParallel,
    torch.nn.DataParallel,
)


class _Refused(Exception):
    """A module that must not be replayed (the message says why)."""


@dataclass(frozen=True)
class Layout:
    """How a module's call splits into samples.

    Attributes:
        selected: Positions of the outputs the per-sample losses depend on.
        out_axes: Their sample axes.
        in_axes: The sample axis of every input leaf (``None``: shared by all
            samples, or not a tensor).
    """

    selected: tuple[int, ...]
    out_axes: tuple[int, ...]
    in_axes: tuple[int | None, ...]


@dataclass
class _Scope:
    """What one call covers in this step's graph."""

    call: Call
    uses: Counter = field(default_factory=Counter)
    reads_outside: bool = False


class _Isolated:
    """A module and its submodules, with no hooks and no lasting side effects.

    Inside, every hook is swapped out (BackPACK stores each layer's input and output
    in a forward hook; the watch hooks would record the replay). On leaving, each
    submodule's attributes are put back as they were (a ``forward`` that stores a
    tensor on ``self``, e.g. attention weights for plotting, must not keep the
    replay's), and :attr:`changed_buffers` names the buffers whose values changed
    (BatchNorm's counters in train mode); with ``restore_buffers`` they get their
    values back.
    """

    def __init__(self, module: Module, restore_buffers: bool = False):
        self.module = module
        self.restore_buffers = restore_buffers
        self.changed_buffers: list[str] = []

    def __enter__(self):
        self._saved = [(sub, dict(sub.__dict__)) for sub in self.module.modules()]
        self._buffers = [
            (name, buffer, buffer._version)
            for name, buffer in self.module.named_buffers()
        ]
        self._copies = (
            [b.detach().clone() for _, b, _ in self._buffers]
            if self.restore_buffers
            else []
        )
        for sub, _ in self._saved:
            for name in _HOOK_DICTS:
                hooks = sub.__dict__.get(name)
                if hooks:
                    sub.__dict__[name] = type(hooks)()
        return self

    def __exit__(self, *exc):
        for sub, saved in self._saved:
            current = sub.__dict__
            for key in [k for k in current if k not in saved]:
                del current[key]
            for key, value in saved.items():
                if current.get(key, _ABSENT) is not value:
                    current[key] = value
        for k, (name, buffer, version) in enumerate(self._buffers):
            if buffer._version != version:
                self.changed_buffers.append(name)
                if self._copies:
                    with torch.no_grad():
                        buffer.copy_(self._copies[k])
        return False


_ABSENT = object()


def _tolerance(dtype: torch.dtype) -> float:
    """Allowed relative difference between a replayed and the recorded output."""
    return math.sqrt(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def _layout_key(module: Module, call: Call) -> tuple:
    """What a layout is remembered by: the module, its call's shapes, its modes."""
    shapes = tuple(
        (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t).__name__
        for t in (*call.leaves, *call.outputs)
    )
    modes = tuple(m.training for m in module.modules())
    return (id(module), shapes, modes)


class Replayer:
    """Per-sample gradients of parameters used inside watched modules.

    Args:
        chain: ``param -> [owner, its parent, ..., the root]`` (empty: no owner).
    """

    def __init__(self, chain: Callable[[Tensor], list[Module]]):
        self.recorder = CallRecorder()
        self._chain = chain
        #: (module, shapes, modes) -> its layout, or ``None`` where it cannot replay.
        self._layouts: dict[tuple, Layout | None] = {}
        #: Why the last step left parameters to the autograd engine (for debugging).
        self.notes: dict[str, str] = {}
        #: Parameters replayed at the last step, by module class name.
        self.last: dict[str, int] = {}
        #: Position (in the last call's ``params``) -> class of the module replayed.
        self.module_of: dict[int, str] = {}
        self._names: dict[int, dict[int, str]] = {}  # module -> param -> name
        self._outer: dict[int, list[Module]] = {}  # module -> its containers
        self._keys: dict[int, tuple] = {}  # this step's layout keys

    def watch_chains(self, params: Sequence[Tensor]) -> None:
        """Watch the modules that could replay ``params`` (owners and containers)."""
        for param in params:
            self.recorder.watch([m for m in self._chain(param) if not _wrapper(m)])

    def forget(self) -> None:
        """Drop the recorded calls (at the end of each step)."""
        self.recorder.clear()

    def close(self) -> None:
        """Remove every hook."""
        self.recorder.close()

    # --- per step --------------------------------------------------------------------
    def per_sample_gradients(
        self,
        individual_losses: Tensor,
        params: Sequence[Tensor],
        max_elements: int,
        mixed: set[int] | None = None,
    ) -> Iterator[tuple[int, Tensor]]:
        """Per-sample gradients of the ``params`` that a watched module covers.

        Parameters it does not yield (no watched module covers them, a batch norm
        with mini-batch statistics after them mixes the samples, or a replay failed
        its check) are the autograd engine's.

        Args:
            individual_losses: The per-sample losses with their graph (kept).
            params: The parameters (positions refer to this list).
            max_elements: Per-sample numbers held at once (parameters beyond it
                are replayed in further groups).
            mixed: ``id`` of the parameters such a batch norm mixes, if known
                (:func:`~cockpit.engines.modules.mixed_by_batch_statistics`).

        Yields:
            ``(position, g)`` with ``g[i] = d l_i / d params[position]``, no graph.
        """
        self.notes, self.last, self.module_of, self._keys = {}, {}, {}, {}
        losses = sample_losses(individual_losses)
        n = losses.shape[0] if losses.dim() == 1 else 0
        if n < 2 or losses.grad_fn is None or not self.recorder.calls:
            return
        self.recorder.paused = True
        try:
            plan = self._plan(losses, params, n, mixed)
            yield from self._run(losses, params, plan, n, max_elements)
        finally:
            self.recorder.paused = False

    def _plan(self, losses: Tensor, params: Sequence[Tensor], n: int, mixed) -> dict:
        """Choose a module for each parameter: ``id(module) -> (module, positions)``.

        A parameter before a batch norm that normalises with mini-batch statistics
        is never replayed: sample ``i``'s loss depends on it through every sample,
        and a module replayed sample by sample cannot reproduce those statistics
        (no layout of its owner or of a container is searched for it).
        """
        nodes, uses = graph_uses([losses.grad_fn])
        if mixed is None:
            mixed = mixed_by_batch_statistics(nodes)
        scopes: dict[int, _Scope | None] = {}
        chosen: dict[int, tuple[Module, list[int]]] = {}
        probe = (losses, n)
        for position, param in enumerate(params):
            if id(param) in mixed:
                self.notes["batch norm"] = (
                    "samples mix through a batch norm with mini-batch statistics"
                )
                continue
            module = self._container(param, uses[id(param)], nodes, scopes, probe)
            if module is not None:
                chosen.setdefault(id(module), (module, []))[1].append(position)
        # one replay of a containing module serves its submodules' parameters too
        # (deepest first, so that chains of containers end in the outermost), once
        # that module has replayed a call of these shapes
        for key in sorted(chosen, key=lambda k: -len(self._above(chosen[k][0]))):
            module, members = chosen[key]
            for outer in self._above(module):
                if id(outer) not in chosen or not chosen[id(outer)][1]:
                    continue
                scope = scopes.get(id(outer))
                if scope is None or not self._works(outer, scope.call):
                    continue  # only into a module known to replay
                if all(
                    scope.uses[id(params[p])] == uses[id(params[p])] for p in members
                ):
                    chosen[id(outer)][1].extend(members)
                    members.clear()
                    break
        return {k: v for k, v in chosen.items() if v[1]}

    def _above(self, module: Module) -> list[Module]:
        """The modules containing ``module`` (parent first), from the module map."""
        if id(module) not in self._outer:
            self._outer[id(module)] = []
            for param in module.parameters():
                chain = self._chain(param)
                found = [i for i, m in enumerate(chain) if m is module]
                if found:
                    self._outer[id(module)] = chain[found[0] + 1 :]
                    break
        return self._outer[id(module)]

    def _name(self, module: Module, param: Tensor) -> str | None:
        """``param``'s name in ``module`` (for ``functional_call``), if it has one."""
        names = self._names.get(id(module))
        name = names.get(id(param)) if names is not None else None
        if name is None or module.get_parameter(name) is not param:
            names = {id(p): n for n, p in module.named_parameters()}
            self._names[id(module)] = names
            name = names.get(id(param))
        return name

    def _container(self, param, total, nodes, scopes, probe) -> Module | None:
        """The smallest watched module whose last call holds every use of ``param``.

        A module that holds them but whose layout is not known yet has it searched
        now (:meth:`_layout`, remembered by module, shapes and modes); where none
        reproduces, the next larger module is tried at the same step, so the search
        for a parameter ends at its first step and is never repeated.
        """
        if total == 0:
            return None
        for module in self._chain(param):
            if _wrapper(module):
                return None
            key = id(module)
            if key not in scopes:
                scopes[key] = self._scope(module, nodes)
            scope = scopes[key]
            if scope is None or scope.uses[id(param)] == 0:
                continue
            if scope.reads_outside:
                return None  # the parameter's uses sit in a call that cannot replay
            if scope.uses[id(param)] != total or self._name(module, param) is None:
                continue
            if self._layout(module, scope.call, *probe) is not None:
                return module
            # refused (remembered): a larger module may still replay
        return None

    def _works(self, module: Module, call: Call) -> bool:
        """Whether ``module`` is known to replay calls like ``call``."""
        return self._layouts.get(self._key(module, call)) is not None

    def _scope(self, module: Module, nodes) -> _Scope | None:
        call = self.recorder.calls.get(id(module))
        if call is None or call.autocast or not call.unchanged():
            return None
        roots = [
            t.grad_fn
            for t in call.outputs
            if isinstance(t, Tensor) and t.grad_fn is not None and t.grad_fn in nodes
        ]
        if not roots:
            return None
        inputs = {
            t.grad_fn
            for t in call.leaves
            if isinstance(t, Tensor) and t.grad_fn is not None
        }
        scope = _Scope(call)
        seen: set = set()
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node in seen or node in inputs:
                continue
            seen.add(node)
            if node._sequence_nr() < call.start:
                scope.reads_outside = True  # a graph tensor that is not an input
                continue
            for child, _ in node.next_functions:
                if child is None:
                    continue
                variable = getattr(child, "variable", None)
                if variable is not None:
                    scope.uses[id(variable)] += 1
                else:
                    stack.append(child)
        return scope

    def _run(self, losses, params, plan, n, budget) -> Iterator[tuple[int, Tensor]]:
        calls = self.recorder.calls
        layouts = {}
        for key, (module, _) in plan.items():
            layouts[key] = self._layout(module, calls[key], losses, n)
        targets = [
            calls[key].outputs[j]
            for key, layout in layouts.items()
            if layout is not None
            for j in layout.selected
        ]
        try:  # each sample's gradient with respect to the modules' outputs
            found = (
                torch.autograd.grad(
                    losses.sum(), targets, retain_graph=True, allow_unused=True
                )
                if targets
                else ()
            )
        except RuntimeError as error:  # left to the autograd engine
            self.notes["outputs"] = f"no output gradients: {error}"
            return
        # an output the losses do not use at this step gets zeros
        cotangents = [
            torch.zeros_like(t) if g is None else g
            for t, g in zip(targets, found, strict=True)
        ]
        offset = 0
        for key, (module, members) in plan.items():
            layout = layouts[key]
            if layout is None:
                continue
            count = len(layout.selected)
            cots = cotangents[offset : offset + count]
            offset += count
            members = list(members)
            groups = parameter_groups([params[p] for p in members], n, budget)
            for group in groups:
                wanted = [members[i] for i in group]
                try:
                    grads = self._replay(
                        module, calls[key], layout, [params[p] for p in wanted], cots
                    )
                except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
                    self._refuse(module, calls[key], f"replay failed: {e}")
                    grads = None
                if grads is None:
                    continue
                name = type(module).__name__
                self.last[name] = self.last.get(name, 0) + len(wanted)
                self.module_of.update(dict.fromkeys(wanted, name))
                yield from zip(wanted, grads, strict=True)
                del grads

    def _key(self, module: Module, call: Call) -> tuple:
        """Module, shapes and train/eval modes: what a layout is remembered by."""
        cached = self._keys.get(id(module))
        if cached is not None and cached[0] is call:
            return cached[1]
        key = _layout_key(module, call)
        self._keys[id(module)] = (call, key)
        return key

    def _refuse(self, module: Module, call: Call, why: str) -> None:
        self._layouts[self._key(module, call)] = None
        self.notes[type(module).__name__] = why
        _LOG.debug("replay of %s refused: %s", type(module).__name__, why)

    def _layout(self, module, call, losses, n) -> Layout | None:
        key = self._key(module, call)
        if key in self._layouts:
            return self._layouts[key]
        layout = None
        try:
            layout = self._find_layout(module, call, losses, n)
        except _Refused as refused:
            self.notes[type(module).__name__] = str(refused)
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:
            self.notes[type(module).__name__] = f"no layout: {error}"
        if layout is None:
            self.notes.setdefault(type(module).__name__, "no sample axis reproduces")
        self._layouts[key] = layout
        return layout

    def _find_layout(self, module, call, losses, n) -> Layout | None:
        selected = [
            j
            for j, t in enumerate(call.outputs)
            if isinstance(t, Tensor) and t.grad_fn is not None
        ]
        probed = [call.outputs[j] for j in selected] + [
            t for t in call.leaves if isinstance(t, Tensor) and t.grad_fn is not None
        ]
        grads = [
            torch.autograd.grad(losses[a], probed, retain_graph=True, allow_unused=True)
            for a in (0, n - 1)
        ]
        axes = {}
        for k, tensor in enumerate(probed):
            axes[id(tensor)] = _sample_axes(tensor, [g[k] for g in grads], (0, n - 1))
        out_options, keep = [], []
        for j in selected:
            options = axes[id(call.outputs[j])]
            if options is None:  # the losses do not depend on it
                continue
            if not options:
                return None  # samples mix downstream of this output
            out_options.append(options)
            keep.append(j)
        if not keep:
            return None
        nested = _nested_output(call, keep)
        if nested is not None:
            raise _Refused(nested)
        preferred = {a for options in out_options for a in options[:1]}
        in_options = []
        for leaf in call.leaves:
            if not isinstance(leaf, Tensor):
                in_options.append([None])
                continue
            probe = axes.get(id(leaf))
            if probe:
                in_options.append(probe)
                continue
            if probe == []:
                return None  # this input mixes samples
            sized = [d for d in range(leaf.dim()) if leaf.shape[d] == n]
            sized.sort(key=lambda d: d not in preferred)
            in_options.append([*sized, None])
        for choice in itertools.islice(
            itertools.product(
                itertools.product(*out_options), itertools.product(*in_options)
            ),
            MAX_LAYOUTS,
        ):
            layout = Layout(tuple(keep), tuple(choice[0]), tuple(choice[1]))
            if all(a is None for a in layout.in_axes):
                continue
            if self._reproduces(module, call, layout):
                return layout
        return None

    def _reproduces(self, module, call, layout) -> bool:
        """Whether running ``module`` sample by sample gives the recorded outputs.

        A module whose forward changes its buffers (BatchNorm in train mode counts
        its batches) gets them back and is refused: a replay must leave no trace.
        """
        batched = _batched_inputs(call, layout)
        isolated = _Isolated(module, restore_buffers=True)
        try:
            with isolated, torch.no_grad():
                values = _vmap(
                    lambda xs: _forward(module, call, layout, xs, None),
                    (tuple(a for a in layout.in_axes if a is not None),),
                )(batched)
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:
            _LOG.debug("layout %s of %s: %s", layout, type(module).__name__, error)
            return False
        if isolated.changed_buffers:
            raise _Refused(
                f"its forward changes buffers {isolated.changed_buffers[:3]}"
            )
        return _same(values, call, layout)

    def _replay(self, module, call, layout, wanted, cotangents) -> list[Tensor] | None:
        names = [self._name(module, p) for p in wanted]
        primals = {name: p.detach() for name, p in zip(names, wanted, strict=True)}
        batched = _batched_inputs(call, layout)

        def one(xs, cots):
            def f(params):
                return _forward(module, call, layout, xs, params)

            values, pull = vjp(f, primals)
            return pull(tuple(cots))[0], values

        isolated = _Isolated(module)
        with isolated, torch.no_grad():
            in_axes = tuple(a for a in layout.in_axes if a is not None)
            grads, values = _vmap(one, (in_axes, layout.out_axes))(
                batched, tuple(cotangents)
            )
        if isolated.changed_buffers:  # not when its layout was found: refuse
            self._refuse(module, call, "its forward changed buffers")
            return None
        if not _same(values, call, layout):
            self._refuse(module, call, "the replayed outputs differ from the recorded")
            return None
        return [grads[name] for name in names]


def _nested_output(call: Call, selected: Sequence[int]) -> str | None:
    """Why an output of ``call`` is computed from another inside it (``None``: none).

    E.g. a Hugging Face encoder-decoder returns the encoder's last hidden state
    next to the logits computed from it. The gradient of the losses with respect
    to such an output already holds the part that reaches it through the other
    output, which the module's vector-Jacobian product would add a second time.
    """
    outputs = {}
    for j in selected:
        node = call.outputs[j].grad_fn
        outputs.setdefault(node, j)
    for node, j in outputs.items():
        seen, stack = set(), [c for c, _ in node.next_functions if c is not None]
        while stack:
            child = stack.pop()
            if child in seen or child._sequence_nr() < call.start:
                continue
            seen.add(child)
            if child in outputs and child is not node:
                return (
                    f"its output {j} is computed from its output {outputs[child]} "
                    "(whose gradient would be counted twice)"
                )
            stack.extend(c for c, _ in child.next_functions if c is not None)
    return None


def _wrapper(module: Module) -> bool:
    return isinstance(module, _WRAPPERS)


def _sample_axes(tensor: Tensor, grads, samples) -> list[int] | None:
    """Axes of ``tensor`` along which each sample's gradient stays in its slice.

    Returns:
        ``None`` if neither sample's loss depends on the tensor, else the axes of
        size ``N`` that keep both gradients in their sample's slice (empty: the
        samples mix).
    """
    if all(g is None for g in grads):
        return None
    n = samples[-1] + 1
    axes = []
    informative = False
    for d in range(tensor.dim()):
        if tensor.shape[d] != n:
            continue
        ok = True
        for a, grad in zip(samples, grads, strict=True):
            if grad is None:
                continue
            total = int(grad.count_nonzero())
            informative = informative or total > 0
            if int(grad.select(d, a).count_nonzero()) != total:
                ok = False
                break
        if ok:
            axes.append(d)
    if not informative:
        return None
    return axes


def _batched_inputs(call: Call, layout: Layout) -> tuple[Tensor, ...]:
    # copies: a module that changes its input in place must not touch the user's
    return tuple(
        leaf.detach().clone()
        for leaf, axis in zip(call.leaves, layout.in_axes, strict=True)
        if axis is not None
    )


def _vmap(function, in_dims):
    """``vmap`` with random operations refused and its loop fallback kept quiet."""
    mapped = vmap(function, in_dims=in_dims, randomness="error")

    def run(*args):
        with quiet_warnings(_VMAP_FALLBACK_WARNING):
            return mapped(*args)

    return run


def _forward(module, call, layout, xs, params):
    """The module on one sample (a batch of one), its selected outputs squeezed."""
    leaves, it = [], iter(xs)
    for leaf, axis in zip(call.leaves, layout.in_axes, strict=True):
        if axis is not None:
            leaves.append(next(it).unsqueeze(axis))
        elif isinstance(leaf, Tensor):
            leaves.append(leaf.detach())
        else:
            leaves.append(leaf)
    args, kwargs = tree_unflatten(leaves, call.spec)
    if params is None:
        output = module(*args, **kwargs)
    else:
        output = functional_call(module, params, tuple(args), kwargs)
    flat, _ = tree_flatten(output)
    return tuple(
        flat[j].squeeze(axis)
        for j, axis in zip(layout.selected, layout.out_axes, strict=True)
    )


def _same(values, call: Call, layout: Layout) -> bool:
    for value, j, axis in zip(values, layout.selected, layout.out_axes, strict=True):
        recorded = call.outputs[j].detach().movedim(axis, 0)
        if value.shape != recorded.shape or value.dtype != recorded.dtype:
            return False
        scale = float(recorded.abs().max()) if recorded.numel() else 0.0
        if not math.isfinite(scale):
            return False
        difference = float((value - recorded).abs().max()) if value.numel() else 0.0
        if difference > _tolerance(recorded.dtype) * max(1.0, scale):
            return False
    return True


@register_engine(order=200)
class ReplayEngine(Engine):
    """Per-sample gradients by replaying the module that uses a parameter.

    Claims every parameter; at the step it serves those a watched module covers
    and hands the rest to the next engine (see the module's docstring). Shown in
    the coverage report as the autograd engine with the method ``"replay of
    <module class>"``.
    """

    name = AUTOGRAD
    needs_losses = True

    def __init__(self, params, modules):
        super().__init__(params, modules)
        self.replayer = Replayer(self._chain)

    def _chain(self, param: Tensor) -> list[Module]:
        owners = self.modules.owners.get(id(param), [])
        return ancestors(owners[0][0], self.modules.parents) if owners else []

    def watch(self, routes: Sequence[Route]) -> None:
        """Watch the modules of parameters no earlier engine claims by structure."""
        self.replayer.watch_chains(
            [
                p
                for p, r in zip(self.params, routes, strict=True)
                if r.engine == self.name
            ]
        )

    def before_backward(self, step: EngineStep, indices) -> dict[int, str]:
        """Replay the watched modules that cover ``indices``.

        Parameters before a batch norm with mini-batch statistics are left to the
        next engine at once (no module of theirs is watched or searched).
        """
        params = [self.params[i] for i in indices]
        mixed = mixed_by_batch_statistics(step.nodes) if step.nodes else None
        # watched from the next step on if new
        self.replayer.watch_chains([p for p in params if id(p) not in (mixed or ())])
        served = {}
        budget = step.options.get("max_elements", DEFAULT_MAX_ELEMENTS)
        for position, grads in self.replayer.per_sample_gradients(
            step.losses, params, budget, mixed
        ):
            who = self.replayer.module_of.get(position, "a module")
            served[indices[position]] = f"{REPLAY} {who}"
            step.show(indices[position], ParamResults(DenseGradients(grads, scale=1)))
        return served

    def forget(self) -> None:
        """Drop the step's recorded module calls (if it recorded any)."""
        recorder = self.replayer.recorder
        if recorder.calls or recorder.starts:
            self.replayer.forget()

    def close(self) -> None:
        """Remove the watch hooks."""
        self.replayer.close()
