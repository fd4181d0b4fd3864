"""The shape of the package: who imports whom, read from the source.

The graph is built from the source text with :mod:`ast`, so every import counts,
also one inside a function (it runs when the function does), except those under
``if TYPE_CHECKING:`` (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cockpit"


def _module_files() -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imported_names(tree: ast.AST):
    """Yield every ``Import``/``ImportFrom`` node that can run (not TYPE_CHECKING)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # `else:` runs
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _targets(node: ast.Import | ast.ImportFrom, module: str, path: Path) -> set[str]:
    """The modules an import statement names (any, in the package or not)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    source = node.module or ""
    if node.level:  # relative: from the module's package, up level - 1
        package = module.split(".")
        if path.name != "__init__.py":
            package.pop()
        package = package[: len(package) - node.level + 1]
        source = ".".join(package + ([source] if source else []))
    found = set()
    for alias in node.names:
        child = f"{source}.{alias.name}"
        found.add(child if child in MODULES else source)
    return found


def _imports(module: str) -> set[str]:
    """Every module ``module`` imports (its own package's and others)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in _imported_names(tree):
        names |= _targets(node, module, path)
    return names


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of the package it imports}`` (without itself)."""
    return {
        module: {m for m in _imports(module) if m in MODULES and m != module}
        for module in MODULES
    }


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles of the graph, at least one through each group of modules in a cycle.

    A depth-first search; every edge back into the current path closes a cycle.
    """
    cycles, seen, done = [], set(), set()
    for start in sorted(graph):
        if start in done:
            continue
        path, pending = [start], [iter(sorted(graph[start]))]
        while pending:
            following = next(pending[-1], None)
            if following is None:
                pending.pop()
                done.add(path.pop())
            elif following in path:
                cycle = path[path.index(following) :] + [following]
                if frozenset(cycle) not in seen:
                    seen.add(frozenset(cycle))
                    cycles.append(cycle)
            elif following not in done:
                path.append(following)
                pending.append(iter(sorted(graph.get(following, ()))))
    return cycles


def test_the_graph_reader_counts_what_can_run():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import typed_only\nelse:\n    import at_runtime\n"
        "def later():\n    from inside import name\n"
    )
    names = {
        target
        for node in _imported_names(ast.parse(source))
        for target in _targets(node, "cockpit.example", PACKAGE / "example.py")
    }
    assert names == {"typing", "at_runtime", "inside"}
    graph = import_graph()
    assert "cockpit.log.files" in graph["cockpit.cli"]
    assert "cockpit.diagnosis.report" in graph["cockpit.cli"]  # inside build_parser
    # `from cockpit.engines import backpack as bp` names the module
    assert "cockpit.engines.backpack.api" in graph["cockpit.engines.backpack.engine"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "c", "a"]
    ]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    shown = "\n".join(" -> ".join(cycle) for cycle in cycles)
    assert not cycles, f"import cycles in the cockpit package:\n{shown}"


def _is_backpack_engine(module: str) -> bool:
    """The BackPACK engine's package, the one place that may import BackPACK."""
    return module == "cockpit.engines.backpack" or module.startswith(
        "cockpit.engines.backpack."
    )


def test_backpack_is_imported_by_its_engine_only():
    importers = sorted(
        module
        for module in MODULES
        if any(m == "backpack" or m.startswith("backpack.") for m in _imports(module))
    )
    assert any(_is_backpack_engine(m) for m in importers)  # the test sees them
    outside = [m for m in importers if not _is_backpack_engine(m)]
    assert not outside, f"modules outside engines/backpack* import backpack: {outside}"


def test_the_log_keys_import_nothing():
    """Every reader and writer of a log can name its keys (no torch, no numpy)."""
    assert _imports("cockpit.log.keys") <= {"__future__"}


# --- the step's layers (a feature reads a narrow state, returns what it makes) -------
def _under(package: str) -> list[str]:
    return [m for m in MODULES if m == package or m.startswith(package + ".")]


def _reach(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every module of the package that importing ``module`` can run."""
    seen, stack = set(), [module]
    while stack:
        for following in graph[stack.pop()]:
            if following not in seen:
                seen.add(following)
                stack.append(following)
    return seen


def test_the_step_state_is_small_and_read_only():
    """What features see has at most 14 attributes, frozen, and none are written."""
    import dataclasses

    from cockpit.step.state import StepState

    fields = [f.name for f in dataclasses.fields(StepState)]
    assert 1 <= len(fields) <= 14, fields
    assert StepState.__dataclass_params__.frozen
    state = object.__new__(StepState)
    assert not hasattr(state, "__dict__")  # slots: no attribute beside them
    for name in (fields[0], "shared"):
        try:
            setattr(state, name, None)
        except (dataclasses.FrozenInstanceError, AttributeError, TypeError):
            continue
        raise AssertionError(f"StepState.{name} could be written")
    written = []
    for module in _under("cockpit.step.features"):
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = (
                    node.targets if isinstance(node, ast.Assign) else [node.target]
                )
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in {
                "setattr",
                "delattr",
            }:
                targets = node.args[:1]
            else:
                continue
            for target in targets:
                parts = target.elts if isinstance(target, ast.Tuple) else [target]
                for part in parts:
                    if not isinstance(part, ast.Attribute):
                        continue
                    owner = part.value
                    names = {"state", "run"}
                    if (isinstance(owner, ast.Name) and owner.id in names) or (
                        isinstance(owner, ast.Attribute) and owner.attr in names
                    ):
                        written.append(f"{module}:{node.lineno} {ast.unparse(part)}")
    assert not written, f"step features write the step's state: {written}"


def test_step_features_import_neither_the_run_nor_the_routing():
    graph = import_graph()
    features = _under("cockpit.step.features")
    assert "cockpit.step.features.curvature" in features  # the test sees them
    forbidden = {"cockpit.step.run", "cockpit.step.routing"}
    found = {m: sorted(_reach(m, graph) & forbidden) for m in features}
    found = {m: names for m, names in found.items() if names}
    assert not found, f"step features reach the step's run or routing: {found}"


def test_quantities_and_curvature_import_neither_engines_nor_the_step():
    graph = import_graph()
    layers = _under("cockpit.quantities") + _under("cockpit.curvature")
    assert "cockpit.curvature.lanczos" in layers and "cockpit.quantities.base" in layers
    found = {}
    for module in layers:
        names = sorted(
            m
            for m in _reach(module, graph)
            if m.startswith(("cockpit.engines", "cockpit.step"))
        )
        if names:
            found[module] = names
    assert not found, f"quantities or curvature reach engines or the step: {found}"


def test_the_engine_protocol_is_declared():
    """The step asks engines only what ``Engine`` declares (no getattr look-ups)."""
    from cockpit.engines.base import Engine

    for name in ("explain", "after_backward", "before_backward", "backward_context"):
        assert callable(getattr(Engine, name, None)), name
    looked_up = []
    for module in _under("cockpit.step"):
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", "") in {"getattr", "hasattr"}
                and "engine" in ast.unparse(node.args[0])
            ):
                looked_up.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    assert not looked_up, f"engine methods looked up by name: {looked_up}"


# --- the package's shape: the root, its shims, the size of a module ---------------
#: Modules that keep a path of cockpit-for-pytorch 1.0.2 importable and only
#: re-export (a docstring, imports and ``__all__``); the one list of them.
SHIMS = ("cockpit.instruments", "cockpit.plotter", "cockpit.quantities.quantity")

#: At most this many modules at the package root besides the shims.
ROOT_MODULES_AT_MOST = 16


def _only_re_exports(path: Path) -> bool:
    """Whether a module holds nothing but a docstring, imports and ``__all__``."""
    for index, node in enumerate(ast.parse(path.read_text(encoding="utf-8")).body):
        docstring = index == 0 and isinstance(node, ast.Expr)
        docstring = docstring and isinstance(node.value, ast.Constant)
        names_all = isinstance(node, ast.Assign) and [
            getattr(target, "id", None) for target in node.targets
        ] == ["__all__"]
        if not (
            docstring or names_all or isinstance(node, (ast.Import, ast.ImportFrom))
        ):
            return False
    return True


def test_the_shims_only_re_export_and_are_all_listed():
    for name in SHIMS:
        assert _only_re_exports(MODULES[name]), f"{name} is a shim but holds code"
    unlisted = sorted(
        name
        for name, path in MODULES.items()
        if path.name != "__init__.py" and _only_re_exports(path) and name not in SHIMS
    )
    assert not unlisted, f"modules that only re-export, not in SHIMS: {unlisted}"


def test_the_root_holds_few_modules():
    root = sorted(
        name
        for name, path in MODULES.items()
        if path.parent == PACKAGE and path.name != "__init__.py" and name not in SHIMS
    )
    assert len(root) <= ROOT_MODULES_AT_MOST, (
        f"{len(root)} modules at cockpit/'s root (at most {ROOT_MODULES_AT_MOST} "
        f"besides the shims): {root}. Fix: move them into the subpackage that says "
        "what they do."
    )


def test_the_root_rule_counts_what_it_should():
    assert "cockpit.cockpit" in MODULES and MODULES["cockpit.cockpit"].parent == PACKAGE
    assert _only_re_exports(MODULES["cockpit.plotter"])
    assert not _only_re_exports(MODULES["cockpit.cockpit"])


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's "where things live" table has a row for each module."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = page[page.index("## Where things live") :]
    rows = {
        line.split("`")[1]: line.rsplit("|", 2)[-2].strip()
        for line in table.splitlines()
        if line.startswith("| `cockpit/")
    }
    paths = {path.relative_to(PACKAGE.parent).as_posix() for path in MODULES.values()}
    assert not sorted(paths - set(rows)), "modules missing from docs/architecture.md"
    assert not sorted(set(rows) - paths), "rows for modules that no longer exist"
    assert all(rows.values()), "a row says nothing about its module"


#: At most this many lines in a module, and in a class.
MODULE_LINES_AT_MOST, CLASS_LINES_AT_MOST = 800, 400


def test_no_module_or_class_too_big_to_read():
    too_big = []
    for name, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MODULE_LINES_AT_MOST:
            too_big.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > CLASS_LINES_AT_MOST:
                    too_big.append(f"{name}.{node.name}: {lines} lines")
    assert not too_big, (
        f"over {MODULE_LINES_AT_MOST} lines a module or {CLASS_LINES_AT_MOST} a "
        f"class: {too_big}. Fix: split it along its sections."
    )
