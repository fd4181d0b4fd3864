"""The one benchmarks module that imports cockpit.

Every other module in ``benchmarks/`` reaches cockpit through these functions, so a
name that moves in the core is fixed here alone (``tests/test_benchmarks.py`` checks
that no other benchmarks module imports cockpit). Imports happen inside the functions:
rendering a report needs neither torch nor cockpit, and ``--reference`` children run
the same functions against cockpit-for-pytorch 1.0.2, which has the public names used
by the children (``Cockpit``, ``cockpit.quantities``, ``cockpit.utils.schedules`` and
``cockpit.utils.configuration``) but not the internal ones.

Names imported: ``cockpit.Cockpit``, ``cockpit.quantities`` (its ``__all__`` and
classes), ``cockpit.quantities.base.Quantity``, ``cockpit.utils.schedules.linear``,
``cockpit.utils.configuration.configuration`` and
``cockpit.utils.configuration.quantities_cls_for_configuration``,
``cockpit.engines.backpack.rules.PerSampleGradients``. Used on a cockpit:
``create_graph(step)``,
``__call__(step, info=...)``, ``get_output()``, ``history.memory_bytes()``,
``logpath`` and ``close()``. ``benchmarks.long_runs`` also uses
``cockpit.history.History``, ``cockpit.log.stream.LogStream`` and
``cockpit.CockpitPlotter``. ``benchmarks.any_model`` also uses the autograd engine
(``cockpit.engines.autograd.per_sample_gradients``, with
``Cockpit.PER_SAMPLE_CHUNK`` and ``Cockpit.PER_SAMPLE_MAX_ELEMENTS``), a cockpit's
``coverage()`` (``params[i].route.engine``) and the example
``examples/char_transformer.py`` (which imports cockpit).

``python -m benchmarks.internals [DISTRIBUTION]`` prints :func:`describe` as JSON
(``--reference`` asks its interpreter this way which cockpit it imports).
"""

from __future__ import annotations

#: The ready-made configurations, cheapest first.
CONFIGURATIONS = ("economy", "business", "full")


def every_step():
    """Return the schedule that tracks every step."""
    from cockpit.utils.schedules import linear

    return linear(1)


def schedule_every(interval: int):
    """Return the schedule that tracks every ``interval``-th step."""
    from cockpit.utils.schedules import linear

    return linear(interval)


def make_quantities(spec: str) -> list:
    """Instantiate a configuration label's quantities, or one quantity class by name.

    Every quantity tracks every step.
    """
    from cockpit import quantities

    if spec in CONFIGURATIONS:
        from cockpit.utils.configuration import configuration

        return list(configuration(spec, track_schedule=every_step()))
    return [getattr(quantities, spec)(every_step())]


def configuration_classes(label: str) -> list[type]:
    """Return the quantity classes of a configuration label."""
    from cockpit.utils.configuration import quantities_cls_for_configuration

    return list(quantities_cls_for_configuration(label))


def configuration_members(label: str) -> list[str]:
    """Return the class names of a configuration's quantities ([] if unavailable)."""
    try:
        return [cls.__name__ for cls in configuration_classes(label)]
    except Exception:  # noqa: BLE001 - configurations missing: nothing to break down
        return []


def make_cockpit(params, quantities: list, **kwargs):
    """Return ``cockpit.Cockpit(params, quantities, **kwargs)``."""
    from cockpit import Cockpit

    return Cockpit(params, quantities=quantities, **kwargs)


def recorded_keys(cockpit) -> list[str]:
    """Return the quantity keys the cockpit recorded (not its bookkeeping keys)."""
    keys = set()
    for entries in cockpit.get_output().values():
        keys.update(entries)
    keys -= {"learning_rates", "missing", "nonfinite"}
    return sorted(keys)


def history_bytes(cockpit) -> int:
    """Return the size of the cockpit's in-memory history in bytes."""
    return cockpit.history.memory_bytes()


def new_history():
    """Return an empty ``cockpit.history.History`` (``benchmarks.long_runs``)."""
    from cockpit.history import History

    return History()


def open_stream(logpath: str):
    """Return ``cockpit.log.stream.LogStream(logpath)``: ``write({step: values})``."""
    from cockpit.log.stream import LogStream

    return LogStream(logpath)


def make_plotter(**kwargs):
    """Return ``cockpit.CockpitPlotter(**kwargs)``."""
    from cockpit import CockpitPlotter

    return CockpitPlotter(**kwargs)


def per_sample_gradients():
    """Return cockpit's own per-sample gradient extension (a building block)."""
    from cockpit.engines.backpack.rules import PerSampleGradients

    return PerSampleGradients()


def engine_settings() -> dict[str, int]:
    """The autograd engine's chunk and group budget, as a cockpit uses them."""
    from cockpit import Cockpit

    return {
        "chunk": Cockpit.PER_SAMPLE_CHUNK,
        "max_elements": Cockpit.PER_SAMPLE_MAX_ELEMENTS,
    }


def make_replayer(params):
    """cockpit's replay engine watching the modules of ``params`` (as a cockpit)."""
    from cockpit.engines.replay import Replayer
    from cockpit.engines.routing import Router

    replayer = Replayer(Router(params).chain)
    replayer.watch_chains(params)
    return replayer


def engine_per_sample_gradients(
    losses, params, chunk: int, max_elements: int, replayer=None
):
    """cockpit's engines: ``[d losses[i] / d p for p in params]``, stacked.

    What a cockpit does for the parameters it routes to autograd: the replay engine
    (``cockpit.engines.replay``, if ``replayer`` is given and watched the forward
    pass) where a watched module covers a parameter, then one batched backward pass
    per sample (``cockpit.engines.autograd.per_sample_gradients``) for the rest, in
    parameter order.
    """
    from cockpit.engines.autograd import per_sample_gradients

    found = {}
    if replayer is not None:
        found.update(replayer.per_sample_gradients(losses, params, max_elements))
        replayer.forget()
    rest = [i for i in range(len(params)) if i not in found]
    wanted = [params[i] for i in rest]
    for position, grads in per_sample_gradients(losses, wanted, chunk, max_elements):
        found[rest[position]] = grads
    return [found[i] for i in range(len(params))]


def hutchinson_estimate(losses, params, probes: int, generator):
    """cockpit's Hutchinson estimate: ``(diagonals, [probes, P] traces, SE of sum)``.

    ``cockpit.engines.autograd.hutchinson_diagonals`` with its per-probe traces, and
    the standard error of the summed trace (``sum_error``), as HessTrace reads them.
    """
    from cockpit.engines.autograd import hutchinson_diagonals, sum_error

    diagonals, _, table = hutchinson_diagonals(
        losses, params, probes, generator, return_traces=True
    )
    return diagonals, table, sum_error(table)


def engine_routes(cockpit) -> list[str]:
    """Per parameter, the engine that computed its per-sample results last step."""
    return [row.route.engine for row in cockpit.coverage().params]


def load_example(name: str):
    """Import ``examples/<name>.py`` as a module (the folder is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def discover_quantities() -> tuple[list[str], list[str]]:
    """Return the exported quantity classes, and notes on those left out."""
    from cockpit import quantities
    from cockpit.quantities.base import Quantity

    names, notes = [], []
    for name in sorted(getattr(quantities, "__all__", [])):
        cls = getattr(quantities, name, None)
        if not (isinstance(cls, type) and issubclass(cls, Quantity)):
            continue
        if cls.__module__ == Quantity.__module__ or name.startswith("_"):
            continue
        names.append(name)
    return names, notes


def discover_configurations() -> tuple[list[str], list[str]]:
    """Return the configuration labels that exist, and notes on missing ones."""
    try:
        from cockpit.utils.configuration import configuration
    except Exception as error:  # noqa: BLE001 - a half-written module, say
        return [], [f"configurations skipped: cannot import them ({error!r})"]
    found, notes = [], []
    for label in CONFIGURATIONS:
        try:
            configuration(label)
        except Exception as error:  # noqa: BLE001 - report whatever breaks
            notes.append(f"configuration {label!r} skipped: {error!r}")
        else:
            found.append(label)
    return found, notes


def describe(distribution: str | None = None) -> dict:
    """Say which cockpit this interpreter imports and which quantities it exports.

    Args:
        distribution: Also give this installed distribution's version.
    """
    from importlib import metadata

    import cockpit
    from cockpit import quantities

    found = {
        "file": cockpit.__file__,
        "quantities": sorted(getattr(quantities, "__all__", [])),
    }
    if distribution:
        found["version"] = metadata.version(distribution)
    return found


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(describe(*sys.argv[1:2])))
