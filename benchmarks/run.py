"""Overhead benchmark: how much slower and larger a training step gets with cockpit.

Run from the repository root::

    python -m benchmarks.run            # everything; writes benchmarks/results.md
    python -m benchmarks.run --quick --problems mlp --configs economy,GradNorm

Every configuration (a ready-made cockpit configuration such as ``economy``, a single
quantity such as ``HessTrace``, or a building block such as ``block:BatchGrad``) is
measured in a fresh child process, twice:

* **time**: the child trains a plain model (zero_grad, forward, backward, SGD step; not
  extended by BackPACK) and an extended copy with the cockpit tracking at *every* step,
  alternating plain and tracked steps (and their order) to cancel drift. The overhead
  is the median tracked-step time over the median plain-step time.
* **memory**: the child runs only tracked steps; its peak resident set size
  (``getrusage``) is compared with that of a child that runs only plain steps.

Children run with ``MALLOC_MMAP_MAX_=0`` and a huge ``MALLOC_TRIM_THRESHOLD_`` (freed
memory is never given back to the system, so the peak RSS is the peak heap) and with
two torch threads. Building blocks (BackPACK extensions, ``torch.func`` per-sample
gradients, a Hessian-vector product) are timed in units of one plain forward+backward
pass of the same model; they are the floor under any quantity that needs them.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results.md"
#: Hand-written analysis appended to the results (floors of the missed targets).
DEFAULT_ANALYSIS = REPO / "benchmarks" / "analysis.md"
CONFIGURATIONS = ("economy", "business", "full")
BLOCKS = (
    "BatchGrad",
    "PerSampleGradients",
    "BatchL2Grad",
    "SumGradSquared",
    "DiagHessian",
    "DiagGGNExact",
    "DiagGGNMC",
    "vmap_grad",
    "HVP",
)
CHILD_ENV = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "1099511627776",
    "OMP_NUM_THREADS": "2",
    "MKL_NUM_THREADS": "2",
}
RESULT_PREFIX = "BENCHMARK-RESULT "

#: cockpit-for-pytorch 1.0.2 on a 2-core CPU (issue 6): step-time ratios and peak
#: RSS extra in MiB.
REFERENCE = {
    ("mlp", "economy"): (87, 155),
    ("mlp", "business"): (50, None),
    ("mlp", "full"): (147, 510),
    ("3c3d", "economy"): (6.5, 880),
    ("3c3d", "business"): (15, None),
    ("3c3d", "full"): (101, 3500),
}
#: Targets of issue 6 (ratios; memory: at most half the reference's extra RSS).
TARGET = {
    ("mlp", "economy"): 20,
    ("mlp", "business"): 25,
    ("mlp", "full"): 40,
    ("3c3d", "economy"): 2.5,
    ("3c3d", "business"): 9,
    ("3c3d", "full"): 15,
}
#: Single quantities on the CNN, reference ratios (issue 6).
REFERENCE_SINGLE_3C3D = {
    "HessMaxEV": "~50",
    "GradHist2d": "~50",
    "TICDiag": "12-17",
    "TICTrace": "12-17",
    "HessTrace": "9-13",
    "GradHist1d": "7-8",
    "NormTest": "3-4",
    "InnerTest": "3-4",
    "OrthoTest": "3-4",
}
#: Building blocks on the CNN, reference (plain forward+backward units).
REFERENCE_BLOCKS_3C3D = {
    "BatchGrad": "2.5",
    "BatchL2Grad": "2.3",
    "vmap_grad": "2.0",
    "DiagHessian": "6.9",
    "DiagGGNMC": "2.7",
    "HVP": "~1.5",
}


# ======================================================================================
# child side
# ======================================================================================
def _quantities_for(spec: str):
    """Instantiate the quantities of a configuration label or a single class name."""
    from cockpit import quantities as Q
    from cockpit.utils.schedules import linear

    every_step = linear(1)
    if spec in CONFIGURATIONS:
        from cockpit.utils.configuration import configuration

        return list(configuration(spec, track_schedule=every_step))
    return [getattr(Q, spec)(every_step)]


_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def _sync_step(fn) -> float:
    start = _clock()
    fn()
    return _clock() - start


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class _Trainer:
    """Plain and tracked training steps on one benchmark problem."""

    def __init__(self, problem, spec, need_plain=True, need_tracked=True):
        import torch

        from benchmarks.problems import make

        self.torch = torch
        self.bench = make(problem, need_plain=need_plain, need_extended=need_tracked)
        self.plain_step_count = 0
        self.tracked_step_count = 0
        if need_plain:
            self.plain_opt = torch.optim.SGD(self.bench.plain.parameters(), lr=0.01)
        if need_tracked:
            from cockpit import Cockpit

            params = list(self.bench.extended.parameters())
            self.tracked_opt = torch.optim.SGD(params, lr=0.01)
            self.cockpit = Cockpit(params, quantities=_quantities_for(spec))

    def plain_step(self) -> None:
        """Zero grads, forward, backward, SGD step on the plain model."""
        F = self.torch.nn.functional
        x, y = self.bench.batch(self.plain_step_count)
        self.plain_step_count += 1
        self.plain_opt.zero_grad()
        F.cross_entropy(self.bench.plain(x), y).backward()
        self.plain_opt.step()

    def tracked_step(self) -> None:
        """The same step on the extended model, tracked by the cockpit."""
        F = self.torch.nn.functional
        step = self.tracked_step_count
        x, y = self.bench.batch(step)
        self.tracked_step_count += 1
        self.tracked_opt.zero_grad()
        outputs = self.bench.extended(x)
        loss = self.bench.loss_fn(outputs, y)
        losses = F.cross_entropy(outputs, y, reduction="none")
        info = {
            "batch_size": x.shape[0],
            "individual_losses": losses,
            "loss": loss,
            "optimizer": self.tracked_opt,
        }
        with self.cockpit(step, info=info):
            loss.backward(create_graph=self.cockpit.create_graph(step))
        self.tracked_opt.step()

    def recorded_keys(self) -> list[str]:
        """Return every history key the cockpit recorded (proof that it worked)."""
        keys = set()
        for entries in self.cockpit.get_output().values():
            keys.update(entries)
        return sorted(keys)


def _pairs(args):
    """Yield pair indices: warm-up pairs, then timed pairs until enough are done.

    At least ``args.repeats`` timed pairs run, and more (up to 50 times as many)
    while the timed pairs took less than ``args.min_time`` seconds in all, so that
    sub-millisecond steps get enough samples for a stable median.
    """
    started = None
    i = 0
    while True:
        if i == args.warmup:
            started = time.perf_counter()
        if i >= args.warmup + args.repeats:
            spent = time.perf_counter() - started
            if spent >= args.min_time or i >= args.warmup + 50 * args.repeats:
                return
        yield i
        i += 1


def _child_time(args) -> dict:
    trainer = _Trainer(args.problem, args.spec)
    plain, tracked = [], []
    for i in _pairs(args):
        order = ("plain", "tracked") if i % 2 == 0 else ("tracked", "plain")
        for kind in order:
            if kind == "plain":
                t = _sync_step(trainer.plain_step)
                (plain if i >= args.warmup else []).append(t)
            else:
                t = _sync_step(trainer.tracked_step)
                (tracked if i >= args.warmup else []).append(t)
    return {
        "plain_s": plain,
        "tracked_s": tracked,
        "ratio": statistics.median(tracked) / statistics.median(plain),
        "keys": trainer.recorded_keys(),
        "num_params": trainer.bench.num_params(),
    }


def _child_memory(args) -> dict:
    plain_only = args.spec == "plain"
    trainer = _Trainer(
        args.problem, args.spec, need_plain=plain_only, need_tracked=not plain_only
    )
    gc.collect()
    before = _peak_rss_mib()
    step = trainer.plain_step if plain_only else trainer.tracked_step
    for _ in range(args.warmup + args.steps):
        step()
    return {"peak_rss_mib": _peak_rss_mib(), "setup_rss_mib": before}


def _block_runner(problem: str, block: str):
    """Return ``(baseline, block_fn[, extra_fn])`` callables for a building block.

    ``baseline`` is a plain forward+backward pass (no optimizer step) on the plain
    model; the block runs the same pass with one BackPACK extension on the extended
    copy, or per-sample gradients by ``torch.func``, or (``HVP``) a ``create_graph``
    backward whose extra Hessian-vector product is timed separately.
    """
    import torch
    from backpack import backpack, extensions
    from backpack.core.derivatives.convnd import weight_jac_t_save_memory

    from benchmarks.problems import make

    bench = make(problem)
    plain_params = list(bench.plain.parameters())
    ext_params = list(bench.extended.parameters())
    F = torch.nn.functional
    counter = {"plain": 0, "block": 0}

    def baseline():
        x, y = bench.batch(counter["plain"])
        counter["plain"] += 1
        for p in plain_params:
            p.grad = None
        F.cross_entropy(bench.plain(x), y).backward()

    if block == "vmap_grad":
        from torch.func import functional_call, grad, vmap

        names = [n for n, _ in bench.plain.named_parameters()]

        def sample_loss(params, x, y):
            out = functional_call(bench.plain, dict(zip(names, params)), (x[None],))
            return F.cross_entropy(out, y[None])

        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))

        def run_block():
            x, y = bench.batch(counter["block"])
            counter["block"] += 1
            grads = per_sample(tuple(p.detach() for p in plain_params), x, y)
            del grads

        return baseline, run_block, None

    if block == "HVP":
        state = {}

        def run_block():
            x, y = bench.batch(counter["block"])
            counter["block"] += 1
            loss = F.cross_entropy(bench.plain(x), y)
            state["grads"] = torch.autograd.grad(loss, plain_params, create_graph=True)
            state["v"] = [torch.randn_like(p) for p in plain_params]

        def run_hvp():
            hv = torch.autograd.grad(state["grads"], plain_params, state["v"])
            del hv
            state.clear()

        return baseline, run_block, run_hvp

    if block == "PerSampleGradients":
        from cockpit.extensions import PerSampleGradients

        extension = PerSampleGradients()
    else:
        extension = getattr(extensions, block)()

    def run_block():
        x, y = bench.batch(counter["block"])
        counter["block"] += 1
        for p in ext_params:
            p.grad = None
        loss = bench.loss_fn(bench.extended(x), y)
        with weight_jac_t_save_memory(True), backpack(extension):
            loss.backward()
        for p in ext_params:
            if hasattr(p, extension.savefield):
                delattr(p, extension.savefield)

    return baseline, run_block, None


def _child_block(args) -> dict:
    baseline, run_block, run_extra = _block_runner(args.problem, args.spec[6:])
    plain, block, extra = [], [], []
    for i in _pairs(args):
        keep = i >= args.warmup
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            if which == 0:
                t = _sync_step(baseline)
                (plain if keep else []).append(t)
            else:
                t = _sync_step(run_block)
                (block if keep else []).append(t)
                if run_extra is not None:
                    t = _sync_step(run_extra)
                    (extra if keep else []).append(t)
    med = statistics.median(plain)
    result = {
        "plain_s": plain,
        "tracked_s": block,
        "ratio": statistics.median(block) / med,
    }
    if extra:
        result["extra_s"] = extra
        result["extra_ratio"] = statistics.median(extra) / med
    return result


def child_main(args) -> None:
    """Measure one configuration and print its result as one JSON line."""
    import torch

    global _clock
    _clock = _CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.mode == "time":
        result = (
            _child_block(args) if args.spec.startswith("block:") else _child_time(args)
        )
    else:
        result = _child_memory(args)
    result["threads"] = torch.get_num_threads()
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")


# ======================================================================================
# parent side
# ======================================================================================
def _run_child(problem, spec, mode, args) -> dict:
    command = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--child",
        "--problem",
        problem,
        "--spec",
        spec,
        "--mode",
        mode,
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.memory_steps),
        "--threads",
        str(args.threads),
        "--min-time",
        str(args.min_time),
        "--clock",
        args.clock,
    ]
    env = dict(os.environ, **CHILD_ENV)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            command,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    elapsed = time.perf_counter() - started
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
            result["wall_s"] = elapsed
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": " / ".join(tail) or f"exit status {proc.returncode}"}


def discover_quantities() -> tuple[list[str], list[str]]:
    """Return the exported quantity classes, and notes on those left out."""
    from cockpit import quantities as Q
    from cockpit.quantities.base import Quantity

    names, notes = [], []
    for name in sorted(getattr(Q, "__all__", [])):
        cls = getattr(Q, name, None)
        if not (isinstance(cls, type) and issubclass(cls, Quantity)):
            continue
        if cls.__module__ == "cockpit.quantities.base" or name.startswith("_"):
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


def plan(args) -> tuple[list[str], list[str]]:
    """Turn ``--configs`` into a list of specs to measure, plus notes."""
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    configs, config_notes = discover_configurations()
    quantities, quantity_notes = discover_quantities()
    specs, notes = [], config_notes + quantity_notes
    for item in wanted:
        if item == "all":
            specs += configs + quantities + [f"block:{b}" for b in BLOCKS]
        elif item == "configs":
            specs += configs
        elif item == "quantities":
            specs += quantities
        elif item == "blocks":
            specs += [f"block:{b}" for b in BLOCKS]
        elif item in CONFIGURATIONS:
            if item in configs:
                specs.append(item)
            else:
                notes.append(f"{item!r} requested but not available")
        elif item in BLOCKS or item.startswith("block:"):
            specs.append(item if item.startswith("block:") else f"block:{item}")
        elif item in quantities:
            specs.append(item)
        else:
            notes.append(f"{item!r} is no configuration, quantity or block: skipped")
    return list(dict.fromkeys(specs)), notes


def _machine() -> dict:
    from importlib import metadata

    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = os.environ.get("BENCH_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=REPO,
                capture_output=True,
                text=True,
            ).stdout.strip()
        except OSError:
            pass
    commit = commit or "unknown"
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backpack": metadata.version("backpack-for-pytorch"),
        "commit": commit,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load": load,
    }


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


def _ms(seconds_list) -> str:
    return f"{1000 * statistics.median(seconds_list):.1f}" if seconds_list else "–"


def _verdict(value, target) -> str:
    if value is None or target is None:
        return ""
    return "met" if value <= target else "**missed**"


def _members(label: str) -> list[str]:
    try:
        from cockpit.utils.configuration import quantities_cls_for_configuration
    except Exception:  # noqa: BLE001 - configurations missing: nothing to break down
        return []
    return [cls.__name__ for cls in quantities_cls_for_configuration(label)]


def _breakdown(res: dict, configs: list[str]) -> list[str]:
    """Lines saying which member quantities cost most when tracked alone."""
    lines = []
    for label in configs:
        solo = []
        for name in _members(label):
            ratio = res.get(name, {}).get("time", {}).get("ratio")
            if ratio is not None:
                solo.append((ratio - 1, name))
        if solo:
            parts = ", ".join(
                f"{name} +{extra:.2f}" for extra, name in sorted(solo)[::-1]
            )
            lines.append(f"- {label}: members alone, overhead (ratio - 1): {parts}")
    if lines:
        lines = [
            "Where the time goes (each member quantity tracked alone):",
            "",
        ] + lines
        lines.append("")
    return lines


def render(results: dict, args, machine: dict, notes: list[str], argv) -> str:
    """Render the results as Markdown."""
    lines = [
        "# cockpit overhead benchmark",
        "",
        "Made by:",
        "",
        "```",
        "python -m benchmarks.run " + " ".join(argv),
        "```",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['platform']}; "
        f"Python {machine['python']}, torch {machine['torch']}, BackPACK "
        f"{machine['backpack']}; {args.threads} torch threads; {args.clock} clock; "
        f"commit {machine['commit']}; {machine['date']}; load average at the end "
        f"{machine['load']}.",
        "",
        f"Batch 128 of random float32 data, every step tracked, at least "
        f"{args.repeats} interleaved plain/tracked pairs (more until they took "
        f"{args.min_time:g} s) after {args.warmup} warm-up pair(s) per "
        "configuration, each configuration in a fresh process with "
        "`MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776`. Ratio = median "
        "tracked-step time / median plain-step time (plain: zero_grad, forward, "
        "backward, SGD step on a model that is not extended). Peak RSS extra = peak "
        f"RSS of a process running {args.warmup + args.memory_steps} tracked steps "
        "minus that of a process running as many plain steps.",
        "",
    ]
    for problem in args.problems:
        res = results.get(problem, {})
        plain_mem = res.get("plain", {}).get("memory", {}).get("peak_rss_mib")
        lines += [f"## {problem}", ""]
        if plain_mem is not None:
            lines += [f"Plain-run peak RSS: {plain_mem:.0f} MiB.", ""]

        def extra_mem(spec, res=res, plain_mem=plain_mem):
            mem = res.get(spec, {}).get("memory", {})
            if "peak_rss_mib" not in mem or plain_mem is None:
                return None
            return mem["peak_rss_mib"] - plain_mem

        configs = [s for s in res if s in CONFIGURATIONS]
        if configs:
            lines += [
                "### Configurations",
                "",
                "| config | plain ms | tracked ms | ratio | target | reference "
                "| verdict | peak RSS extra MiB | target MiB | reference MiB |",
                "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
            ]
            for spec in configs:
                t = res[spec].get("time", {})
                ratio = t.get("ratio")
                ref, ref_mem = REFERENCE.get((problem, spec), (None, None))
                target = TARGET.get((problem, spec))
                mem = extra_mem(spec)
                target_mem = ref_mem / 2 if ref_mem else None
                verdict = _verdict(ratio, target)
                if mem is not None and target_mem is not None:
                    verdict += " / " + _verdict(mem, target_mem)
                lines.append(
                    f"| {spec} | {_ms(t.get('plain_s'))} | {_ms(t.get('tracked_s'))} "
                    f"| {_fmt(ratio)} | {_fmt(target)} | {_fmt(ref)} | {verdict} "
                    f"| {_fmt(mem)} | {_fmt(target_mem)} | {_fmt(ref_mem)} |"
                )
            lines.append("")
            lines += _breakdown(res, configs)
        singles = [s for s in res if s not in CONFIGURATIONS and s != "plain"]
        singles = [s for s in singles if not s.startswith("block:")]
        if singles:
            lines += [
                "### Single quantities",
                "",
                "| quantity | plain ms | tracked ms | ratio | reference "
                "| peak RSS extra MiB |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
            ]
            refs = REFERENCE_SINGLE_3C3D if problem == "3c3d" else {}
            for spec in singles:
                t = res[spec].get("time", {})
                lines.append(
                    f"| {spec} | {_ms(t.get('plain_s'))} | {_ms(t.get('tracked_s'))} "
                    f"| {_fmt(t.get('ratio'))} | {refs.get(spec, '–')} "
                    f"| {_fmt(extra_mem(spec))} |"
                )
            lines.append("")
        blocks = [s for s in res if s.startswith("block:")]
        if blocks:
            lines += [
                "### Building blocks (units of one plain forward+backward pass)",
                "",
                "| block | plain fwd+bwd ms | block ms | units | reference |",
                "| --- | ---: | ---: | ---: | ---: |",
            ]
            refs = REFERENCE_BLOCKS_3C3D if problem == "3c3d" else {}
            for spec in blocks:
                name = spec[6:]
                t = res[spec].get("time", {})
                label = name
                if name == "HVP":
                    label = "fwd + create_graph bwd"
                elif name == "PerSampleGradients":
                    label = "cockpit PerSampleGradients (Linear factored)"
                lines.append(
                    f"| {label} | {_ms(t.get('plain_s'))} | {_ms(t.get('tracked_s'))} "
                    f"| {_fmt(t.get('ratio'))} | "
                    f"{refs.get(name, '–') if name != 'HVP' else '–'} |"
                )
                if "extra_ratio" in t:
                    lines.append(
                        f"| one HVP (after it) | {_ms(t.get('plain_s'))} "
                        f"| {_ms(t.get('extra_s'))} | {_fmt(t['extra_ratio'])} "
                        f"| {refs.get(name, '–')} |"
                    )
            lines.append("")
        errors = [
            f"- {problem} {spec} ({mode}): {out['error']}"
            for spec, modes in res.items()
            for mode, out in modes.items()
            if "error" in out
        ]
        if errors:
            lines += ["### Failures", ""] + errors + [""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    analysis = Path(args.analysis) if args.analysis else None
    if analysis is not None and analysis.exists():
        lines += [analysis.read_text().rstrip(), ""]
    return "\n".join(lines)


def parse(argv=None):
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Measure cockpit's step-time and memory overhead.",
    )
    parser.add_argument(
        "--problems", default="mlp,3c3d", help="comma list of mlp, 3c3d"
    )
    parser.add_argument(
        "--configs",
        default="all",
        help="comma list: all, configs, quantities, blocks, economy, business, full, "
        "quantity class names, block names (BatchGrad, ..., vmap_grad, HVP)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed pairs")
    parser.add_argument("--warmup", type=int, default=None, help="untimed pairs")
    parser.add_argument(
        "--memory-steps", type=int, default=None, help="steps of a memory run"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip memory runs")
    parser.add_argument("--no-time", action="store_true", help="skip timing runs")
    parser.add_argument(
        "--quick", action="store_true", help="few repeats, for development"
    )
    parser.add_argument(
        "--min-time",
        type=float,
        default=None,
        help="keep adding timed pairs until they took this many seconds",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--clock",
        choices=sorted(_CLOCKS),
        default="wall",
        help="wall (default; what results.md reports) or cpu: process CPU time, "
        "steadier on a busy machine, meaningful with --threads 1",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds/child")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="Markdown output")
    parser.add_argument("--json", default=None, help="also write raw results here")
    parser.add_argument(
        "--busy-factor",
        type=float,
        default=3.0,
        help="re-measure a configuration whose median plain step is this many times "
        "the fastest of its problem (another process was running)",
    )
    parser.add_argument("--retries", type=int, default=2, help="re-measurements")
    parser.add_argument(
        "--fix",
        default=None,
        metavar="JSON",
        help="re-measure the busy configurations of a --json record, update it and "
        "rewrite --out",
    )
    parser.add_argument(
        "--remeasure",
        default=None,
        metavar="PROBLEM:SPEC,...",
        help="with --fix: also measure these again, e.g. mlp:block:DiagGGNMC",
    )
    parser.add_argument(
        "--render",
        default=None,
        metavar="JSON",
        help="measure nothing: rewrite --out from a record written with --json",
    )
    parser.add_argument(
        "--analysis",
        default=str(DEFAULT_ANALYSIS),
        help="Markdown appended to the output if it exists ('' for none)",
    )
    # child arguments (internal)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--problem", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 9
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.min_time is None:
        args.min_time = 1.0 if args.quick else 4.0
    if args.memory_steps is None:
        args.memory_steps = 2 if args.quick else 3
    return args


def main(argv=None) -> None:
    """Run every requested configuration in child processes and write the report."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.child:
        child_main(args)
        return
    if args.render:
        rerender(args)
        return
    if args.fix:
        fix_busy(args)
        return
    args.problems = [p.strip() for p in args.problems.split(",") if p.strip()]
    specs, notes = plan(args)
    results: dict = {}
    for problem in args.problems:
        res = results.setdefault(problem, {})
        if not args.no_memory:
            res["plain"] = {"memory": _run_child(problem, "plain", "memory", args)}
        for spec in specs:
            entry = res.setdefault(spec, {})
            if not args.no_time:
                entry["time"] = _run_child(problem, spec, "time", args)
            if not args.no_memory and not spec.startswith("block:"):
                entry["memory"] = _run_child(problem, spec, "memory", args)
            summary = ", ".join(
                f"{mode}: "
                + (
                    out["error"]
                    if "error" in out
                    else f"{out.get('ratio', out.get('peak_rss_mib', 0)):.3g}"
                )
                for mode, out in entry.items()
            )
            print(f"[{problem}] {spec}: {summary}", file=sys.stderr, flush=True)
    notes += retry_busy(results, args)
    machine = _machine()
    Path(args.out).write_text(render(results, args, machine, notes, argv) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    if args.json:
        record = {
            "machine": machine,
            "results": results,
            "notes": notes,
            "argv": list(argv),
            "settings": {name: getattr(args, name) for name in _SETTINGS},
        }
        Path(args.json).write_text(json.dumps(record, indent=1))


#: The arguments the report depends on, saved with ``--json`` for ``--render``.
_SETTINGS = (
    "problems",
    "repeats",
    "warmup",
    "min_time",
    "memory_steps",
    "threads",
    "clock",
)


def _plain_median(entry: dict) -> float | None:
    plain = entry.get("time", {}).get("plain_s")
    return statistics.median(plain) if plain else None


def retry_busy(results: dict, args) -> list[str]:
    """Measure again the configurations whose plain steps ran on a busy machine.

    Another process on a 2-core machine slows a 2-thread step by up to 50 times (its
    threads wait for each other), so the ratio of such a run means little. A
    configuration whose median plain step took more than ``args.busy_factor`` times
    the fastest median plain step of its problem is measured again (at most
    ``args.retries`` times); the run with the fastest plain steps is kept.

    Returns:
        Notes on what was measured again, for the report.
    """
    notes = []
    for problem, res in results.items():
        for blocks in (False, True):  # plain steps and plain fwd+bwd passes
            notes += _retry_group(problem, res, blocks, args)
    return notes


def _retry_group(problem: str, res: dict, blocks: bool, args) -> list[str]:
    notes = []
    medians = {}
    for spec, entry in res.items():
        median = _plain_median(entry)
        if median is not None and spec.startswith("block:") == blocks:
            medians[spec] = median
    if medians:
        best = min(medians.values())
        for spec, median in medians.items():
            tries = 0
            while median > args.busy_factor * best and tries < args.retries:
                tries += 1
                again = _run_child(problem, spec, "time", args)
                new = _plain_median({"time": again})
                if new is not None and new < median:
                    notes.append(
                        f"{problem} {spec}: measured again (plain step median "
                        f"{1000 * median:.1f} ms, {median / best:.1f}x the fastest "
                        f"of this problem: machine busy); kept {1000 * new:.1f} ms"
                    )
                    res[spec]["time"], median = again, new
                print(
                    f"[{problem}] {spec}: retry {tries}, plain "
                    f"{1000 * median:.1f} ms (best {1000 * best:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
            if median > args.busy_factor * best:
                notes.append(
                    f"{problem} {spec}: plain steps still {median / best:.1f}x slower "
                    "than the fastest of this problem after retries (machine busy); "
                    "its ratio is unreliable"
                )
    return notes


def fix_busy(args) -> None:
    """Re-measure busy configurations of a ``--json`` record, then rewrite both."""
    record = json.loads(Path(args.fix).read_text())
    for name, value in record["settings"].items():
        setattr(args, name, value)
    notes = list(record["notes"])
    for item in filter(None, (args.remeasure or "").split(",")):
        problem, spec = item.strip().split(":", 1)
        entry = record["results"][problem][spec]
        old = entry["time"].get("ratio")
        entry["time"] = _run_child(problem, spec, "time", args)
        notes.append(
            f"{problem} {spec}: measured again after the run on request (ratio "
            f"{old:.2f} -> {entry['time'].get('ratio', float('nan')):.2f}; the first "
            "run overlapped with other work on the machine)"
        )
        print(f"[{problem}] {spec}: measured again", file=sys.stderr, flush=True)
    notes += retry_busy(record["results"], args)
    command = f"python -m benchmarks.run --fix {args.fix}"
    if args.remeasure:
        command += f" --remeasure {args.remeasure}"
    how = (
        "entries 'measured again' were measured again at the end of the run, those "
        f"'after the run' (and any listed after them) by `{command}`"
    )
    if any("measured again" in n for n in notes) and how not in notes:
        notes.append(how)
    record["notes"] = notes
    Path(args.fix).write_text(json.dumps(record, indent=1))
    text = render(
        record["results"], args, record["machine"], record["notes"], record["argv"]
    )
    Path(args.out).write_text(text + "\n")
    print(f"wrote {args.out} and {args.fix}", file=sys.stderr)


def rerender(args) -> None:
    """Write the report again from a ``--json`` record (e.g. after editing analysis)."""
    record = json.loads(Path(args.render).read_text())
    for name, value in record["settings"].items():
        setattr(args, name, value)
    text = render(
        record["results"], args, record["machine"], record["notes"], record["argv"]
    )
    Path(args.out).write_text(text + "\n")
    print(f"wrote {args.out} from {args.render}", file=sys.stderr)


if __name__ == "__main__":
    main()
