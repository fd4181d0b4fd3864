"""Measuring one configuration in a fresh child process: step times and peak RSS.

A spec is a ready-made cockpit configuration (``economy``), a single quantity
(``HessTrace``) or a building block (``block:BatchGrad``, :mod:`benchmarks.blocks`).
The parent calls :func:`run_child`, which starts ``python -m benchmarks.measure`` and
reads back one JSON line:

* **time**: the child trains a plain model (zero_grad, forward, backward, SGD step; not
  extended by BackPACK) and an extended copy with the cockpit tracking at *every* step,
  alternating plain and tracked steps (and their order) to cancel drift. The overhead
  is the median tracked-step time over the median plain-step time. A block is timed
  the same way against a plain forward+backward pass.
* **memory**: the child runs only tracked steps; its peak resident set size
  (``getrusage``) is compared with that of a child that runs only plain steps.

Children run with ``MALLOC_MMAP_MAX_=0`` and a huge ``MALLOC_TRIM_THRESHOLD_`` (freed
memory is never given back to the system, so the peak RSS is the peak heap) and with
``--threads`` torch threads.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import blocks

REPO = Path(__file__).resolve().parent.parent
CHILD_ENV = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "1099511627776",
    "OMP_NUM_THREADS": "2",
    "MKL_NUM_THREADS": "2",
}
RESULT_PREFIX = "BENCHMARK-RESULT "
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


# ======================================================================================
# child side
# ======================================================================================
def peak_rss_mib() -> float:
    """Return this process's peak resident set size in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def tracked_step(
    cockpit, model, loss_fn, optimizer, batch, step: int, individual_losses=None
) -> None:
    """One training step on an extended model, tracked by ``cockpit``.

    Zero grads, forward, the mean loss and the individual losses, backward inside the
    cockpit's context (with ``create_graph`` when a quantity needs it), SGD step.
    ``individual_losses(outputs, y)`` gives one loss per sample (default: the
    cross-entropy with ``reduction="none"``).
    """
    import torch

    x, y = batch
    optimizer.zero_grad()
    outputs = model(x)
    loss = loss_fn(outputs, y)
    if individual_losses is None:
        losses = torch.nn.functional.cross_entropy(outputs, y, reduction="none")
    else:
        losses = individual_losses(outputs, y)
    info = {
        "batch_size": x.shape[0],
        "individual_losses": losses,
        "loss": loss,
        "optimizer": optimizer,
    }
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))
    optimizer.step()


class Trainer:
    """Plain and tracked training steps on one benchmark problem."""

    def __init__(self, problem, spec, need_plain=True, need_tracked=True):
        import torch

        from benchmarks import internals
        from benchmarks.problems import make

        self.torch = torch
        self.bench = make(problem, need_plain=need_plain, need_extended=need_tracked)
        self.plain_step_count = 0
        self.tracked_step_count = 0
        if need_plain:
            self.plain_opt = torch.optim.SGD(self.bench.plain.parameters(), lr=0.01)
        if need_tracked:
            params = list(self.bench.extended.parameters())
            self.tracked_opt = torch.optim.SGD(params, lr=0.01)
            self.cockpit = internals.make_cockpit(
                params, internals.make_quantities(spec)
            )

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
        step = self.tracked_step_count
        self.tracked_step_count += 1
        tracked_step(
            self.cockpit,
            self.bench.extended,
            self.bench.loss_fn,
            self.tracked_opt,
            self.bench.batch(step),
            step,
        )


def pairs(args):
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


def interleaved(args, baseline, candidate, after=None) -> dict:
    """Time ``baseline`` and ``candidate`` in alternating order, pair by pair.

    ``after`` (if given) runs right after every ``candidate`` call and is timed on its
    own. Returns the timed seconds (``plain_s``, ``tracked_s`` and ``extra_s`` if
    ``after``) and the ratios of their medians to the median of ``plain_s``.
    """
    clock = CLOCKS[args.clock]

    def timed(fn) -> float:
        start = clock()
        fn()
        return clock() - start

    plain, tracked, extra = [], [], []
    for i in pairs(args):
        keep = i >= args.warmup
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            if which == 0:
                t = timed(baseline)
                (plain if keep else []).append(t)
            else:
                t = timed(candidate)
                (tracked if keep else []).append(t)
                if after is not None:
                    t = timed(after)
                    (extra if keep else []).append(t)
    median = statistics.median(plain)
    result = {
        "plain_s": plain,
        "tracked_s": tracked,
        "ratio": statistics.median(tracked) / median,
    }
    if extra:
        result["extra_s"] = extra
        result["extra_ratio"] = statistics.median(extra) / median
    return result


def child_time(args) -> dict:
    """Time plain against tracked steps of one configuration or quantity."""
    from benchmarks import internals

    trainer = Trainer(args.problem, args.spec)
    result = interleaved(args, trainer.plain_step, trainer.tracked_step)
    result["keys"] = internals.recorded_keys(trainer.cockpit)
    result["num_params"] = trainer.bench.num_params()
    return result


def child_block(args) -> dict:
    """Time a building block against plain forward+backward passes."""
    baseline, run_block, run_extra = blocks.runner(
        args.problem, args.spec[len(blocks.PREFIX) :]
    )
    return interleaved(args, baseline, run_block, run_extra)


def child_memory(args) -> dict:
    """Peak RSS of a process that runs only plain (spec ``plain``) or tracked steps."""
    plain_only = args.spec == "plain"
    trainer = Trainer(
        args.problem, args.spec, need_plain=plain_only, need_tracked=not plain_only
    )
    gc.collect()
    before = peak_rss_mib()
    step = trainer.plain_step if plain_only else trainer.tracked_step
    for _ in range(args.warmup + args.steps):
        step()
    return {"peak_rss_mib": peak_rss_mib(), "setup_rss_mib": before}


def child_main(argv=None) -> None:
    """Measure one configuration and print its result as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.measure")
    parser.add_argument("--problem", required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--mode", choices=("time", "memory"), required=True)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-time", type=float, default=4.0)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.mode == "time":
        child = child_block if blocks.is_block(args.spec) else child_time
        result = child(args)
    else:
        result = child_memory(args)
    result["threads"] = torch.get_num_threads()
    emit(result)


def emit(result: dict) -> None:
    """Print a child's result as the one line :func:`spawn` reads back."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")


# ======================================================================================
# parent side
# ======================================================================================
@dataclass(frozen=True)
class Interpreter:
    """Where a child runs: the Python, its working folder, variables to drop.

    The default runs this checkout's cockpit. A reference interpreter
    (:mod:`benchmarks.reference`) runs another cockpit from a folder that holds only
    ``benchmarks``, without ``PYTHONPATH``, so that checkout's cockpit stays hidden.
    """

    python: str = sys.executable
    cwd: Path = REPO
    drop_env: tuple[str, ...] = ()


OURS = Interpreter()


def run_child(problem: str, spec: str, mode: str, args, interpreter=OURS) -> dict:
    """Measure one spec in a fresh process; return its result or ``{"error": ...}``.

    ``args`` supplies ``repeats``, ``warmup``, ``memory_steps``, ``threads``,
    ``min_time``, ``clock`` and ``timeout`` (seconds). The result also holds
    ``wall_s``, the seconds the child took.
    """
    return spawn(
        "benchmarks.measure",
        [
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
        ],
        args.threads,
        args.timeout,
        interpreter,
    )


def spawn(module: str, argv: list[str], threads: int, timeout, interpreter=OURS):
    """Run ``python -m module *argv`` in a fresh process; its result line as a dict.

    The child runs with :data:`CHILD_ENV` (``threads`` OpenMP/MKL threads) and
    prints its result as one line starting with :data:`RESULT_PREFIX`. Returns that
    result with ``wall_s`` (the seconds the child took) added, or
    ``{"error": ...}`` (the last lines of its output, or the timeout).
    """
    command = [interpreter.python, "-m", module, *argv]
    env = dict(os.environ, **CHILD_ENV)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    for name in interpreter.drop_env:
        env.pop(name, None)
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            command,
            cwd=interpreter.cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    elapsed = time.perf_counter() - started
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
            result["wall_s"] = elapsed
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": " / ".join(tail) or f"exit status {proc.returncode}"}


def summary(entry: dict) -> str:
    """One line per measured spec for the progress log: ratio or peak RSS, or error."""
    return ", ".join(
        f"{mode}: "
        + (
            out["error"]
            if "error" in out
            else f"{out.get('ratio', out.get('peak_rss_mib', 0)):.3g}"
        )
        for mode, out in entry.items()
    )


if __name__ == "__main__":
    child_main()
