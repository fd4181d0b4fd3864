"""Merging BackPACK extensions, and the extension hook that runs quantities per module.

BackPACK calls the cockpit's :class:`ModuleHook` right after it has run the active
extensions on a module. The hook shows each of the module's parameters to every
quantity that reads per-parameter results (via a :class:`~cockpit.param_view.ParamView`)
and then deletes the BackPACK buffers the cockpit asked for, so large per-sample or
curvature tensors exist for one module at a time, never for the whole model.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from backpack.extensions.backprop_extension import BackpropExtension
from torch import Tensor
from torch.nn import Module

from cockpit.param_view import ParamView

# Attributes of BackPACK extensions that are bookkeeping, not hyper-parameters.
_NOT_HYPERPARAMETERS = {"saved_quantities"}


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
    ``served_by(other)`` method, that ``other`` provides everything it does (the
    cockpit's :class:`~cockpit.extensions.PerSampleGradients` and a plain
    ``BatchGrad()``): only ``other`` runs.

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


class ModuleHook:
    """The extension hook of one backward pass.

    Args:
        params: The cockpit's parameters (a parameter's index is its position).
        consumers: Quantities whose ``accumulate(global_step, view)`` reads
            per-parameter results at this step.
        global_step: The step being tracked.
        free_savefields: BackPACK savefields to delete once a parameter is done.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        consumers: Iterable,
        global_step: int,
        free_savefields: Iterable[str],
    ):
        self._index = {id(p): i for i, p in enumerate(params)}
        self._consumers = list(consumers)
        self._global_step = global_step
        self._free = tuple(free_savefields)
        self.visited: set[int] = set()

    def __call__(self, module: Module) -> None:
        """Show the module's parameters to the quantities, then free the buffers.

        Runs without recording an autograd graph: under ``create_graph=True`` the
        statistics would otherwise keep their inputs alive until the step ends.
        """
        with torch.no_grad():
            self._visit(module)

    def _visit(self, module: Module) -> None:
        for param in module.parameters(recurse=False):
            index = self._index.get(id(param))
            if index is None or index in self.visited:
                continue
            self.visited.add(index)
            view = ParamView(param, index)
            for quantity in self._consumers:
                quantity.accumulate(self._global_step, view)
            view.release()
            free_buffers(param, self._free)


def free_buffers(param: Tensor, savefields: Iterable[str]) -> None:
    """Delete the given BackPACK savefields from ``param`` where present."""
    for field in savefields:
        if hasattr(param, field):
            delattr(param, field)
