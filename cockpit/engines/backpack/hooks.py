"""BackPACK's module hooks where they would break a model: taken off or moved.

``backpack.extend(model)`` gives every module except ``nn.Sequential`` two hooks
(BackPACK 1.7.1, ``backpack/__init__.py``):

* a forward hook, ``hook_store_io``, that stores the module's inputs and output as
  attributes ``input0``, ``input1``, ... and ``output``. On a module that has a
  child module (or parameter, buffer) of that name, as Hugging Face BERT's
  ``BertAttention`` and ``BertLayer`` have (``self.output``), the assignment
  raises ``TypeError: cannot assign ... as child module 'output'`` in the first
  forward pass;
* a *full* backward hook, ``hook_run_extensions``, that runs the active
  extensions with ``(module, grad_input, grad_output)``. PyTorch implements full
  backward hooks by passing the module's inputs and outputs through an identity
  autograd function, which returns views; forward code that changes such a view
  in place (a residual ``hidden += residual`` on a layer's or a block's output,
  as in Hugging Face's and torchvision's ResNets) stops with "Output 0 of
  BackwardHookFunction is a view and is being modified inplace".

Cockpit owns the step, so when a :class:`~cockpit.Cockpit` is made it rewires the
hooks of every model whose parameters it tracks, unless BackPACK could compute
curvature diagonals for that model (``nn.Sequential`` containers of layers with
BackPACK rules, :func:`curvature_possible`), where BackPACK's hooks stay exactly
as they are:

* **taken off** (both hooks) every module that has children (a container with a
  ``forward`` of its own), has no parameters of its own, or has no first-order
  BackPACK rule for its exact type. No first-order rule reads such a module: its
  hooks serve the curvature extensions, which need a BackPACK rule for every
  layer and ``nn.Sequential`` containers, so they cannot run on this model
  anyway. This removes the attribute clash and the views of containers and
  parameter-free layers;
* **taken off** a layer none of whose parameters BackPACK can ever serve (each is
  tied to another module: the ghost or autograd engine serves it), so that its
  input and output (a language model head's logits, ``N x T x V`` numbers) are
  not kept from the forward pass to the backward pass for nothing;
* **moved to the output** for the remaining layers (parameters and a first-order
  rule, e.g. ``Linear``, ``Conv2d``, ``LayerNorm``, ``BatchNorm2d``,
  ``Embedding``): the forward hook that stores the inputs and output stays, and
  the full backward hook is replaced by a forward hook that registers a tensor
  hook on the output, which runs BackPACK's ``hook_run_extensions`` with
  ``(module, (None,), (grad_output,))``. No view is made, so the output may be
  changed in place. A tensor hook registered before an in-place change receives
  the gradient with respect to the value before the change, i.e. the layer's own
  output, which is what the layer's rules need.

Why that is exact (checked against BackPACK 1.7.1's source): first-order module
extensions (``backpack/extensions/module_extension.py``,
``FirstOrderBackpropExtension``) read ``module.input0`` and ``g_out[0]``, and
``module.output`` only for its shape, ``grad_fn`` and ``data_ptr`` (the lookup of
backpropagated quantities, which first-order extensions never store); no
extension indexes ``g_inp``. The rules of recurrent layers read the output's
values and return tuples: ``nn.RNNBase`` layers keep BackPACK's hooks.

The rewiring is reference-counted per module and undone when the last cockpit
that made it is closed (:func:`release`). A model pickled meanwhile keeps a
working copy of the moved hook (a module-level function).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

from torch import Tensor
from torch.nn import Module, RNNBase
from torch.utils.hooks import RemovableHandle

from cockpit.engines.backpack.api import RUN_EXTENSIONS_HOOK as hook_run_extensions
from cockpit.engines.backpack.api import STORE_IO_HOOK as hook_store_io

#: What was done to a module (for messages and the coverage report).
TAKEN_OFF = "taken off"
MOVED = "moved to the output"


def output_hook(module: Module, args: tuple, output) -> None:
    """Forward hook: run BackPACK's extensions when the output's gradient arrives.

    Replaces BackPACK's full backward hook on a layer (see the module docstring).
    A layer's output can be a view: ``nn.Linear`` on ``[N, T, D]`` inputs
    reshapes a 2-D product. A view changed in place leaves the graph (autograd
    rebases its base), and a hook on it would never fire, so the hook goes on
    the base when the output is a plain reshape of it; its gradient, reshaped,
    is the output's. The node hooked is kept for the routing
    (:func:`hooked_node`): a hook whose node is not in a step's graph will not
    fire, and the layer is left to another engine.
    """
    if not isinstance(output, Tensor) or not output.requires_grad:
        return
    target = output
    base = output._base
    if base is not None and base.grad_fn is not None and _reshape_of(output, base):
        target = base
    target.register_hook(_GradientHook(module, tuple(output.shape)))
    _HOOKED[module] = target.grad_fn


def _reshape_of(view: Tensor, base: Tensor) -> bool:
    """Whether ``view`` holds exactly ``base``'s elements in the same order."""
    return (
        view.numel() == base.numel()
        and view.dtype == base.dtype
        and view.data_ptr() == base.data_ptr()
        and view.is_contiguous()
        and base.is_contiguous()
    )


class _GradientHook:
    """Tensor hook on a layer's output: BackPACK's backward hook, without views."""

    def __init__(self, module: Module, shape: tuple[int, ...]):
        self.module = weakref.ref(module)
        self.shape = shape

    def __call__(self, grad: Tensor) -> None:
        module = self.module()
        if module is not None:
            hook_run_extensions(module, (None,), (grad.reshape(self.shape),))


#: Layer -> the autograd node of its last call whose gradient the hook receives.
_HOOKED: weakref.WeakKeyDictionary[Module, object] = weakref.WeakKeyDictionary()


def hooked_node(module: Module):
    """The node of ``module``'s last call whose gradient runs BackPACK, if hooked."""
    return _HOOKED.get(module)


def forget(modules: Sequence[Module]) -> None:
    """Drop the hooked nodes of ``modules`` (the step is over)."""
    for module in modules:
        _HOOKED.pop(module, None)


def has_backpack_hooks(module: Module) -> bool:
    """Whether ``backpack.extend`` put its hooks on ``module`` (and they are on)."""
    return any(h is hook_store_io for h in module._forward_hooks.values()) or any(
        h is hook_run_extensions for h in module._backward_hooks.values()
    )


def clashing_names(module: Module) -> list[str]:
    """Names BackPACK would store on ``module`` that a child, parameter or buffer has.

    ``output`` and ``input0``, ``input1``, ... (any ``input<k>`` name counts).
    """
    taken = [*module._modules, *module._parameters, *module._buffers]
    return [name for name in taken if name == "output" or _is_input_name(name)]


def _is_input_name(name: str) -> bool:
    return name.startswith("input") and name[5:].isdigit()


@dataclass
class _State:
    """One rewired module: what was taken off and how many cockpits hold it."""

    action: str
    reason: str
    users: int = 0
    forward: dict = field(default_factory=dict)
    backward: dict = field(default_factory=dict)
    handle: RemovableHandle | None = None


#: Rewired modules -> their state (weak: a model that is gone is forgotten).
_REWIRED: weakref.WeakKeyDictionary[Module, _State] = weakref.WeakKeyDictionary()


def rewired(module: Module) -> tuple[str, str] | None:
    """``(action, reason)`` if cockpit rewired ``module``'s BackPACK hooks."""
    state = _REWIRED.get(module)
    return (state.action, state.reason) if state is not None else None


def plan_module(
    module: Module,
    rule: Callable[[Module], bool],
    any_rule: Callable[[Module], bool],
    curvature: bool,
    never_served: Callable[[Module], str | None] = lambda module: None,
) -> tuple[str, str] | None:
    """What to do with the BackPACK hooks of an extended module.

    Args:
        module: A module carrying BackPACK's hooks.
        rule: Whether the cockpit's first-order extensions have a rule for the
            module's exact type.
        any_rule: Whether any of the cockpit's extensions (first-order or
            curvature) has one.
        curvature: Whether BackPACK may compute curvature diagonals for the
            cockpit's parameters (then layers with rules keep their hooks).
        never_served: Why BackPACK can serve none of the module's parameters at
            any step (tied weights: another engine serves them), or ``None``.
            Such a layer's hooks are taken off, so its input and output are not
            kept for BackPACK between the forward and the backward pass.

    Returns:
        ``(action, reason)`` (:data:`TAKEN_OFF` or :data:`MOVED`, and why), or
        ``None`` to keep BackPACK's hooks as they are.
    """
    name = type(module).__name__
    clash = clashing_names(module)
    if clash:
        names = " and ".join(f"'{n}'" for n in clash)
        return TAKEN_OFF, (
            f"{name} has {names} of its own, where BackPACK would store the "
            "module's output and inputs"
        )
    if any(True for _ in module.children()):
        return TAKEN_OFF, f"{name} is a container with a forward of its own"
    if not any_rule(module):
        return TAKEN_OFF, f"BackPACK has no rule for {name}"
    if curvature:
        return None
    if not any(True for _ in module.parameters(recurse=False)):
        return TAKEN_OFF, f"{name} has no parameters of its own"
    if not rule(module):
        return TAKEN_OFF, f"BackPACK has no first-order rule for {name}"
    reason = never_served(module)
    if reason is not None:
        return TAKEN_OFF, reason
    return MOVED, f"{name}'s output may be changed in place by the forward code"


def rewire(modules: Sequence[Module], plan: Callable) -> list[Module]:
    """Rewire BackPACK's hooks of ``modules`` (see the module docstring).

    Args:
        modules: The modules of the models.
        plan: ``module -> (action, reason) | None`` (:func:`plan_module`).

    Modules without BackPACK's hooks, recurrent layers and those ``plan`` keeps
    are left alone; a module rewired by another cockpit gets one more user.

    Returns:
        The modules this call holds (pass them to :func:`release`).
    """
    held = []
    for module in modules:
        state = _REWIRED.get(module)
        if state is None:
            if isinstance(module, RNNBase) or not has_backpack_hooks(module):
                continue
            planned = plan(module)
            if planned is None:
                continue
            state = _take_off(module, *planned)
            _REWIRED[module] = state
        state.users += 1
        held.append(module)
    return held


def _take_off(module: Module, action: str, reason: str) -> _State:
    state = _State(action, reason)
    for key, hook in list(module._backward_hooks.items()):
        if hook is hook_run_extensions:
            state.backward[key] = module._backward_hooks.pop(key)
    if action == TAKEN_OFF:
        for key, hook in list(module._forward_hooks.items()):
            if hook is hook_store_io:
                state.forward[key] = module._forward_hooks.pop(key)
        stored = [n for n in vars(module) if n == "output" or _is_input_name(n)]
        for name in stored:  # kept from a forward pass before: free them
            delattr(module, name)
    else:
        state.handle = module.register_forward_hook(output_hook)
    return state


def release(modules: Sequence[Module]) -> None:
    """Give up a hold on ``modules``; the last one puts BackPACK's hooks back.

    The hooks get their old places (hook ids grow with registration, so sorting by
    id restores the order in which they run); the dictionaries stay the same
    objects, so BackPACK's handles still remove them.
    """
    for module in modules:
        state = _REWIRED.get(module)
        if state is None:
            continue
        state.users -= 1
        if state.users > 0:
            continue
        del _REWIRED[module]
        if state.handle is not None:
            state.handle.remove()
        _put_back(module._forward_hooks, state.forward)
        _put_back(module._backward_hooks, state.backward)


def _put_back(hooks: dict, removed: dict) -> None:
    if not removed:
        return
    entries = sorted({**hooks, **removed}.items())
    hooks.clear()
    hooks.update(entries)
