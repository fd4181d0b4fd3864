"""BatchNorm's cost: exact ``economy`` on the ResNet-18 layout, and what bounds it.

Run from the repository root (about half an hour on two quiet CPU cores, most of it
the tracked BatchNorm steps and the backward passes per sample at batch 128, about a
minute each)::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \\
        python -m benchmarks.studies.batchnorm_cost \\
        --out benchmarks/results/batchnorm_cost.json
    python -m benchmarks.studies.batchnorm_cost \\
        --table benchmarks/results/batchnorm_cost.json
    python -m benchmarks.studies.batchnorm_cost --quick --out /tmp/bn.json  # smoke

Model: :func:`benchmarks.real_models.resnet18` (the ResNet-18 layout, width 16, 32x32
images, 10 classes, in-place residual; 20 BatchNorm layers in train mode, 2400
statistics), and its GroupNorm twin, which mixes no samples. Float32, SGD (lr 0.01).

**Time** (one child process per batch size, ``--threads`` 1 torch thread, CPU time
``time.process_time`` and wall time). Each round runs every variant once, in an order
that rotates from round to round; ``--warmup`` untimed rounds first. Medians; a ratio
is a variant's median over the median plain step *of the same model*:

* ``plain``: zero_grad, forward, mean cross-entropy, backward, SGD step (not
  ``backpack.extend``-ed);
* ``economy``: the same step on an extended twin inside ``with cockpit(step,
  info=...)`` of a cockpit holding ``economy``, every step tracked (the 1.0.2 loop,
  :func:`benchmarks.measure.tracked_step`);
* ``forward``: the per-sample losses with their graph (what the next one includes);
* ``backward per sample``: forward plus cockpit's batched backward pass per sample
  (``cockpit.engines.autograd.per_sample_gradients``, the cockpit's chunk and
  budget) on exactly the parameters the ``economy`` cockpit routes to it (those
  before a train-mode BatchNorm). Design B, cockpit's method.

``floor`` = 1 + ``backward per sample`` - ``forward`` (ratios): the plain step
plus the backward passes per sample beyond their forward pass, what a tracked
BatchNorm step costs with this method if nothing else (quantities, BackPACK, the
histogram of ``N x D`` values) cost anything.

**The other designs** (:mod:`benchmarks.studies.batchnorm_designs`), timed once per
batch size after the rounds on the plain BatchNorm model:

* design A (statistics Jacobian): the recording forward pass, the frozen
  ``vmap(grad)`` pass (``u_i`` and ``c_ik``), the ``S`` rows of the statistics'
  Jacobian and the ``N x S x D`` product, both scaled from ``--rows`` rows per
  BatchNorm call;
* design C: ``g_i . v`` for all samples by one forward-mode pass;
* the rank of the correction ``g_i - u_i`` (what the statistics add to the
  per-sample gradients with the statistics held), per parameter tensor of three
  layers, from its singular values: a correction of rank below ``N`` would let fewer
  than ``N`` shared vectors (and backward passes) form it; it has rank ``N``.

**Memory** (``--memory``): the peak RSS of a child running ``--warmup`` +
``--memory-steps`` steps of one kind only (plain, economy, backward per sample; and
the GroupNorm twin's plain and economy), minus the plain child's at the same batch.
Children run one at a time after the timing children, with ``MALLOC_MMAP_MAX_=0``
and ``MALLOC_TRIM_THRESHOLD_=1099511627776`` (freed memory is never handed back, so
the peak RSS is the peak heap).

Writes the JSON record ``--out`` (machine, commit, settings, every timing) and prints
Markdown tables (``--table JSON`` prints them again from a record).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import driver, measure
from benchmarks.driver import RESULTS

DEFAULT_OUT = RESULTS / "batchnorm_cost.json"
#: Issue 27, goal 5: economy / plain of the BatchNorm ResNet at batch 128.
GOAL_BATCH, GOAL = 128, 10.0
VARIANTS = (
    "plain",
    "economy",
    "forward",
    "backward per sample",
    "plain (GroupNorm)",
    "economy (GroupNorm)",
)
MEMORY_KINDS = VARIANTS[:2] + VARIANTS[3:]
#: The layers whose correction's rank is shown (first, middle, last before a BN).
RANK_LAYERS = ("stem.0.weight", "blocks.4.conv1.weight", "blocks.7.conv2.weight")


# ======================================================================================
# child side
# ======================================================================================
class Case:
    """The BatchNorm ResNet and its GroupNorm twin: plain and tracked, fixed batches."""

    def __init__(self, config: dict, kinds=VARIANTS):
        import torch
        from backpack import extend

        from benchmarks import internals, real_models

        self.torch, self.internals = torch, internals
        n, width = config["batch"], config["width"]
        self.steps = {}
        self.batches = [real_models.resnet18(width).batch(n, seed) for seed in range(4)]
        self.counter = 0
        loss_fn = extend(torch.nn.CrossEntropyLoss())
        for norm in ("batch", "group"):
            suffix = "" if norm == "batch" else " (GroupNorm)"
            plain = real_models.resnet18(width, norm).model
            opt = torch.optim.SGD(plain.parameters(), lr=0.01)
            self.steps["plain" + suffix] = self._plain(plain, opt)
            if norm == "batch":
                self.plain_model = plain
            if "economy" + suffix in kinds:
                tracked = extend(real_models.resnet18(width, norm).model)
                params = list(tracked.parameters())
                cockpit = internals.make_cockpit(
                    params, internals.make_quantities("economy")
                )
                opt = torch.optim.SGD(params, lr=0.01)
                self.steps["economy" + suffix] = self._tracked(
                    cockpit, tracked, loss_fn, opt
                )
        self.width, self.loss_fn = width, loss_fn
        self.routed: list | None = None
        self.steps["forward"] = self._forward
        self.steps["backward per sample"] = self._per_sample

    def batch(self):
        x, y = self.batches[self.counter % len(self.batches)]
        self.counter += 1
        return x, y

    def _plain(self, model, opt):
        F = self.torch.nn.functional

        def step():
            x, y = self.batch()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()

        return step

    def _tracked(self, cockpit, model, loss_fn, opt):
        state = {"step": 0}

        def step():
            measure.tracked_step(
                cockpit, model, loss_fn, opt, self.batch(), state["step"]
            )
            state["step"] += 1

        return step

    def route(self) -> list[int]:
        """Positions of the parameters an economy cockpit routes to autograd.

        Found once, from a tracked step of a twin on two samples of the first batch
        (the routes depend on the model, not the batch size).
        """
        if self.routed is None:
            from backpack import extend

            from benchmarks import real_models

            twin = extend(real_models.resnet18(self.width).model)
            params = list(twin.parameters())
            cockpit = self.internals.make_cockpit(
                params, self.internals.make_quantities("economy")
            )
            opt = self.torch.optim.SGD(params, lr=0.01)
            x, y = self.batches[0]
            measure.tracked_step(cockpit, twin, self.loss_fn, opt, (x[:2], y[:2]), 0)
            routes = self.internals.engine_routes(cockpit)
            cockpit.close()
            self.routed = [i for i, r in enumerate(routes) if r == "autograd"]
        return self.routed

    def losses(self, batch=None):
        x, y = self.batch() if batch is None else batch
        F = self.torch.nn.functional
        return F.cross_entropy(self.plain_model(x), y, reduction="none")

    def _forward(self):
        self.losses()

    def _per_sample(self, batch=None):
        params = list(self.plain_model.parameters())
        wanted = [params[i] for i in self.route()]
        settings = self.internals.engine_settings()
        return self.internals.engine_per_sample_gradients(
            self.losses(batch), wanted, settings["chunk"], settings["max_elements"]
        )


def _rounds(case: Case, names, rounds: int, warmup: int) -> dict:
    """Every variant once per round, the order rotating; CPU and wall seconds."""
    cpu = {name: [] for name in names}
    wall = {name: [] for name in names}
    for r in range(warmup + rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            gc.collect()
            c0, w0 = time.process_time(), time.perf_counter()
            case.steps[name]()
            c1, w1 = time.process_time(), time.perf_counter()
            if r >= warmup:
                cpu[name].append(c1 - c0)
                wall[name].append(w1 - w0)
            if os.environ.get("BATCHNORM_COST_TRACE"):
                print(
                    f"  {name}: {c1 - c0:.2f} s, peak RSS "
                    f"{measure.peak_rss_mib():.0f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
    return {"cpu_s": cpu, "wall_s": wall}


def _ratios(times: dict) -> dict:
    out = {}
    for clock in ("cpu", "wall"):
        median = {k: statistics.median(v) for k, v in times[f"{clock}_s"].items()}
        plain = {
            k: median["plain (GroupNorm)" if "GroupNorm" in k else "plain"]
            for k in median
        }
        out[clock] = {k: median[k] / plain[k] for k in median}
        out[f"{clock}_median_s"] = median
    return out


def _rank(correction) -> dict:
    """Singular values of an ``[N, D]`` correction: its rank at 1e-4 of the largest."""
    import torch

    s = torch.linalg.svdvals(correction.double().flatten(1))
    top = float(s[0])
    return {
        "shape": list(correction.flatten(1).shape),
        "rank": int((s > 1e-4 * top).sum()),
        "smallest_over_largest": float(s[-1]) / top if top > 0 else 0.0,
    }


def child_time(config: dict) -> dict:
    """Rounds of every variant, then the other designs' parts and the rank."""
    case = Case(config)
    case.route()
    times = _rounds(case, list(VARIANTS), config["rounds"], config["warmup"])
    result = {"times": times, "ratios": _ratios(times), "routed": len(case.routed)}
    result["peak_rss_mib"] = {"rounds": measure.peak_rss_mib()}
    try:  # a failure here keeps the timings
        result.update(_designs(case, config, result["ratios"]["cpu_median_s"]["plain"]))
    except Exception as error:  # noqa: BLE001 - reported in the record
        result["designs_error"] = repr(error)
    result["peak_rss_mib"]["designs"] = measure.peak_rss_mib()
    return result


def _designs(case: Case, config: dict, plain_cpu: float) -> dict:
    """Design A's parts, the rank of the correction, design C's pass."""
    import torch

    from benchmarks.studies import batchnorm_designs as designs

    result = {}
    model = case.plain_model
    names = [n for n, _ in model.named_parameters()]
    routed = [names[i] for i in case.routed]
    result["routed_numel"] = sum(model.get_parameter(n).numel() for n in routed)
    batch = case.batches[0]
    # design B on one batch (kept for the rank), design A's parts on the same
    exact = dict(zip(routed, case._per_sample(batch), strict=True))
    loss = torch.nn.CrossEntropyLoss(reduction="none")
    parts = designs.stats_jacobian_parts(
        model, batch[0], batch[1], loss, routed, rows=config["rows"]
    )
    u = parts.pop("u")
    result["design_a"] = parts | {
        "ratios": {
            k: parts[k] / plain_cpu
            for k in ("forward", "frozen", "jacobian", "product")
        }
    }
    result["rank"] = {
        n: _rank(exact[n] - u[n]) for n in RANK_LAYERS if n in exact and n in u
    }
    del exact, u
    vector = [torch.randn_like(model.get_parameter(n)) for n in routed]
    seconds = []
    for _ in range(2):  # the first pays torch.func's start
        start = time.process_time()
        designs.inner_products(model, batch[0], batch[1], loss, routed, vector)
        seconds.append(time.process_time() - start)
    result["design_c"] = {"jvp_s": seconds[-1], "ratio": seconds[-1] / plain_cpu}
    return result


def child_memory(config: dict) -> dict:
    """Peak RSS of a process running steps of one kind only."""
    kind = config["kind"]
    case = Case(config, kinds=(kind,))
    if kind == "backward per sample":
        case.route()
    gc.collect()
    before = measure.peak_rss_mib()
    for _ in range(config["warmup"] + config["memory_steps"]):
        case.steps[kind]()
    return {"peak_rss_mib": measure.peak_rss_mib(), "setup_rss_mib": before}


CHILDREN = {"time": child_time, "memory": child_memory}


def child_main(config: dict) -> None:
    """Measure what ``config`` says in this fresh process; print one result line."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")  # the cockpit's cost warning, every child
    torch.set_num_threads(config["threads"])
    torch.manual_seed(0)
    result = CHILDREN[config["mode"]](config)
    result["threads"] = torch.get_num_threads()
    measure.emit(result)


# ======================================================================================
# parent side
# ======================================================================================
def _child_config(args, **extra) -> dict:
    return {
        "width": args.width,
        "threads": args.threads,
        "warmup": args.warmup,
        "rows": args.rows,
        "memory_steps": args.memory_steps,
        **extra,
    }


def spawn(config: dict, args) -> dict:
    """Run one child; its result or ``{"error": ...}``."""
    return measure.spawn(
        "benchmarks.studies.batchnorm_cost",
        ["--child", json.dumps(config)],
        args.threads,
        args.timeout,
    )


def measure_all(args) -> dict:
    """Every child, one at a time; the results so far go to ``--out``.partial."""
    saved = {"time": {}, "memory": {}}
    partial = Path(str(args.out) + ".partial")
    for n, rounds in zip(args.batches, args.rounds, strict=True):
        print(f"[batch {n}] timing ({rounds} rounds)", file=sys.stderr, flush=True)
        result = spawn(_child_config(args, mode="time", batch=n, rounds=rounds), args)
        saved["time"][str(n)] = result
        partial.write_text(json.dumps(saved) + "\n")
        if "error" in result:
            print(f"  error: {result['error']}", file=sys.stderr)
        else:
            ratios = result["ratios"]["cpu"]
            print(
                f"  economy {ratios['economy']:.1f}x, GroupNorm "
                f"{ratios['economy (GroupNorm)']:.1f}x, backward per sample "
                f"{ratios['backward per sample']:.1f}x",
                file=sys.stderr,
            )
    for n in args.memory_batches:
        saved["memory"][str(n)] = {}
        for kind in MEMORY_KINDS:
            config = _child_config(args, mode="memory", batch=n, kind=kind)
            result = spawn(config, args)
            saved["memory"][str(n)][kind] = result
            partial.write_text(json.dumps(saved) + "\n")
            said = result.get("peak_rss_mib", result.get("error"))
            print(f"[batch {n}] memory {kind}: {said}", file=sys.stderr, flush=True)
    return saved


def floor(ratios: dict) -> float:
    """The plain step + the backward passes per sample beyond their forward (ratios).

    What a tracked step costs with cockpit's method if nothing but the plain step
    and those passes cost anything (no quantity, no BackPACK, no histogram).
    """
    return 1.0 + ratios["backward per sample"] - ratios["forward"]


# --------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------
def _x(value) -> str:
    return "-" if value is None else f"{value:.1f}x"


def table(saved: dict) -> str:
    m = saved["machine"]
    lines = [
        f"BatchNorm's cost on the ResNet-18 layout (width {saved['settings']['width']})"
        f", commit {m['commit']}, {m['cpu']}, {saved['settings']['threads']} thread(s),"
        f" load {m['load_before']} before / {m['load']} after; "
        "CPU-time ratios to the plain step of the same model (wall in brackets).",
        "",
        "| batch | plain ms | economy | GroupNorm twin: economy | forward | backward "
        "per sample | floor (plain + per-sample passes - forward) | goal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, result in saved["time"].items():
        if "error" in result:
            lines.append(f"| {n} | error: {result['error'][:80]} |")
            continue
        cpu, wall = result["ratios"]["cpu"], result["ratios"]["wall"]
        plain_ms = 1000 * result["ratios"]["cpu_median_s"]["plain"]
        goal = ""
        if int(n) == GOAL_BATCH:
            goal = f"<= {GOAL:.0f}x: {'met' if cpu['economy'] <= GOAL else 'missed'}"
        lines.append(
            f"| {n} | {plain_ms:.0f} | {_x(cpu['economy'])} ({_x(wall['economy'])})"
            f" | {_x(cpu['economy (GroupNorm)'])} | {_x(cpu['forward'])} | "
            f"{_x(cpu['backward per sample'])} ({_x(wall['backward per sample'])}) "
            f"| {_x(floor(cpu))} | {goal} |"
        )
    lines += [
        "",
        "Design A (statistics Jacobian), parts as ratios to the plain step "
        "(rows scaled from the timed ones); design C (one forward-mode pass for "
        "g_i . v); rank of the correction g_i - u_i:",
        "",
        "| batch | S rows (timed) | forward | frozen vmap(grad) | Jacobian rows | "
        "N x S x D product | design A total | design C: g_i . v | rank of "
        "g_i - u_i (N x D, three layers) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, result in saved["time"].items():
        if "error" in result or "design_a" not in result:
            lines.append(f"| {n} | {result.get('designs_error', 'no result')} |")
            continue
        a = result["design_a"]
        r = a["ratios"]
        ranks = ", ".join(
            f"{v['rank']} of {v['shape'][0]} "
            f"(s_min/s_max {v['smallest_over_largest']:.0e})"
            for v in result["rank"].values()
        )
        lines.append(
            f"| {n} | {a['rows']} ({a['rows_timed']}) | {_x(r['forward'])} | "
            f"{_x(r['frozen'])} | {_x(r['jacobian'])} | {_x(r['product'])} | "
            f"{_x(sum(r.values()))} | {_x(result['design_c']['ratio'])} | {ranks} |"
        )
    if saved.get("memory"):
        lines += [
            "",
            "Peak RSS (MiB) of a child running one kind of step; extra = minus the "
            "plain child's of the same model and batch:",
            "",
            "| batch | " + " | ".join(MEMORY_KINDS) + " | economy extra | "
            "backward per sample extra | GroupNorm economy extra |",
            "| --- " * (len(MEMORY_KINDS) + 4) + "|",
        ]
        for n, kinds in saved["memory"].items():
            peak = {k: kinds[k].get("peak_rss_mib") for k in MEMORY_KINDS}
            cells = ["-" if v is None else f"{v:.0f}" for v in peak.values()]

            def extra(kind, plain, peak=peak):
                if peak[kind] is None or peak[plain] is None:
                    return "-"
                return f"{peak[kind] - peak[plain]:.0f}"

            lines.append(
                f"| {n} | " + " | ".join(cells) + f" | {extra('economy', 'plain')} | "
                f"{extra('backward per sample', 'plain')} | "
                f"{extra('economy (GroupNorm)', 'plain (GroupNorm)')} |"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def parse(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.batchnorm_cost",
        description="BatchNorm ResNet: economy against plain steps, and its floor.",
    )
    parser.add_argument("--batches", type=_ints, default=None, metavar="N,M")
    parser.add_argument(
        "--rounds", type=_ints, default=None, help="timed rounds per batch size"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument(
        "--rows", type=int, default=8, help="Jacobian rows timed per BatchNorm call"
    )
    parser.add_argument("--memory-batches", type=_ints, default=None, metavar="N,M")
    parser.add_argument("--memory-steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds/child")
    parser.add_argument("--quick", action="store_true", help="tiny settings (tests)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON record")
    parser.add_argument("--table", metavar="JSON", help="print a record's tables")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "batches": ([4, 8], [8, 32, 128]),
        "width": (4, 16),
        "memory_batches": ([4], [8, 32, 128]),
    }
    driver.fill_defaults(args, quick, defaults)
    if args.rounds is None:
        args.rounds = [1 if quick else {8: 7, 32: 5}.get(n, 3) for n in args.batches]
    if len(args.rounds) != len(args.batches):
        parser.error("--rounds needs one number per batch size in --batches")
    return args


SETTINGS = (
    "batches",
    "rounds",
    "warmup",
    "width",
    "rows",
    "memory_batches",
    "memory_steps",
    "threads",
)


def main(argv=None) -> int:
    """Measure (or print a record's tables, or run one child); see the module."""
    return driver.main(
        argv,
        parse,
        child_main=child_main,
        render=table,
        measure_all=measure_all,
        settings=lambda args: {k: getattr(args, k) for k in SETTINGS},
        sections=("time", "memory"),
    )


if __name__ == "__main__":
    sys.exit(main())
