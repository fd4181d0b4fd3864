"""Which engine computes each parameter's per-sample results: per-layer rules first.

Like opacus' grad samplers (a registry of fast per-layer rules and a generic
fallback), cockpit lets BackPACK compute a parameter's per-sample results only where
BackPACK's rule is known to be right, and hands every other parameter to the
autograd engine (:mod:`cockpit.engines.autograd`). A parameter goes to BackPACK if

1. exactly one module owns it (not tied to a second module),
2. that module is ``backpack.extend``-ed and BackPACK has a rule for its exact type
   in every first-order extension of the step, and the rule accepts its settings
   (e.g. BackPACK's LSTM rule needs ``batch_first=True`` and one layer),
3. the autograd graph of the per-sample losses uses the parameter once (a second
   use, as with weight tying, a shared layer or ``x @ layer.weight`` in forward
   code, is invisible to the module's rule),
4. the module ran in this step's forward pass in its parameters' dtype (not under
   ``torch.autocast``, which gives a float32 layer bfloat16 inputs or outputs; the
   rules need one dtype) and the first axis of its output is the sample axis: the
   gradient of sample ``a``'s loss reaches only slice ``a`` of it (checked for the
   first and the last sample with two backward passes, the first time a module is
   seen with given shapes),
5. no batch norm that normalises with mini-batch statistics (train mode, or no
   running statistics) comes after it in the graph: that mixes the samples, and
   BackPACK's results would split the mini-batch gradient by input sample
   (:meth:`Router.batch_mixing`).

Everything else (MultiheadAttention, GRU, raw ``nn.Parameter`` s used in forward
code, custom modules, the layers before a train-mode BatchNorm, ...) goes to
autograd, with the reason recorded for :meth:`Cockpit.coverage
<cockpit.Cockpit.coverage>`.

BackPACK's curvature diagonals backpropagate through every layer, so they are used
only when every parameter goes to BackPACK, the modules between them form an
``nn.Sequential`` (or a model converted by ``backpack.extend(model,
use_converter=True)``), and every layer has a rule (:meth:`Router.curvature_problem`).

Modules are found from the parameters alone (the 1.0.2 loop hands the cockpit only
``model.parameters()``): one scan of the garbage collector's objects, done once.
"""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import Tensor
from torch.nn import Module, Sequential

#: Start of the reason of a parameter whose module ran under ``torch.autocast``.
AUTOCAST = "ran under torch.autocast"

#: Engine names as shown in the coverage report.
BACKPACK = "backpack"
AUTOGRAD = "autograd"
UNUSED = "unused"


@dataclass(frozen=True)
class Route:
    """Which engine computes one parameter's per-sample results, and why.

    Attributes:
        engine: :data:`BACKPACK`, :data:`AUTOGRAD` or :data:`UNUSED` (the
            per-sample losses do not depend on it: exact zeros).
        reason: Why (empty for BackPACK).
        module: A description of the owning module (class and attribute).
        method: How the autograd engine got them at the step: a replay of one
            module sample by sample (:data:`REPLAY` and the module's class) or
            :data:`PER_SAMPLE_BACKWARD` (empty before the step ran).
    """

    engine: str
    reason: str = ""
    module: str = ""
    method: str = ""


#: Method of a parameter replayed within a module (``"replay of <class>"``).
REPLAY = "replay of"
#: Start of the reason of a parameter sent to autograd because a BatchNorm layer
#: in train mode after it mixes the samples.
BEFORE_BATCHNORM = "samples mix through"
#: Method of a parameter differentiated through the whole graph, sample by sample.
PER_SAMPLE_BACKWARD = "one batched backward pass per sample"


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
    for obj in gc.get_objects():
        if not issubclass(type(obj), Module):
            continue
        for name, param in vars(obj).get("_parameters", {}).items():
            if param is not None and id(param) in wanted:
                owners[id(param)].append((obj, name))
        for child in vars(obj).get("_modules", {}).values():
            if child is not None:
                parents.setdefault(id(child), []).append(obj)
    return ModuleMap(owners, parents)


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


def describe(module: Module, attribute: str = "") -> str:
    """``"LayerNorm.weight"``-style label of a module (and a parameter of it)."""
    return type(module).__name__ + (f".{attribute}" if attribute else "")


def is_training_batchnorm(module: Module) -> bool:
    """Whether ``module`` is a BatchNorm layer normalising with mini-batch statistics.

    In train mode, or in eval mode without running statistics
    (``track_running_stats=False``), as its forward pass does.
    """
    return isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and (
        module.training or module.running_mean is None
    )


class Router:
    """Decides, per step, which engine computes each parameter's results.

    Args:
        params: The cockpit's parameters.
        rule_problem: ``(module, extension) -> str | None``: why BackPACK's rule of
            ``extension`` cannot compute ``module``'s results (``None``: it can).
        quiet_backward: A context in which extra backward passes leave BackPACK's
            stored inputs alone (the probes run in it).
    """

    def __init__(self, params: Sequence[Tensor], rule_problem, quiet_backward):
        self.params = params
        self._rule_problem = rule_problem
        self._quiet = quiet_backward
        self._map: ModuleMap | None = None
        self._probed: dict[tuple, bool] = {}
        #: Random source of estimates (seeded: runs are reproducible).
        self.generator = torch.Generator().manual_seed(0)
        #: ``(key, report)`` of the latest step's coverage (rebuilt when it changes).
        self.coverage_cache: tuple | None = None
        self._batchnorms: list[tuple[str, Module]] | None = None

    @property
    def modules(self) -> ModuleMap:
        """The module map (discovered on first use)."""
        if self._map is None:
            self._map = discover(self.params)
        return self._map

    def modules_only_in(self, indices: Iterable[int]) -> list[Module]:
        """Modules owning parameters ``indices`` and no other cockpit parameter."""
        chosen = {id(self.params[i]) for i in indices}
        found: dict[int, Module] = {}
        for index in chosen:
            for module, _ in self.modules.owners.get(index, []):
                found[id(module)] = module
        return [
            module
            for module in found.values()
            if all(
                id(p) in chosen
                for p in module.parameters(recurse=False)
                if id(p) in self.modules.owners
            )
        ]

    # --- static part ---------------------------------------------------------------
    def static_route(self, index: int, extensions: Sequence) -> Route:
        """Route parameter ``index`` from the model's structure alone (rules 1, 2)."""
        owners = self.modules.owners.get(id(self.params[index]), [])
        if not owners:
            return Route(AUTOGRAD, "not owned by any module (a free tensor)")
        if len(owners) > 1:
            names = " and ".join(describe(m, a) for m, a in owners)
            return Route(AUTOGRAD, f"tied: owned by {names}", describe(*owners[0]))
        module, attribute = owners[0]
        label = describe(module, attribute)
        if not getattr(module, "_backpack_extend", False):
            return Route(
                AUTOGRAD, f"{describe(module)} is not backpack.extend-ed", label
            )
        for extension in extensions:
            problem = self._rule_problem(module, extension)
            if problem is not None:
                return Route(AUTOGRAD, problem, label)
        return Route(BACKPACK, "", label)

    # --- per step ------------------------------------------------------------------
    def route(
        self,
        extensions: Sequence,
        individual_losses: Tensor | None,
        loss: Tensor | None = None,
    ) -> list[Route]:
        """Route every parameter for a step whose first-order work is ``extensions``.

        Args:
            extensions: The step's first-order BackPACK extensions.
            individual_losses: The per-sample losses with their graph.
            loss: The mini-batch loss; its graph stands in for the per-sample
                losses' where those have none (uses are still counted; the
                sample axis cannot be checked then).

        Returns:
            One :class:`Route` per parameter.
        """
        routes = [self.static_route(i, extensions) for i in range(len(self.params))]
        per_sample = individual_losses is not None and individual_losses.grad_fn
        if per_sample:
            root, n = individual_losses, individual_losses.shape[0]
        elif isinstance(loss, Tensor) and loss.grad_fn is not None:
            root, n = loss, 0
        else:
            return routes
        nodes, uses = graph_uses([root.grad_fn])
        mixed = self.batch_mixing(nodes)
        candidates: dict[int, Module] = {}
        for index, route in enumerate(routes):
            param = self.params[index]
            count = uses.get(id(param), 0)
            if count == 0:
                routes[index] = Route(
                    UNUSED, "the per-sample losses do not depend on it", route.module
                )
                continue
            if route.engine != BACKPACK:
                continue
            module, _ = self.modules.owners[id(param)][0]
            problem = self._use_problem(module, count, nodes, n)
            if problem is None and index in mixed:
                problem = (
                    f"{BEFORE_BATCHNORM} {mixed[index]} after it (normalised with "
                    "mini-batch statistics), so BackPACK's per-sample results "
                    "would split the mini-batch gradient by input sample instead of "
                    "giving d l_i / d theta"
                )
            if problem is not None:
                routes[index] = Route(AUTOGRAD, problem, route.module)
            else:
                candidates[id(module)] = module
        if not per_sample or n < 2:  # no sample axis to check (a wrong length of
            failed: set[int] = set()  # the per-sample losses fails in the quantities)
        else:
            failed = self._probe(individual_losses, list(candidates.values()))
        for index, route in enumerate(routes):
            if route.engine != BACKPACK:
                continue
            module, _ = self.modules.owners[id(self.params[index])][0]
            if id(module) in failed:
                routes[index] = Route(
                    AUTOGRAD,
                    self._shape_problem(module, n)
                    or f"the first axis of {describe(module)}'s output is not the "
                    "sample axis (e.g. a batch_first=False layout)",
                    route.module,
                )
        return routes

    def _use_problem(self, module: Module, count: int, nodes, n: int) -> str | None:
        if count > 1 and not isinstance(module, torch.nn.RNNBase):
            return (
                f"used {count} times in the forward pass (weight tying, a shared "
                "layer or forward code reading the parameter)"
            )
        output = getattr(module, "output", None)
        if not isinstance(output, Tensor) or output.grad_fn not in nodes:
            return (
                f"{describe(module)} did not run in this forward pass (its parameters "
                "are used by other code)"
            )
        return _dtype_problem(module)

    @staticmethod
    def _shape_problem(module: Module, n: int) -> str | None:
        """A first axis of another size than ``n`` (the reason for a failed probe)."""
        for what in ("input0", "output"):
            tensor = getattr(module, what, None)
            if isinstance(tensor, Tensor) and (
                tensor.dim() == 0 or tensor.shape[0] != n
            ):
                size = tensor.shape[0] if tensor.dim() else "none"
                return (
                    f"the first axis of {describe(module)}'s "
                    f"{'input' if what == 'input0' else 'output'} has size {size}, "
                    f"not the batch size {n} (e.g. a batch_first=False layout)"
                )
        return None

    def batchnorms(self) -> list[tuple[str, Module]]:
        """``(label, layer)`` of the BatchNorm layers around the parameters.

        Found once, in the outermost modules holding the parameters' owners (a
        cockpit given part of a model still sees the BatchNorm layers of the
        rest), with or without parameters of their own (``affine=False``). The
        label is the class and the qualified name, e.g. ``BatchNorm2d 'b.0.bn'``.
        """
        if self._batchnorms is None:
            roots: dict[int, Module] = {}
            for found in self.modules.owners.values():
                for module, _ in found:
                    root = self._ancestors(module)[-1]
                    roots.setdefault(id(root), root)
            layers: dict[int, tuple[str, Module]] = {}
            for root in roots.values():
                for name, module in root.named_modules():
                    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                        label = (
                            f"{type(module).__name__} {name!r}"
                            if name
                            else (type(module).__name__)
                        )
                        layers.setdefault(id(module), (label, module))
            self._batchnorms = list(layers.values())
        return self._batchnorms

    def batch_mixing(self, nodes: set) -> dict[int, str]:
        """Parameters whose BackPACK per-sample results mix samples, with why.

        A batch norm that normalises with mini-batch statistics (a BatchNorm layer
        in train mode, or without running statistics; ``F.batch_norm`` with
        ``training=True``) makes sample ``i``'s loss depend on every sample's input
        to it. BackPACK forms a layer's per-sample results from its input and the
        gradient of the mini-batch loss at its output; for the layers before such a
        batch norm these split the mini-batch gradient by input sample (they sum to
        it) instead of giving ``d l_i / d theta``. The layers after it, and its own
        weight and bias, are not affected. The batch norms are found among the
        autograd nodes of the step's losses (every call, also of a shared layer or
        a functional one); "before" means reached by the graph of a node's input.
        :meth:`route` sends those parameters to the autograd engine, which is exact
        for them: it differentiates each sample's loss through the whole batch.

        Args:
            nodes: The autograd nodes of the step's (per-sample) losses.

        Returns:
            Parameter index -> the batch norms responsible, e.g.
            ``"BatchNorm2d 'blocks.0.bn' and 3 more batch norms"``.
        """
        layers = {}  # node -> (label, layer) of the extended layers' last calls
        for label, module in self.batchnorms():
            output = getattr(module, "output", None)
            if isinstance(output, Tensor) and output.grad_fn is not None:
                layers.setdefault(output.grad_fn, (label, module))
        roots, labels = [], set()
        for node in nodes:
            if "BatchNormBackward" not in type(node).__name__:
                continue
            known = layers.get(node)
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
        return {i: who for i, p in enumerate(self.params) if id(p) in reached}

    def _probe(self, losses: Tensor, modules: list[Module]) -> set[int]:
        """Return ids of modules whose output's first axis is not the sample axis.

        The gradient of sample ``a``'s loss must reach only slice ``a`` of the
        output's first axis (checked for the first and the last sample, once per
        module and shapes).
        """
        n = losses.shape[0]
        keys = {id(m): _probe_key(m) for m in modules}
        todo = [m for m in modules if keys[id(m)] not in self._probed]
        if todo:
            from cockpit.engines.autograd import sample_losses

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

    # --- curvature -----------------------------------------------------------------
    def curvature_problem(
        self, routes: Sequence[Route], extensions: Sequence
    ) -> str | None:
        """Why BackPACK's curvature ``extensions`` cannot run (``None``: they can)."""
        for route in routes:
            if route.engine == AUTOGRAD:
                return (
                    f"{route.module or 'a parameter'} gets its per-sample gradients "
                    f"from autograd ({route.reason}), and BackPACK's curvature needs "
                    "a BackPACK rule for every layer"
                )
        owners = [
            self.modules.owners[id(p)][0][0]
            for p in self.params
            if self.modules.owners.get(id(p))
        ]
        root = self._common_container(owners)
        if root is None:
            return "the parameters do not belong to one model"
        for module in root.modules():
            children = list(module.children())
            if children:
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
            for extension in extensions:
                problem = self._rule_problem(module, extension)
                if problem is not None:
                    return problem
        return None

    def _common_container(self, modules: list[Module]) -> Module | None:
        """The smallest module containing all of ``modules``."""
        if not modules:
            return None
        chains = [self._ancestors(m) for m in modules]
        common = [m for m in chains[0] if all(_has(chain, m) for chain in chains[1:])]
        return common[0] if common else None

    def chain(self, param: Tensor) -> list[Module]:
        """``param``'s (first) owner and the modules containing it, innermost first."""
        owners = self.modules.owners.get(id(param), [])
        return self._ancestors(owners[0][0]) if owners else []

    def replay_candidates(self, extensions: Sequence) -> list[Tensor]:
        """Parameters whose owner has no rule in ``extensions`` (per-sample ones).

        Their owners and containers are worth watching from the start (see
        :mod:`cockpit.engines.replay`); parameters that routing sends to autograd
        for other reasons (a second use, a sequence-first layout, ...) are added
        when they are seen.
        """
        return [
            p
            for i, p in enumerate(self.params)
            if self.static_route(i, extensions).engine == AUTOGRAD
        ]

    def in_place_modules(self) -> list[tuple[str, Module]]:
        """In-place modules among extended layers, as ``(label, module)``.

        Modules with ``inplace=True`` (ReLU, Dropout, ...) change their input; those
        that are extended or sit beside an extended layer are returned (a model
        without extended layers, e.g. a teacher network, is left alone).
        BackPACK's backward hooks return a module's output (and take its input) as
        a view that autograd forbids changing in place, so such a module stops the
        forward pass with "Output 0 of BackwardHookFunction is a view and is being
        modified inplace".
        """
        roots: dict[int, Module] = {}
        for owners in self.modules.owners.values():
            for module, _ in owners:
                top = self._ancestors(module)[-1]
                roots[id(top)] = top
        found, seen = [], set()

        def extended(module: Module) -> bool:
            return bool(getattr(module, "_backpack_extend", False))

        for root in roots.values():
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

    def _ancestors(self, module: Module) -> list[Module]:
        chain = [module]
        seen = {id(module)}
        while True:
            parents = self.modules.parents.get(id(chain[-1]), [])
            parents = [p for p in parents if id(p) not in seen]
            if not parents:
                return chain
            chain.append(parents[0])
            seen.add(id(parents[0]))


def _dtype_problem(module: Module) -> str | None:
    """Why BackPACK's rules cannot take ``module``'s mixed dtypes (autocast)."""
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
    return (
        f"{AUTOCAST} ({found}, parameters {params}): BackPACK's rules need one "
        "dtype; autograd differentiates the autocast graph"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _has(chain: list[Module], module: Module) -> bool:
    return any(m is module for m in chain)


def _probe_key(module: Module) -> tuple:
    inputs = getattr(module, "input0", None)
    shape = tuple(inputs.shape) if isinstance(inputs, Tensor) else None
    return (id(module), shape, tuple(module.output.shape))
