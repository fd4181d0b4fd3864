"""The modules around the cockpit's parameters and the graph of a step's losses.

The 1.0.2 loop hands the cockpit only ``model.parameters()``; the modules owning
them are found from the parameters alone (:func:`discover`: one scan of the garbage
collector's objects, done once). :func:`graph_uses` walks the autograd graph of a
step's losses; :func:`batch_mixing` finds the parameters whose samples mix
through a batch norm after them. Nothing here knows an engine.
"""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass
from itertools import compress
from typing import Iterable, Sequence

import torch
from torch import Tensor
from torch.nn import Module


@dataclass
class ModuleMap:
    """The modules owning the cockpit's parameters and their containers.

    Attributes:
        owners: ``id(param)`` -> ``[(module, attribute name)]``.
        parents: ``id(module)`` -> the modules holding it as a child.
    """

    owners: dict[int, list[tuple[Module, str]]]
    parents: dict[int, list[Module]]


def discover(params: Sequence[Tensor]) -> ModuleMap:
    """Find the modules that own ``params``, and their containers (one gc scan)."""
    wanted = {id(p) for p in params}
    owners: dict[int, list[tuple[Module, str]]] = {i: [] for i in wanted}
    parents: dict[int, list[Module]] = {}
    for obj in _all_modules():
        for name, param in vars(obj).get("_parameters", {}).items():
            if param is not None and id(param) in wanted:
                owners[id(param)].append((obj, name))
        for child in vars(obj).get("_modules", {}).values():
            if child is not None:
                parents.setdefault(id(child), []).append(obj)
    return ModuleMap(owners, parents)


def _module_classes() -> set[type]:
    """``nn.Module`` and every subclass of it that exists now."""
    found, stack = set(), [Module]
    while stack:
        cls = stack.pop()
        if cls not in found:
            found.add(cls)
            stack.extend(type.__subclasses__(cls))
    return found


def _all_modules() -> list[Module]:
    """Every module the garbage collector tracks.

    The filter runs in C (``map``, ``compress``, a set's ``__contains__``), about
    three times faster than a Python loop calling ``issubclass`` on each of the
    hundreds of thousands of objects a process that imported transformers holds.
    """
    objects = gc.get_objects()
    classes = _module_classes()
    return list(compress(objects, map(classes.__contains__, map(type, objects))))


def graph_uses(roots: Iterable) -> tuple[set, Counter]:
    """Walk an autograd graph from ``roots``: its nodes and each leaf's use count.

    Returns:
        The set of nodes reached, and ``id(leaf tensor)`` -> the number of edges into
        its gradient accumulator (one per use in the forward pass).
    """
    seen: set = set()
    uses: Counter = Counter()
    stack = [node for node in roots if node is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:
                uses[id(variable)] += 1
            stack.append(child)
    return seen, uses


def batch_statistics_nodes(nodes: Iterable) -> list:
    """The batch-norm nodes among ``nodes`` that normalise with mini-batch statistics.

    A ``*BatchNormBackward*`` node saves whether it used the batch's statistics
    (``_saved_training``: a BatchNorm layer in train mode or without running
    statistics, ``F.batch_norm(training=True)``); a kernel that does not save it
    counts as mixing (the safe side: nothing is computed per sample that is not).
    """
    return [
        node
        for node in nodes
        if "BatchNormBackward" in type(node).__name__
        and getattr(node, "_saved_training", True) is not False
    ]


def mixed_by_batch_statistics(nodes: Iterable) -> set[int]:
    """``id`` of every leaf that reaches the input of a mini-batch-statistics norm.

    Sample ``i``'s loss depends on such a leaf through every sample's input to the
    batch norm (its mean and variance), so no per-sample computation of one sample's
    graph alone gives ``d l_i / d leaf``.
    """
    roots = [
        node.next_functions[0][0]
        for node in batch_statistics_nodes(nodes)
        if node.next_functions and node.next_functions[0][0] is not None
    ]
    _, reached = graph_uses(roots)
    mixed = set(reached)
    for root in roots:  # a leaf normalised directly
        variable = getattr(root, "variable", None)
        if variable is not None:
            mixed.add(id(variable))
    return mixed


def describe(module: Module, attribute: str = "") -> str:
    """``"LayerNorm.weight"``-style label of a module (and a parameter of it)."""
    return type(module).__name__ + (f".{attribute}" if attribute else "")


def ancestors(module: Module, parents: dict[int, list[Module]]) -> list[Module]:
    """``module`` and the modules containing it, innermost first (first parents)."""
    chain = [module]
    seen = {id(module)}
    while True:
        above = None
        for parent in parents.get(id(chain[-1]), ()):
            if id(parent) not in seen:
                above = parent
                break
        if above is None:
            return chain
        chain.append(above)
        seen.add(id(above))


def common_container(
    modules: list[Module], parents: dict[int, list[Module]]
) -> Module | None:
    """The smallest module containing all of ``modules``."""
    if not modules:
        return None
    chains = [ancestors(m, parents) for m in modules]
    common = [
        m for m in chains[0] if all(any(o is m for o in chain) for chain in chains[1:])
    ]
    return common[0] if common else None


def roots_of(owners: dict, parents: dict) -> list[Module]:
    """The outermost modules holding the parameters' owners."""
    roots: dict[int, Module] = {}
    for found in owners.values():
        for module, _ in found:
            top = ancestors(module, parents)[-1]
            roots.setdefault(id(top), top)
    return list(roots.values())


# --- samples that mix: batch norms with mini-batch statistics -------------------------
# Engine-neutral: every engine that forms a layer's per-sample results from the
# layer's input and the gradient at its output (BackPACK, ghost) declines the
# parameters before such a batch norm (batch_mixing finds them in the step's graph).
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
    """Parameters whose per-layer per-sample results mix samples, with why.

    A batch norm that normalises with mini-batch statistics (a BatchNorm layer in
    train mode, or without running statistics; ``F.batch_norm`` with
    ``training=True``) makes sample ``i``'s loss depend on every sample's input to
    it. An engine that forms a layer's per-sample results from its input and the
    gradient of the mini-batch loss at its output (BackPACK, ghost) would, for
    the layers before such a
    batch norm these split the mini-batch gradient by input sample (they sum to
    it) instead of giving ``d l_i / d theta``. The layers after it, and its own
    weight and bias, are not affected. The batch norms are found among the
    autograd nodes of the step's losses (every call, also of a shared layer or a
    functional one); "before" means reached by the graph of a node's input.

    Args:
        params: The cockpit's parameters.
        nodes: The autograd nodes of the step's (per-sample) losses.
        layers: The BatchNorm layers around the model (labels of their calls;
            BackPACK's stored ``output`` of a layer names its call).

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
