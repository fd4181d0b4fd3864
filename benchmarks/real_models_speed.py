"""Real models: cockpit's step cost against a plain step and a hand-written ``vmap``.

Run from the repository root (CPU, one thread; about an hour and a half on two
busy cores, most of it ``full`` and ``business`` on GPT-2 at batch 32)::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \
        python -m benchmarks.real_models_speed \
        --out benchmarks/results/real_models_speed.json
    python -m benchmarks.real_models_speed \
        --table benchmarks/results/real_models_speed.json
    python -m benchmarks.real_models_speed --quick --out /tmp/speed.json   # tests

Models (:mod:`benchmarks.real_models`): Hugging Face GPT-2 built from a config
(6 layers, width 384, 6 heads, vocabulary 2048, sequence 128, 11.5M parameters,
``attention="eager"``: math attention, which ``full``'s Hessian-vector products
need) and the ResNet-18 layout with BatchNorm in train mode (width 16, 32x32
images), its residual added out of place (``resnet18(inplace=False)``: BackPACK's
module hooks refuse the in-place ``+=`` of the extended model). Batches of 8 and
32, float32, one torch thread, SGD (lr 0.01).

**Time** (one child process per model and batch, :func:`child_time`). Each
variant trains its own copy of the model (same initial weights, same batches) and
the variants' steps are interleaved round by round (the order rotates), so that
the machine's load changes hit them alike; CPU time (``time.process_time``) and
wall time of every step are kept, the ratios are medians over the plain step's
median:

* ``plain``: zero_grad, forward, the mean loss, backward, SGD step of a model
  that is not extended;
* ``vmap``: what a user would write instead of cockpit for per-sample gradient
  norms and the gradient variance (:func:`vmap_step`): ``torch.func``'s
  ``vmap(grad(...))`` of one sample's loss through ``functional_call``, the
  per-sample squared norms, ``Variance = mean_i ||g_i||^2 - ||g||^2``, ``.grad =
  mean_i g_i`` and the SGD step. On the BatchNorm ResNet ``vmap`` runs each
  sample through BatchNorm alone (``torch.func.replace_all_batch_norm_modules_``,
  torch's documented way), so its numbers are those of another function: a cost
  reference only;
* ``vnt``: cockpit with Variance and NormTest every step; ``economy``,
  ``business``, ``full``: the configurations every step (the 1.0.2 loop: model
  and loss ``backpack.extend``-ed, per-sample losses passed in ``info``);
* ``tracked`` / ``after``: economy on every other step: the tracked step and the
  untracked step after it (Alpha's second half).

``business`` and ``full`` take tens of seconds per GPT-2 step: ``--heavy-rounds``
(default 2 at batch 8, 1 at batch 32) of them run after one untimed step each.

**Reference**: the same variants against this project's commit
``--reference-commit`` (6fc3e24), one child per variant (plain and that variant
interleaved), run from a ``git worktree`` of that commit in ``--reference-dir``
(made if missing) with ``PYTHONPATH`` pointing there, the benchmark code of this
checkout.

**Memory** (one child per model, batch and variant, :func:`child_memory`): peak
resident set size of a process that runs ``--memory-steps`` steps of one variant
only, minus that of a process running plain steps, beside the size of dense
per-sample gradients (``N x D x 4`` bytes).

Writes the JSON record ``--out`` and a Markdown report next to it (``.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import driver, record
from benchmarks.driver import RESULTS
from benchmarks.measure import REPO, Interpreter, peak_rss_mib, spawn

DEFAULT_OUT = RESULTS / "real_models_speed.json"
REFERENCE_COMMIT = "6fc3e24"
REFERENCE_DIR = Path("/tmp/ref6fc")
MODELS = ("gpt2", "resnet18")
BATCHES = (8, 32)
#: Variants timed every round.
LIGHT = ("vmap", "vnt", "economy", "tracked", "after")
#: Variants timed in few rounds (tens of seconds per GPT-2 step).
HEAVY = ("business", "full")
VARIANTS = ("plain", *LIGHT, *HEAVY)
#: Variants of the memory children (``extended``: plain steps of the extended
#: model, what ``backpack.extend`` alone costs; ``losses``: plain steps that also
#: compute the per-sample losses, as the 1.0.2 loop does for ``info``; ``probe``:
#: ``losses`` plus, at the first step, one backward pass of one sample's loss with
#: the graph retained, as the engines' sample-axis probes do once per shapes).
MEMORY = ("plain", "extended", "losses", "probe", "vmap", "vnt", "economy", "after")
#: How the memory children's allocator is set: ``live`` maps every allocation of
#: 64 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_=65536``), so that freed
#: memory leaves the process and the peak RSS is that of live memory; ``heap``
#: keeps the timing children's settings (``MALLOC_MMAP_MAX_=0``, no trimming), so
#: the peak RSS is the heap's high-water mark, fragmentation included.
ALLOCATORS = ("live", "heap")
#: Cockpit quantities of each cockpit variant.
COCKPIT = {
    "vnt": ("Variance", "NormTest"),
    "economy": "economy",
    "business": "business",
    "full": "full",
    "tracked": "economy",
    "after": "economy",
}
#: Goals of issue 27 (ratios).
GOALS = {
    "vnt / vmap": 1.0,
    "economy / vmap": 1.5,
    "after / plain": 1.2,
}


# ======================================================================================
# child side
# ======================================================================================
def workload(name: str, quick: bool):
    """The model of ``name`` (smaller with ``quick``)."""
    from benchmarks import real_models

    if name == "gpt2":
        if quick:
            return real_models.gpt2(layers=1, width=32, heads=2, vocab=64, length=16)
        return real_models.gpt2()
    if quick:
        return real_models.resnet18(width=4, inplace=False)
    return real_models.resnet18(inplace=False)


class Variant:
    """One kind of step on its own copy of the model.

    Args:
        kind: A name of :data:`VARIANTS`.
        load: The workload (its model is copied).
        batches: ``step -> (inputs, targets)``.
    """

    def __init__(self, kind: str, load, batches):
        import torch

        self.kind, self.load, self.batches = kind, load, batches
        self.model = copy.deepcopy(load.model)
        self.steps = 0
        self.cockpit = None
        if kind in COCKPIT or kind == "extended":
            from backpack import extend

            self.model = extend(self.model)
            self.loss_fn = extend(copy.deepcopy(load.loss_fn))
        if kind in COCKPIT:
            self.cockpit = make_cockpit(self.model, COCKPIT[kind], kind)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        if kind == "vmap":
            self.step_fn = vmap_step(self.model, load, self.optimizer)

    def step(self) -> None:
        """One training step of this variant."""
        x, y = self.batches(self.steps)
        if self.kind in ("plain", "extended", "losses", "probe"):
            self.plain_step(x, y)
        elif self.kind == "vmap":
            self.step_fn(x, y)
        else:
            self.cockpit_step(x, y)
        self.steps += 1

    def plain_step(self, x, y) -> None:
        """A plain step (``losses``, ``probe``: with the extra work they name)."""
        import torch

        loss_fn = self.loss_fn if self.kind == "extended" else self.load.loss_fn
        self.optimizer.zero_grad()
        logits = self.load.logits(self.model(x))
        loss = loss_fn(logits, y)
        if self.kind in ("losses", "probe"):
            losses = self.load.individual_loss_fn(logits, y)
            if self.kind == "probe" and self.steps == 0:
                params = [p for p in self.model.parameters() if p.requires_grad]
                torch.autograd.grad(
                    losses[0], params, retain_graph=True, allow_unused=True
                )
        loss.backward()
        self.optimizer.step()

    def cockpit_step(self, x, y) -> None:
        """The 1.0.2 loop: extended model and loss, per-sample losses in ``info``."""
        opt, cockpit, step = self.optimizer, self.cockpit, self.steps
        opt.zero_grad()
        logits = self.load.logits(self.model(x))
        loss = self.loss_fn(logits, y)
        losses = self.load.individual_loss_fn(logits, y)
        info = {
            "batch_size": x.shape[0],
            "individual_losses": losses,
            "loss": loss,
            "optimizer": opt,
        }
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()


def make_cockpit(model, spec, kind: str):
    """A cockpit with the quantities of ``spec`` (every step; ``tracked``/``after``:
    every other step)."""
    from cockpit import Cockpit
    from cockpit import quantities as Q
    from cockpit.utils.configuration import configuration

    if kind in ("tracked", "after"):
        schedule = every_other_step
    else:
        schedule = every_step
    if isinstance(spec, str):
        quantities = configuration(spec, track_schedule=schedule)
    else:
        quantities = [getattr(Q, name)(schedule) for name in spec]
    return Cockpit(model.parameters(), quantities=quantities)


def every_step(step: int) -> bool:
    """Track every step."""
    return True


def every_other_step(step: int) -> bool:
    """Track the even steps (the odd ones finish Alpha)."""
    return step % 2 == 0


def vmap_step(model, load, optimizer):
    """The hand-written alternative to cockpit (about twenty lines, see the module).

    Returns ``step(x, y)``: per-sample gradients with ``vmap(grad(...))``, their
    squared norms, the variance, ``.grad`` and the SGD step.
    """
    from torch.func import functional_call, grad, replace_all_batch_norm_modules_, vmap

    replace_all_batch_norm_modules_(model)  # BatchNorm: each sample alone
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    def sample_loss(theta, x, y):
        out = functional_call(model, (theta, buffers), (x.unsqueeze(0),))
        return load.loss_fn(load.logits(out), y.unsqueeze(0))

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))

    def step(x, y):
        optimizer.zero_grad()
        grads = per_sample({k: v.detach() for k, v in params.items()}, x, y)
        squared = 0
        for name, param in params.items():
            g = grads[name]
            squared = squared + g.flatten(1).square().sum(1)
            param.grad = g.mean(0)
        mean_squared = sum((p.grad**2).sum() for p in params.values())
        variance = squared.mean() - mean_squared
        optimizer.step()
        return squared, variance

    return step


def setup(args):
    """Threads, seed, the workload and its batches."""
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load = workload(args.model, args.quick)
    cache = {}

    def batches(step: int):
        key = step % 4  # four fixed batches, cycled
        if key not in cache:
            cache[key] = load.batch(args.batch, key)
        return cache[key]

    return load, batches


def _timed(fn) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def child_time(args) -> dict:
    """Time the variants interleaved, round by round (see the module)."""
    load, batches = setup(args)
    kinds = [k for k in args.variants.split(",") if k]
    variants = {k: Variant(k, load, batches) for k in kinds}
    light = [k for k in kinds if k not in HEAVY]
    heavy = [k for k in kinds if k in HEAVY]
    times = {k: {"cpu": [], "wall": []} for k in kinds}

    def run(kind, keep):
        variant = variants[kind]
        if kind == "after":  # the tracked step before it is not timed here
            variant.step()
        cpu, wall = _timed(variant.step)
        if keep:
            times[kind]["cpu"].append(cpu)
            times[kind]["wall"].append(wall)

    for index in range(args.warmup + args.rounds):
        order = light[index % len(light) :] + light[: index % len(light)]
        for kind in order:
            run(kind, index >= args.warmup)
    for kind in heavy:
        run(kind, False)
        for _ in range(args.heavy_rounds):
            if "plain" in variants:
                run("plain", True)
            run(kind, True)
    result = {"times": times, "parameters": load.parameters}
    if "plain" in times:
        for clock in ("cpu", "wall"):
            base = statistics.median(times["plain"][clock])
            result[f"ratio_{clock}"] = {
                k: statistics.median(v[clock]) / base for k, v in times.items()
            }
    result["coverage"] = {
        k: _engines(v.cockpit) for k, v in variants.items() if v.cockpit is not None
    }
    result["cockpit_file"] = _cockpit_file()
    return result


def _engines(cockpit) -> dict:
    coverage = cockpit.coverage()
    return dict(coverage.engines()) if coverage is not None else {}


def _cockpit_file() -> str:
    import cockpit

    return cockpit.__file__


def projection_keeper(kept: dict, schedule):
    """A quantity that keeps each parameter's per-sample results in ``kept``.

    ``kept[index]`` is what the engines leave for Alpha's projections at the
    next step (``ParamView.keep_individual``), so their parts can be timed alone.
    """
    from cockpit.needs import Need
    from cockpit.quantities.base import SingleStepQuantity
    from cockpit.quantities.batch_statistics import PerParameter

    class Keep(SingleStepQuantity):
        needs = frozenset({Need.PROJECTIONS})
        Accumulator = PerParameter

        def accumulate(self, global_step, view):
            kept[view.index] = view.keep_individual()

        def _compute(self, global_step, ctx):
            return 0.0

    return Keep(schedule)


def child_parts(args) -> dict:
    """Each part of the per-sample work alone, against the plain step (the floors).

    One tracked step keeps every parameter's per-sample results (as the engines
    hand them on); then, interleaved with plain steps, each part runs alone over all
    parameters: ``projections`` (``g_i . d`` onto a random direction ``d``: the step
    after a tracked step), ``norms`` (``||g_i||^2``: Variance and NormTest),
    ``form`` (every ``g_i`` formed, one parameter at a time) and ``histogram``
    (GradHist1d's counts of formed values).
    """
    import torch

    from cockpit import Cockpit
    from cockpit.quantities.grad_hist import histogram_1d, histogram_edges

    load, batches = setup(args)
    kept = {}

    plain = Variant("plain", load, batches)
    tracked = Variant("plain", load, batches)
    tracked.kind = "tracked"
    from backpack import extend

    tracked.model = extend(tracked.model)
    tracked.loss_fn = extend(copy.deepcopy(load.loss_fn))
    tracked.cockpit = Cockpit(
        tracked.model.parameters(), [projection_keeper(kept, every_step)]
    )
    tracked.optimizer = torch.optim.SGD(tracked.model.parameters(), lr=0.01)
    tracked.step()
    params = list(tracked.model.parameters())
    gen = torch.Generator().manual_seed(0)
    directions = [torch.randn(p.shape, generator=gen) for p in params]
    edges = histogram_edges(-2.0, 2.0, 100).to(torch.float32)
    formed = {}

    def projections():
        for i, individual in kept.items():
            individual.project(directions[i])

    def norms():
        for individual in kept.values():
            individual.batch_l2()

    def form():
        for individual in kept.values():
            for _ in individual.chunks(1 << 62):
                pass

    def histogram():
        for i, individual in kept.items():
            if i not in formed:
                formed[i] = next(iter(individual.chunks(1 << 62)))
            histogram_1d(formed[i], edges, (-2.0, 2.0))

    parts = {"projections": projections, "norms": norms, "form": form}
    parts["histogram"] = histogram
    histogram()  # forms the values once, outside the timing
    times = {k: [] for k in ("plain", *parts)}
    for index in range(args.warmup + args.rounds):
        for name, fn in (("plain", plain.step), *parts.items()):
            cpu, _ = _timed(fn)
            if index >= args.warmup:
                times[name].append(cpu)
    base = statistics.median(times["plain"])
    return {
        "times": times,
        "ratio_cpu": {k: statistics.median(v) / base for k, v in times.items()},
        "engines": _engines(tracked.cockpit),
        "parameters": load.parameters,
        "cockpit_file": _cockpit_file(),
    }


def child_memory(args) -> dict:
    """Peak RSS of a process running steps of one variant only."""
    load, batches = setup(args)
    variant = Variant(args.variants, load, batches)
    gc.collect()
    before = peak_rss_mib()
    steps = args.memory_steps + (1 if args.variants == "after" else 0)
    for _ in range(2 * steps if args.variants == "after" else steps):
        variant.step()
    return {
        "peak_rss_mib": peak_rss_mib(),
        "setup_rss_mib": before,
        "parameters": load.parameters,
        "cockpit_file": _cockpit_file(),
    }


def child_main(argv) -> None:
    """Measure in this process and print one result line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_models_speed")
    parser.add_argument("--child", choices=("time", "memory", "parts"), required=True)
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--variants", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--heavy-rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    from benchmarks.measure import emit

    with contextlib.redirect_stdout(sys.stderr):  # the library's prints
        child = {"time": child_time, "memory": child_memory, "parts": child_parts}
        result = child[args.child](args)
    emit(result)


# ======================================================================================
# parent side
# ======================================================================================
def _child(args, mode, model, batch, variants, interpreter, rounds=None):
    heavy = args.heavy_rounds if batch <= 8 else max(1, args.heavy_rounds - 1)
    argv = [
        "--child", mode, "--model", model, "--batch", str(batch),
        "--variants", variants, "--rounds", str(rounds or args.rounds),
        "--heavy-rounds", str(heavy), "--warmup", str(args.warmup),
        "--memory-steps", str(args.memory_steps), "--threads", str(args.threads),
    ]  # fmt: skip
    if args.quick:
        argv.append("--quick")
    started = time.perf_counter()
    result = spawn(
        "benchmarks.real_models_speed", argv, args.threads, args.timeout, interpreter
    )
    label = "reference" if interpreter.cwd != REPO else "ours"
    print(
        f"[{label}] {mode} {model} N={batch} {variants}: "
        f"{time.perf_counter() - started:.0f} s "
        + (result["error"] if "error" in result else ""),
        file=sys.stderr,
        flush=True,
    )
    return result


OURS = Interpreter()


@contextlib.contextmanager
def reference_interpreter(commit: str, folder: Path):
    """Children that import cockpit from a worktree of ``commit``.

    They start in a scratch folder holding only a link to this checkout's
    ``benchmarks``, with ``PYTHONPATH`` set to the worktree.
    """
    import tempfile

    if not (folder / "cockpit").exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(folder), commit],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
    with tempfile.TemporaryDirectory(prefix="cockpit-real-models-") as scratch:
        start = Path(scratch)
        (start / "benchmarks").symlink_to(REPO / "benchmarks", target_is_directory=True)
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = str(folder)
        try:
            yield Interpreter(cwd=start)
        finally:
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old


def measure_all(args) -> dict:
    """Every child of the run; ``{"ours": ..., "reference": ..., "memory": ...}``."""
    results = {"ours": {}, "reference": {}, "memory": {"ours": {}, "reference": {}}}
    models = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    parts = args.parts.split(",")
    for model in models if "time" in parts else ():
        for batch in batches:
            key = f"{model} N={batch}"
            results["ours"][key] = _child(
                args, "time", model, batch, ",".join(variants), OURS
            )
    if args.reference_commit:
        with reference_interpreter(args.reference_commit, args.reference_dir) as ref:
            for model in models:
                for batch in batches:
                    key = f"{model} N={batch}"
                    results["reference"][key] = {
                        v: _child(args, "time", model, batch, f"plain,{v}", ref)
                        for v in variants
                        if v != "plain"
                    }
            for model in models:
                for batch in batches:
                    key = f"{model} N={batch}"
                    results["memory"]["reference"][key] = {
                        v: _child(args, "memory", model, batch, v, ref)
                        for v in MEMORY
                        if v not in ("plain", "vmap")
                    }
    memory_batches = [int(b) for b in (args.memory_batches or args.batches).split(",")]
    for allocator in args.allocators.split(",") if "memory" in parts else ():
        with allocator_interpreter(allocator) as interpreter:
            for model in models:
                for batch in memory_batches:
                    key = f"{model} N={batch}"
                    results["memory"].setdefault(allocator, {})[key] = {
                        v: _child(args, "memory", model, batch, v, interpreter)
                        for v in args.memory_variants.split(",")
                    }
    results["memory"]["ours"] = results["memory"].get(
        "heap", results["memory"].get("live", {})
    )
    return results


@contextlib.contextmanager
def allocator_interpreter(allocator: str):
    """Memory children with the allocator settings ``allocator`` (see ALLOCATORS)."""
    if allocator == "heap":
        yield OURS
        return
    if allocator != "live":
        raise ValueError(f"--allocators: {allocator!r} is none of {ALLOCATORS}")
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        yield Interpreter(drop_env=("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"))
    finally:
        if old is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old


# --- the report -------------------------------------------------------------------
def _ratio(result: dict, kind: str, clock: str = "cpu") -> float | None:
    return result.get(f"ratio_{clock}", {}).get(kind)


def _fmt(value, digits=2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def report(data: dict) -> str:
    """Markdown tables of a record."""
    results = data["results"]
    lines = [
        "# Real models: cockpit against a plain step and `vmap(grad)`",
        "",
        driver.machine_line(data, backpack=True)
        + "".join(
            f"; memory: `{' '.join(run['argv'])}` (commit "
            f"{run['machine']['commit']}, {run['machine']['date']})"
            for run in data.get("memory_runs", ())
        )
        + ". Reference: commit "
        f"{data['settings'].get('reference_commit') or '–'} in the same run.",
        "",
        "Ratios: median CPU time of a step over the plain step's (one thread; wall "
        "time in parentheses). Reference: the same ratio measured against the "
        "reference commit (one child per variant).",
        "",
        "| model, batch | variant | ours | reference | median s (ours) |",
        "|---|---|---|---|---|",
    ]
    for key, ours in results["ours"].items():
        if "error" in ours:
            lines.append(f"| {key} | all | error: {ours['error']} | | |")
            continue
        reference = results["reference"].get(key, {})
        for kind in ours["times"]:
            ref = reference.get(kind, {})
            seconds = statistics.median(ours["times"][kind]["cpu"])
            ref_text = (
                f"error: {ref['error']}"
                if "error" in ref
                else f"{_fmt(_ratio(ref, kind))} ({_fmt(_ratio(ref, kind, 'wall'))})"
            )
            lines.append(
                f"| {key} | {kind} | {_fmt(_ratio(ours, kind))} "
                f"({_fmt(_ratio(ours, kind, 'wall'))}) | "
                f"{ref_text if ref else '–'} | {seconds:.3f} |"
            )
    lines += ["", "## Goals", "", "| model, batch | goal | value | verdict |"]
    lines.append("|---|---|---|---|")
    for key, ours in results["ours"].items():
        if "error" in ours:
            continue
        r = ours["ratio_cpu"]
        values = {
            "vnt / vmap": r.get("vnt", 0) / r["vmap"] if "vmap" in r else None,
            "economy / vmap": r.get("economy", 0) / r["vmap"] if "vmap" in r else None,
            "after / plain": r.get("after"),
        }
        for goal, limit in GOALS.items():
            value = values[goal]
            verdict = "–" if value is None else ("met" if value <= limit else "missed")
            lines.append(f"| {key} | {goal} <= {limit} | {_fmt(value)} | {verdict} |")
    lines += memory_report(results["memory"])
    coverage = {
        key: ours.get("coverage", {})
        for key, ours in results["ours"].items()
        if "error" not in ours
    }
    lines += ["", "## Who computes what (ours)", ""]
    for key, engines in coverage.items():
        for kind, counts in engines.items():
            lines.append(f"* {key} {kind}: {counts}")
    return "\n".join(lines) + "\n"


def memory_report(memory: dict) -> list[str]:
    """The memory table: extra peak RSS over plain steps, per allocator setting."""
    allocators = [a for a in ALLOCATORS if memory.get(a)]
    if not allocators:  # a record from before the allocator settings
        allocators, memory = ["heap"], {"heap": memory.get("ours", {})}
    lines = [
        "",
        "## Memory",
        "",
        "Peak RSS of a process running steps of one variant minus that of a "
        "process running plain steps (MiB); dense per-sample gradients: N x D x 4 "
        "bytes. live: allocations of 64 KiB or more mapped on their own "
        "(`MALLOC_MMAP_THRESHOLD_=65536`), so the peak is that of live memory; "
        "heap: the timing children's `MALLOC_MMAP_MAX_=0`, no trimming, so the "
        "peak is the heap's high-water mark, fragmentation included.",
        "",
        "| model, batch | variant | "
        + " | ".join(f"extra ({a})" for a in allocators)
        + " | dense N x D | "
        + " | ".join(f"{a} / dense" for a in allocators)
        + " |",
        "|---|---|" + "---|" * (2 * len(allocators) + 1),
    ]
    keys = list(dict.fromkeys(k for a in allocators for k in memory[a]))
    for key in keys:
        batch = int(key.split("N=")[1])
        kinds, extras, params = [], {}, 0
        for allocator in allocators:
            entries = memory[allocator].get(key, {})
            plain = entries.get("plain", {}).get("peak_rss_mib")
            params = params or entries.get("plain", {}).get("parameters", 0)
            for kind, entry in entries.items():
                if kind == "plain":
                    continue
                kinds.append(kind)
                peak = entry.get("peak_rss_mib")
                extras[allocator, kind] = (
                    None if plain is None or peak is None else peak - plain
                )
        dense = batch * params * 4 / 2**20
        for kind in dict.fromkeys(kinds):
            values = [extras.get((a, kind)) for a in allocators]
            shares = [None if v is None or not dense else v / dense for v in values]
            lines.append(
                f"| {key} | {kind} | "
                + " | ".join(_fmt(v, 0) for v in values)
                + f" | {dense:.0f} | "
                + " | ".join(_fmt(v) for v in shares)
                + " |"
            )
    return lines


def main(argv=None) -> None:
    """Parse the command line; measure, or print the tables of a record."""
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:
        child_main(argv)
        return
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.real_models_speed", description=__doc__
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--table", type=Path, help="print the report of a record")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default=",".join(str(b) for b in BATCHES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--heavy-rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument(
        "--memory-batches", default="", help="batches of the memory children"
    )
    parser.add_argument(
        "--memory-variants",
        default=",".join(MEMORY),
        help="variants of the memory children (plain first)",
    )
    parser.add_argument(
        "--allocators",
        default=",".join(ALLOCATORS),
        help="allocator settings of the memory children (live, heap)",
    )
    parser.add_argument(
        "--parts",
        default="time,memory",
        help="time, memory or both (two runs' records merge with --merge)",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="RECORD",
        help="write --out from a time-only record and memory-only records",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=4 * 3600)
    parser.add_argument("--reference-commit", default=REFERENCE_COMMIT)
    parser.add_argument("--reference-dir", type=Path, default=REFERENCE_DIR)
    parser.add_argument("--quick", action="store_true", help="tiny models")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(report(json.loads(args.table.read_text())))
        return
    if args.merge is not None:
        data = json.loads(args.merge[0].read_text())
        merged = {}
        for path in args.merge[1:]:
            memory = json.loads(path.read_text())
            for allocator in ALLOCATORS:
                for key, entries in (
                    memory["results"]["memory"].get(allocator, {}).items()
                ):
                    merged.setdefault(allocator, {}).setdefault(key, {}).update(entries)
            data.setdefault("memory_runs", []).append(
                {"machine": memory["machine"], "argv": memory["argv"]}
            )
        data["results"]["memory"] = merged
        args.out.write_text(json.dumps(data, indent=1))
        text = report(data)
        args.out.with_suffix(".md").write_text(text)
        print(text)
        return
    results = measure_all(args)
    data = {
        "machine": record.machine(),
        "results": results,
        "argv": ["python -m benchmarks.real_models_speed", *argv],
        "settings": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
        },
    }
    driver.write_record(data, args.out, report)


if __name__ == "__main__":
    main()
