"""Micro-benchmark of the gradient-histogram kernels on the benchmark problems.

Run from the repository root (a few seconds per problem)::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \\
        python -m benchmarks.studies.kernels

One tracked backward pass of each problem (batch 128) hands every parameter's
per-sample gradients to a capturing quantity, as the cockpit hands them to
GradHist1d (``Linear`` weights as their two factors, the rest as tensors). Then, on
one torch thread, process CPU time, interleaved (A B C A B C ...), median of
``--repeats`` rounds, the same values are counted by:

* ``blocks + histogram_1d``: every value materialised block by block and binned
  exactly (:func:`histogram_1d`), the reference the quantity must equal;
* ``blocks + torch.histc``: the same blocks, clamped and counted by ``torch.histc``
  (approximate at the edges; the speed to beat);
* ``GradHist1d now``: the quantity's own counting (``GradHist1d._count``):
  ``Linear`` weights by :func:`histogram_1d_outer` (searches on sorted inputs),
  every other parameter block by block as before;
* 2-D: ``GradHist2d._count`` against ``torch.histogramdd`` on the same pairs.

With ``--baseline`` another version of ``grad_hist.py`` (e.g. the one before this
work: ``git show 70e00a7:cockpit/quantities/grad_hist.py > /tmp/base.py``) has its
GradHist1d/2d timed in the same rounds. The exact variants must agree bit for
bit (checked; the 2-D counts against every block counted on its own by
:func:`histogram_2d`). Times are also given in units
of one plain training step (zero_grad, forward, backward, SGD step of the model
without BackPACK), measured the same way. Results go to
``benchmarks/results/kernels.md``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from benchmarks.problems import make
from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.needs import Need
from cockpit.param_view import ParamResults, ParamView
from cockpit.quantities import histogram_kernels as kernels
from cockpit.quantities.base import SingleStepQuantity

BINS, RANGE = 100, (-2.0, 2.0)  # GradHist1d's defaults
BINS_2D, RANGE_2D = (40, 50), ((-1.0, 1.0), (-2.0, 2.0))  # GradHist2d's defaults
#: Everything after this line of the results file is kept when it is rewritten.
HAND_WRITTEN = "<!-- hand-written below: kept by benchmarks.studies.kernels -->"
BLOCK = 1 << 18  # ParamView.individual_gradient_chunks' default block size


class _Capture(SingleStepQuantity):
    """Keeps what the engine hands over for each parameter (benchmark only)."""

    needs = frozenset({Need.INDIVIDUAL_GRADIENTS})

    def __init__(self):
        super().__init__(lambda step: True)
        self.captured = []

    def accumulate(self, global_step, view):
        individual = view._results.individual  # the object behind the view
        self.captured.append((view.param.detach().clone(), individual))

    def _compute(self, global_step, ctx):
        return None


def capture(bench):
    """Per-parameter ``(param, IndividualGradients)`` of one tracked step."""
    quantity = _Capture()
    cockpit = Cockpit(bench.extended.parameters(), [quantity])
    x, y = bench.batch(0)
    loss = bench.loss_fn(bench.extended(x), y)
    with cockpit(0, info={"loss": loss, "batch_size": x.shape[0]}):
        loss.backward()
    return quantity.captured


def blocks_histogram_1d(captured, edges):
    total = torch.zeros(BINS, dtype=torch.int64)
    for _, individual in captured:
        for block in individual.chunks(BLOCK):
            total += kernels.histogram_1d(block, edges, RANGE)
    return total


def blocks_histc(captured, edges):
    total = torch.zeros(BINS)
    for _, individual in captured:
        for block in individual.chunks(BLOCK):
            total += torch.histc(block.clamp_(*RANGE), BINS, *RANGE)
    return total


def views(captured):
    return [
        ParamView(param, index, ParamResults(individual=individual))
        for index, (param, individual) in enumerate(captured)
    ]


def grad_hist_now(quantity, captured):
    """The quantity's own per-parameter counting (``_count``), summed."""
    quantity.begin_step(0)
    total = None
    for view in views(captured):
        counts = quantity._count(0, view)
        total = counts if total is None else total + counts
    return total


def blocks_histogram_2d(captured, xedges, yedges):
    """Every block counted on its own by :func:`histogram_2d` (exact reference)."""
    clamps = tuple(kernels.inner_clamp(*r, b) for r, b in zip(RANGE_2D, BINS_2D))
    total = torch.zeros(BINS_2D, dtype=torch.int64)
    for param, individual in captured:
        y = param.flatten()
        for block in individual.chunks(BLOCK):
            x = block.flatten(start_dim=1)
            total += kernels.histogram_2d(x, y, xedges, yedges, RANGE_2D, clamps)
    return total


def blocks_histogramdd(captured, xedges, yedges):
    total = torch.zeros(BINS_2D)
    flat_range = [v for r in RANGE_2D for v in r]
    for param, individual in captured:
        y = param.flatten()
        for block in individual.chunks(BLOCK):
            x = block.flatten(start_dim=1)
            pairs = torch.stack([x, y.expand_as(x)], dim=-1).reshape(-1, 2)
            total += torch.histogramdd(pairs, list(BINS_2D), range=flat_range).hist
    return total


def plain_step_seconds(bench, repeats):
    model = bench.plain
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for step in range(repeats + 2):
        x, y = bench.batch(step)
        start = time.process_time()
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        times.append(time.process_time() - start)
    return statistics.median(times[2:])


def load_baseline(path, name="baseline_grad_hist"):
    """Load another version of a module (``grad_hist.py``, ``hess_max_ev.py``, e.g.
    from an older commit) under ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def measure(name, repeats, baseline=None):
    bench = make(name)
    captured = capture(bench)
    values = sum(ind.batch_size * p.numel() for p, ind in captured)
    dtype = captured[0][0].dtype
    edges = kernels.histogram_edges(*RANGE, BINS).to(dtype)
    xedges = kernels.histogram_edges(*RANGE_2D[0], BINS_2D[0]).to(dtype)
    yedges = kernels.histogram_edges(*RANGE_2D[1], BINS_2D[1]).to(dtype)
    hist_1d = Q.GradHist1d(lambda step: True, bins=BINS, range=RANGE)
    hist_2d = Q.GradHist2d(lambda step: True, bins=BINS_2D, range=RANGE_2D)
    variants = {
        "1-D: blocks + histogram_1d": lambda: blocks_histogram_1d(captured, edges),
        "1-D: blocks + torch.histc": lambda: blocks_histc(captured, edges),
        "1-D: GradHist1d now": lambda: grad_hist_now(hist_1d, captured),
        "2-D: GradHist2d now": lambda: grad_hist_now(hist_2d, captured).reshape(
            BINS_2D
        ),
        "2-D: blocks + torch.histogramdd": lambda: blocks_histogramdd(
            captured, xedges, yedges
        ),
    }
    if baseline is not None:
        old_1d = baseline.GradHist1d(lambda step: True, bins=BINS, range=RANGE)
        old_2d = baseline.GradHist2d(lambda step: True, bins=BINS_2D, range=RANGE_2D)
        variants["1-D: GradHist1d baseline"] = lambda: grad_hist_now(old_1d, captured)
        variants["2-D: GradHist2d baseline"] = lambda: grad_hist_now(
            old_2d, captured
        ).reshape(BINS_2D)
    results = {key: fn() for key, fn in variants.items()}  # warm-up, and the counts
    before = results["1-D: blocks + histogram_1d"]
    assert torch.equal(results["1-D: GradHist1d now"], before), "not exact"
    assert int(before.sum()) == values
    if baseline is not None:
        assert torch.equal(results["1-D: GradHist1d baseline"], before)
        assert torch.equal(
            results["2-D: GradHist2d baseline"], results["2-D: GradHist2d now"]
        )
    reference_2d = blocks_histogram_2d(captured, xedges, yedges)
    assert torch.equal(results["2-D: GradHist2d now"], reference_2d), "not exact"
    times = {key: [] for key in variants}
    for _ in range(repeats):
        for key, fn in variants.items():
            start = time.process_time()
            fn()
            times[key].append(time.process_time() - start)
    plain = plain_step_seconds(bench, max(repeats, 9))
    medians = {key: statistics.median(t) for key, t in times.items()}
    return values, plain, medians


def hvp_counts(
    name, steps, lr=0.01, momentum=0.0, seed=0, warm_vectors=(3, 1), ref_rtol=1e-5
):
    """Hessian-vector products per tracked step of HessMaxEV over a short SGD run.

    Every step tracked, the problem's cycled random batches. One HessMaxEV per entry
    of ``warm_vectors`` (how many of the previous step's Ritz vectors its warm start
    is built from) and a cold, tight reference solve (Lanczos from two random starts
    to ``ref_rtol``, the larger magnitude kept) run in the same cockpit on the same
    graph, so they see identical Hessians.

    Returns:
        ``{label: {"products": [...], "values": [...], "errors": [...]}}`` with the
        relative error of each value against the reference, and ``"reference"``.
    """
    bench = make(name, seed=seed, need_plain=False)
    solvers = {}
    for k in warm_vectors:
        quantity = Q.HessMaxEV(lambda step: True, key=f"warm start from {k}")
        quantity.WARM_START_VECTORS = k
        solvers[f"warm start from {k}"] = quantity
    references = [
        Q.HessMaxEV(
            lambda step: True,
            rtol=ref_rtol,
            atol=0.0,
            max_iter=150,
            warm_start=False,
            seed=1000 + i,
            key=f"reference {i}",
        )
        for i in range(2)
    ]
    params = list(bench.extended.parameters())
    cockpit = Cockpit(params, [*solvers.values(), *references])
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum)
    out = {label: {"products": [], "values": [], "errors": []} for label in solvers}
    out["reference"] = []
    for step in range(steps):
        x, y = bench.batch(step)
        optimizer.zero_grad()
        loss = bench.loss_fn(bench.extended(x), y)
        with warnings.catch_warnings():
            # a reference at its budget; the warm starts' warnings stay visible
            warnings.filterwarnings("ignore", message=r"reference \d at step")
            with cockpit(step, info={"loss": loss, "batch_size": x.shape[0]}):
                loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
        record = cockpit.get_output()[step]
        exact = max((record[q.key] for q in references), key=abs)
        out["reference"].append(exact)
        for label, quantity in solvers.items():
            value = record[quantity.key]
            out[label]["products"].append(quantity.last_num_hvps)
            out[label]["values"].append(value)
            out[label]["errors"].append(abs(value - exact) / abs(exact))
    return out


def small_block_times(sizes=(64, 2048, 8192, 32768), repeats=31):
    """Median seconds of counting one block: edge search vs general path.

    100 bins on (-2, 2), values ``N(0, scale**2)`` for a narrow and a wide spread,
    one NaN in 97; both paths must give the same counts. ``histogram_1d`` takes the
    search up to ``kernels.SEARCH_AT_MOST`` values, the general path beyond.
    """
    edges = kernels.histogram_edges(-2.0, 2.0, 100)
    paths = {
        "search": kernels._counts_by_search,
        "general": kernels._counts_by_position,
    }
    rows = []
    for n in sizes:
        for scale in (1e-3, 0.3):
            x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * scale
            x[::97] = float("nan")
            times = {path: [] for path in paths}
            counts = {}
            for _ in range(repeats):
                for path, count in paths.items():
                    start = time.perf_counter()
                    counts[path] = count(x, edges, (-2.0, 2.0))
                    times[path].append(time.perf_counter() - start)
            assert torch.equal(counts["search"], counts["general"]), (n, scale)
            rows.append(
                (
                    n,
                    scale,
                    *(statistics.median(times[p]) for p in ("search", "general")),
                )
            )
    return rows


def lanczos_times(name, products=20, repeats=7, baseline=None):
    """Lanczos' own work at a problem's size, against one Hessian-vector product.

    ``lanczos_max_ev`` runs ``products`` steps (rtol 0: no early stop) on a diagonal
    operator with as many entries as the problem has parameters (a clustered top
    spectrum); its products cost next to nothing, so the time is the method's own:
    re-orthogonalisation, the tridiagonal eigenproblems, the basis. Timed in
    interleaved rounds with the same run of ``baseline.lanczos_max_ev`` (another
    ``hess_max_ev.py``, e.g. ``git show <commit>:cockpit/quantities/hess_max_ev.py``)
    if given, and with one Hessian-vector product of the problem's plain model on
    a batch (after a ``create_graph`` backward pass), for scale.

    Returns:
        ``{"parameters", "hvp", "now", "baseline"}``: median seconds (``baseline``
        ``None`` without one).
    """
    from cockpit.quantities.hess_max_ev import lanczos_max_ev

    bench = make(name, need_extended=False)
    params = list(bench.plain.parameters())
    x, y = bench.batch(0)
    loss = torch.nn.functional.cross_entropy(bench.plain(x), y)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    probe = [torch.randn_like(p) for p in params]
    dim = sum(p.numel() for p in params)
    generator = torch.Generator().manual_seed(0)
    spectrum = torch.rand(dim, generator=generator) ** 3
    spectrum[:4] = torch.tensor([1.0, 0.999, 0.99, 0.98])
    v0 = torch.randn(dim, generator=generator)
    options = {"rtol": 0.0, "atol": 1e-30, "max_iter": products}
    runs = {
        "hvp": lambda: torch.autograd.grad(grads, params, probe, retain_graph=True),
        "now": lambda: lanczos_max_ev(lambda v: spectrum * v, v0, **options),
    }
    if baseline is not None:
        runs["baseline"] = lambda: baseline.lanczos_max_ev(
            lambda v: spectrum * v, v0, **options
        )
    times = {key: [] for key in runs}
    for _ in range(repeats + 1):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - start)
    out = {key: statistics.median(t[1:]) for key, t in times.items()}
    return {"parameters": dim, "baseline": None, **out}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", default="mlp,3c3d")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--baseline",
        help="path of another grad_hist.py whose GradHist1d/2d are timed alongside, "
        "e.g. from `git show <commit>:cockpit/quantities/grad_hist.py`",
    )
    parser.add_argument("--out", default="benchmarks/results/kernels.md")
    parser.add_argument(
        "--hvp-steps",
        type=int,
        default=0,
        help="instead: count HessMaxEV's Hessian-vector products over this many "
        "SGD steps of each problem, with errors against a tight reference "
        "(printed, not written)",
    )
    parser.add_argument("--hvp-lr", type=float, default=0.01)
    parser.add_argument("--hvp-momentum", type=float, default=0.0)
    parser.add_argument("--hvp-seeds", default="0", help="problem seeds, e.g. 0,1")
    parser.add_argument(
        "--hvp-ref-rtol", type=float, default=1e-5, help="reference solve's rtol"
    )
    parser.add_argument(
        "--small-blocks",
        action="store_true",
        help="instead: time histogram_1d on small blocks, edge search vs general "
        "path (printed, not written)",
    )
    parser.add_argument(
        "--lanczos",
        type=int,
        default=0,
        help="instead: time Lanczos' own work over this many products at each "
        "problem's size, against one Hessian-vector product (printed, not written)",
    )
    parser.add_argument(
        "--lanczos-baseline",
        help="path of another hess_max_ev.py whose lanczos_max_ev is timed alongside",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.lanczos:
        baseline = None
        if args.lanczos_baseline:
            baseline = load_baseline(args.lanczos_baseline, "baseline_hess_max_ev")
        print(
            f"| problem | parameters | one HVP (ms) | Lanczos, {args.lanczos} products "
            "(ms) | in HVPs | baseline (ms) | in HVPs |\n| --- | ---: | ---: | ---: "
            "| ---: | ---: | ---: |"
        )
        for name in args.problems.split(","):
            t = lanczos_times(name, args.lanczos, args.repeats, baseline)
            base = t["baseline"]
            tail = (
                "– | –" if base is None else f"{base * 1e3:.1f} | {base / t['hvp']:.1f}"
            )
            print(
                f"| {name} | {t['parameters']:,} | {t['hvp'] * 1e3:.2f} | "
                f"{t['now'] * 1e3:.1f} | {t['now'] / t['hvp']:.1f} | {tail} |",
                flush=True,
            )
        return
    if args.small_blocks:
        print(
            f"| values | spread | search (us) | general (us) | "
            f"SEARCH_AT_MOST = {kernels.SEARCH_AT_MOST} |\n| ---: | ---: | ---: "
            "| ---: | --- |"
        )
        for n, scale, search, general in small_block_times():
            chosen = "search" if n <= kernels.SEARCH_AT_MOST else "general"
            print(
                f"| {n} | {scale} | {search * 1e6:.0f} | {general * 1e6:.0f} | "
                f"{chosen} |"
            )
        return
    if args.hvp_steps:
        print(
            "| problem | seed | warm start | products per step | mean | min-max | "
            "max error | steps off by > 1e-3 |\n| --- | ---: | --- | --- | ---: | "
            "--- | ---: | ---: |",
            flush=True,
        )
        for name in args.problems.split(","):
            for seed in [int(s) for s in args.hvp_seeds.split(",")]:
                out = hvp_counts(
                    name,
                    args.hvp_steps,
                    args.hvp_lr,
                    args.hvp_momentum,
                    seed,
                    ref_rtol=args.hvp_ref_rtol,
                )
                for label, row in out.items():
                    if label == "reference":
                        continue
                    spent, errors = row["products"], row["errors"]
                    print(
                        f"| {name} | {seed} | {label} | {', '.join(map(str, spent))} "
                        f"| {statistics.mean(spent):.1f} | {min(spent)}-{max(spent)} "
                        f"| {max(errors):.1e} | {sum(e > 1e-3 for e in errors)} |",
                        flush=True,
                    )
        return
    lines = [
        "# Gradient-histogram kernels",
        "",
        "Made by `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 "
        "python -m benchmarks.studies.kernels` (see its docstring). One torch thread, "
        f"process CPU time, median of {args.repeats} interleaved rounds; batch 128; "
        f"torch {torch.__version__}; {platform.platform()}; "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}.",
        "",
    ]
    for name in args.problems.split(","):
        baseline = load_baseline(args.baseline) if args.baseline else None
        values, plain, medians = measure(name, args.repeats, baseline)
        torch_kernel = {
            "1-D": medians["1-D: blocks + torch.histc"],
            "2-D": medians["2-D: blocks + torch.histogramdd"],
        }
        lines += [
            f"## {name}",
            "",
            f"{values / 1e6:.1f} M values; plain step {plain * 1e3:.1f} ms. Speed-up "
            "= other time / this time (> 1: this is faster); the torch kernel is "
            "torch.histc (1-D) or torch.histogramdd (2-D) on the same blocks.",
            "",
            "| kernel | ms | plain steps | speed-up vs torch kernel | "
            "speed-up vs baseline |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for key, seconds in medians.items():
            dim = key[:3]
            old = medians.get(f"{dim}: GradHist{dim[0]}d baseline")
            versus = f"{old / seconds:.2f}x" if old else "-"
            lines.append(
                f"| {key} | {seconds * 1e3:.1f} | {seconds / plain:.1f} | "
                f"{torch_kernel[dim] / seconds:.2f}x | {versus} |"
            )
        lines.append("")
        print("\n".join(lines[-len(medians) - 6 :]), flush=True)
    out = Path(args.out)
    kept = ""
    if out.exists() and HAND_WRITTEN in out.read_text():
        kept = out.read_text()[out.read_text().index(HAND_WRITTEN) :]
    out.write_text("\n".join(lines) + ("\n" + kept if kept else ""))


if __name__ == "__main__":
    main()
