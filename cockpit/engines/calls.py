"""Module calls: forward hooks that tell an engine of each call of a module.

The engines that read a layer's call, the ghost engine (its input, and the gradient
at its output) and the replay engine (its inputs and outputs, to re-run it sample
by sample), watch modules with :func:`watch`: a forward hook (and, where asked, a
pre-hook) that hands each call to its owner's ``returned(module, args, kwargs,
output)`` (and ``started(module)``). The hooks hold their owner weakly, and a
copied or pickled model (``copy.deepcopy``, ``torch.save(model)``) gets inert
ones. :class:`CallRecorder` keeps the last call of each watched module
(:class:`Call`), for the replay engine.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.nn import Module
from torch.utils._pytree import tree_flatten

from cockpit.torch_state import autocast_on, in_transform


class _Hook:
    """A watch hook; a copied or pickled model gets an inert one."""

    __slots__ = ("owner", "before")

    def __init__(self, owner, before: bool):
        self.owner, self.before = weakref.ref(owner), before

    def __call__(self, module, args, *rest):
        owner = self.owner()
        if owner is None:
            return
        if self.before:
            owner.started(module)
        else:
            owner.returned(module, args, *rest)

    def __reduce__(self):
        return (_no_hook, ())


def _inert(*args, **kwargs):
    """What a copied or pickled watch hook becomes: nothing."""
    return None


def _no_hook():
    return _inert


def watch(module: Module, owner, before: bool = False) -> list:
    """Hook ``module``'s forward for ``owner`` (see the module); return the handles.

    Args:
        module: The module to watch.
        owner: Gets ``returned(module, args, kwargs, output)`` after each call
            (and ``started(module)`` before it, with ``before``); held weakly.
        before: Also tell the owner when a call begins.
    """
    handles = []
    if before:
        handles.append(module.register_forward_pre_hook(_Hook(owner, True)))
    handles.append(module.register_forward_hook(_Hook(owner, False), with_kwargs=True))
    return handles


# a leaf whose products show how many autograd nodes exist (sequence numbers)
_CLOCK = torch.zeros((), requires_grad=True)


def _now() -> int:
    """The sequence number the next autograd node of this thread gets (about)."""
    with torch.enable_grad():
        return (_CLOCK * 1).grad_fn._sequence_nr()


@dataclass
class Call:
    """The last call of a watched module: what it got and what it returned.

    Attributes:
        leaves: The flattened ``(args, kwargs)``.
        spec: Their tree structure.
        outputs: The flattened output.
        versions: ``_version`` of every tensor among inputs and outputs when the
            call returned (a later in-place change makes the call unusable).
        start: Sequence number of the first autograd node the call could create.
        autocast: Whether it ran under ``torch.autocast``.
    """

    leaves: list
    spec: Any
    outputs: list
    versions: list[int]
    start: int
    autocast: bool

    def tensors(self) -> list[Tensor]:
        """Input and output tensors, in the order of :attr:`versions`."""
        return [t for t in (*self.leaves, *self.outputs) if isinstance(t, Tensor)]

    def unchanged(self) -> bool:
        """Whether no input or output was changed in place since the call."""
        return all(
            t._version == v for t, v in zip(self.tensors(), self.versions, strict=True)
        )


class CallRecorder:
    """Forward hooks that keep the last call of each watched module.

    A call made without gradients (evaluation) is not kept; :meth:`clear` drops the
    references (the cockpit does so when a step closes, so nothing is held between
    steps beyond what BackPACK's own hooks hold).
    """

    def __init__(self):
        self.calls: dict[int, Call] = {}
        self._handles: dict[int, list] = {}
        #: Watched modules whose forward began and has not returned yet.
        self.starts: dict[int, tuple[int, bool]] = {}
        #: While set, calls are not recorded: a forward that code run inside the
        #: replayer's own backward passes (a hand-written recomputation in a custom
        #: autograd function) must not replace the step's call.
        self.paused = False

    def watch(self, modules: Sequence[Module]) -> None:
        """Keep the calls of ``modules`` from now on (watching twice is harmless)."""
        for module in modules:
            key = id(module)
            if key in self._handles:
                continue
            self._handles[key] = watch(module, self, before=True)

    def started(self, module: Module) -> None:
        """A watched module's forward begins (called by its pre-hook)."""
        if torch.is_grad_enabled() and not self.paused and not in_transform():
            self.starts[id(module)] = (_now(), autocast_on())

    def returned(self, module: Module, args, kwargs, output) -> None:
        """A watched module's forward returned (called by its hook)."""
        key = id(module)
        start = self.starts.pop(key, None)
        if start is None:
            return
        leaves, spec = tree_flatten((args, kwargs))
        outputs, _ = tree_flatten(output)
        tensors = [t for t in (*leaves, *outputs) if isinstance(t, Tensor)]
        self.calls[key] = Call(
            leaves, spec, outputs, [t._version for t in tensors], start[0], start[1]
        )

    def clear(self) -> None:
        """Forget the recorded calls."""
        self.calls.clear()
        self.starts.clear()

    def close(self) -> None:
        """Remove the hooks."""
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles.clear()
        self.clear()
