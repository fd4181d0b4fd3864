"""The step after a tracked step, part by part, each timed alone (issue 27 goal 3).

Run from the repository root (CPU, one thread; a few minutes per batch size)::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \
        python -m benchmarks.studies.after_step_floor --batches 8,32 \
        --out benchmarks/results/after_step_floor.json

Alpha needs, at the step ``t + 1`` after a tracked step ``t``, the loss and the
projections ``<g_n, d>`` of every sample's gradient onto the update ``d``. On
the GPT-2 of :mod:`benchmarks.real_models` one process times, interleaved round
by round (the order rotates; CPU time, medians over the plain step's median):

* ``plain``: zero_grad, forward, mean loss, backward, SGD step (not extended);
* ``loop``: the same on the ``backpack.extend``-ed model and loss, with the
  per-sample losses computed as the 1.0.2 loop does (``info``), no cockpit: what
  the loop costs before cockpit does anything;
* ``after``: cockpit's economy on every other step, the untracked step after a
  tracked one (Alpha's second half; the tracked step before it is not timed);
* ``after_ghost``: the same with the BackPACK engine left out, so that the ghost
  engine serves every tensor (LayerNorms included) and no BackPACK context is
  entered (design: no BackPACK hooks at ``t + 1``);
* ``after_noproj``: ``after`` with the projections replaced by nothing (a
  design that cannot be used, timed to show what the projections cost inside
  the step);

and, alone, on the results one tracked step kept:

* ``projections``: ``<g_n, d>`` of every tensor from the ghost engine's factors
  (layer inputs and output gradients) and BackPACK's dense results, ``d`` a
  random direction: the arithmetic floor of the ghost design;
* ``jvp``: the design "per-sample projections from a forward-mode JVP of the
  per-sample losses along ``d``" (``torch.func.jvp`` of ``functional_call``; one
  forward pass carrying the tangent, no per-sample gradient), which a step
  would pay on top of the plain step.

Writes the JSON record and a Markdown report next to it (``.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import driver, record
from benchmarks.driver import RESULTS
from benchmarks.measure import Interpreter, spawn

DEFAULT_OUT = RESULTS / "after_step_floor.json"
STEPS = ("plain", "loop", "after", "after_ghost", "after_noproj")
PARTS = ("projections", "jvp")


def _timed(fn) -> float:
    cpu = time.process_time()
    fn()
    return time.process_time() - cpu


def child(args) -> dict:
    """Time the steps and parts interleaved (see the module)."""
    import torch

    from benchmarks.real_models_speed import (
        Variant,
        every_other_step,
        projection_keeper,
        setup,
    )
    from cockpit import Cockpit
    from cockpit.engines import base as engines
    from cockpit.engines.backpack.engine import BackpackEngine
    from cockpit.quantities import alpha as alpha_module
    from cockpit.utils.configuration import configuration

    args.model = "gpt2"
    load, batches = setup(args)
    variants = {
        "plain": Variant("plain", load, batches),
        "loop": Variant("extended", load, batches),
        "after": Variant("after", load, batches),
    }
    loop = variants["loop"]

    def loop_step(variant=loop):
        x, y = batches(variant.steps)
        variant.optimizer.zero_grad()
        logits = load.logits(variant.model(x))
        loss = variant.loss_fn(logits, y)
        load.individual_loss_fn(logits, y)  # info["individual_losses"]
        loss.backward()
        variant.optimizer.step()
        variant.steps += 1

    saved = list(engines._REGISTRY)
    engines.unregister_engine(BackpackEngine)
    try:
        ghost = Variant("plain", load, batches)
        from backpack import extend

        ghost.kind = "after"
        ghost.model = extend(ghost.model)
        ghost.loss_fn = extend(copy.deepcopy(load.loss_fn))
        ghost.optimizer = torch.optim.SGD(ghost.model.parameters(), lr=0.01)
        ghost.cockpit = Cockpit(
            ghost.model.parameters(),
            quantities=configuration("economy", track_schedule=every_other_step),
        )
    finally:
        engines._REGISTRY[:] = saved
    variants["after_ghost"] = ghost
    noproj = Variant("after", load, batches)
    variants["after_noproj"] = noproj

    # --- the parts alone, on what one tracked step keeps --------------------------
    kept = {}

    keeper = Variant("plain", load, batches)
    from backpack import extend

    keeper.kind = "tracked"
    keeper.model = extend(keeper.model)
    keeper.loss_fn = extend(copy.deepcopy(load.loss_fn))
    keeper.cockpit = Cockpit(
        keeper.model.parameters(), [projection_keeper(kept, lambda s: True)]
    )
    keeper.optimizer = torch.optim.SGD(keeper.model.parameters(), lr=0.01)
    names = [n for n, _ in keeper.model.named_parameters()]
    primal = {n: p.detach().clone() for n, p in keeper.model.named_parameters()}
    keeper.step()  # the kept results are those of ``primal``, before the SGD step
    params = list(keeper.model.parameters())
    gen = torch.Generator().manual_seed(0)
    directions = [torch.randn(p.shape, generator=gen) * 1e-3 for p in params]

    def projections():
        for index, individual in kept.items():
            individual.project(directions[index])

    from torch.func import functional_call, jvp

    tangent = dict(zip(names, directions))
    x, y = batches(0)

    def per_sample_losses(theta):
        out = functional_call(keeper.model, theta, (x,))
        return load.individual_loss_fn(load.logits(out), y)

    def jvp_part():
        with torch.no_grad():
            jvp(per_sample_losses, (primal,), (tangent,))

    # exactness of the JVP design against the kept per-sample gradients
    with torch.no_grad():
        _, dots = jvp(per_sample_losses, (primal,), (tangent,))
    ghost_dots = sum(kept[i].project(directions[i]) for i in kept)
    jvp_error = float((dots - ghost_dots).abs().max() / ghost_dots.abs().max())

    # --- the projection-free "after" (timing only; its Alpha values are wrong) -----
    def no_projection(view, vector):
        return torch.zeros(view.batch_size, dtype=torch.float32)

    def run_noproj():
        original = alpha_module._per_sample_dots
        alpha_module._per_sample_dots = no_projection
        try:
            return _timed(noproj.step)
        finally:
            alpha_module._per_sample_dots = original

    timers = {
        "plain": lambda: _timed(variants["plain"].step),
        "loop": lambda: _timed(loop_step),
        "after": lambda: _timed(variants["after"].step),
        "after_ghost": lambda: _timed(ghost.step),
        "after_noproj": run_noproj,
        "projections": lambda: _timed(projections),
        "jvp": lambda: _timed(jvp_part),
    }
    pre = {"after": variants["after"], "after_ghost": ghost, "after_noproj": noproj}
    kinds = list(timers)
    times = {k: [] for k in kinds}
    for index in range(args.warmup + args.rounds):
        order = kinds[index % len(kinds) :] + kinds[: index % len(kinds)]
        for kind in order:
            if kind in pre:  # the tracked step before it, untimed
                pre[kind].step()
            seconds = timers[kind]()
            if index >= args.warmup:
                times[kind].append(seconds)
    base = statistics.median(times["plain"])
    coverage = {
        k: dict(v.cockpit.coverage().engines())
        for k, v in (("after", variants["after"]), ("after_ghost", ghost))
    }
    return {
        "times": times,
        "ratio_cpu": {k: statistics.median(v) / base for k, v in times.items()},
        "jvp_relative_error": jvp_error,
        "coverage": coverage,
        "parameters": load.parameters,
    }


def report(data: dict) -> str:
    """Markdown table of a record."""
    lines = [
        "# The step after a tracked step: its parts, each timed alone",
        "",
        driver.machine_line(data) + ".",
        "",
        "GPT-2 of `benchmarks/real_models.py` (11.5M parameters), one thread; "
        "median CPU time over the plain step's, interleaved in one process.",
        "",
    ]
    rows = []
    for key, result in data["results"].items():
        if "error" in result:
            rows.append((key, "all", f"error: {result['error']}", None))
            continue
        for kind, ratio in result["ratio_cpu"].items():
            seconds = statistics.median(result["times"][kind])
            rows.append((key, kind, f"{ratio:.3f}", f"{seconds:.3f}"))
        rows.append(
            (
                key,
                "jvp vs ghost projections, max relative difference",
                f"{result['jvp_relative_error']:.1e}",
                None,
            )
        )
    header = ("batch", "part", "ratio to plain", "median s")
    return "\n".join(lines + driver.table(header, rows)) + "\n"


def main(argv=None) -> None:
    """Measure (one child per batch size), or print the report of a record."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.after_step_floor", description=__doc__
    )
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a tiny GPT-2")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--table", type=Path, help="print the report of a record")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(report(json.loads(args.table.read_text())))
        return
    if args.child:
        from benchmarks.measure import emit

        with contextlib.redirect_stdout(sys.stderr):
            result = child(args)
        emit(result)
        return
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        child_argv = [
            "--child", "--batch", str(batch), "--rounds", str(args.rounds),
            "--warmup", str(args.warmup), "--threads", str(args.threads),
        ]  # fmt: skip
        if args.quick:
            child_argv.append("--quick")
        results[f"N={batch}"] = spawn(
            "benchmarks.studies.after_step_floor",
            child_argv,
            args.threads,
            args.timeout,
            Interpreter(),
        )
    data = {
        "machine": record.machine(),
        "results": results,
        "argv": ["python -m benchmarks.studies.after_step_floor", *argv],
    }
    driver.write_record(data, args.out, report)


if __name__ == "__main__":
    main()
