"""What sending cockpit's values to W&B or MLflow adds to a tracked step.

Run from the repository root (about two minutes on two CPU cores; needs the
``wandb`` and ``mlflow`` extras)::

    python -m benchmarks.tracker_overhead --out benchmarks/results/tracker_overhead.md
    python -m benchmarks.tracker_overhead --steps 40 --rounds 1 --out /tmp/t.md

The economy digits run of :mod:`cockpit.demo` (64-32-10 MLP, batch 64, SGD,
``configuration("economy")`` tracked at every step, train/validation loss and
accuracy every 10th step through ``Cockpit.log``), ``--steps`` steps per run, in
one process on one thread (``MALLOC_MMAP_MAX_=0``, a huge
``MALLOC_TRIM_THRESHOLD_``, as :mod:`benchmarks.measure`). Variants, interleaved
(the order rotates each round), each a fresh model and cockpit:

* ``none``: the cockpit alone;
* ``wandb``: ``cockpit.integrations.wandb.log_to(cockpit, run)``, an offline run
  (``WANDB_MODE=offline``: the same ``run.log`` calls, written to local files);
* ``mlflow``: ``cockpit.integrations.mlflow.log_to(cockpit, run_id)`` to a local
  ``mlflow server`` (SQLite backend, started by the benchmark on the same
  machine, so its work competes for the same two cores).

Measured: the wall time of the training loop plus the time ``close()`` of the
tracker's subscriber waits for its worker thread to send what is left (so nothing
sent after the loop is hidden), divided by the steps; medians over ``--rounds``.
The end-of-run outputs (dashboard PNG, HTML, diagnosis; once per run, not per
step) are timed separately.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

os.environ.setdefault("MALLOC_MMAP_MAX_", "0")
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "1099511627776")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402

from benchmarks.driver import RESULTS  # noqa: E402
from benchmarks.measure import REPO  # noqa: E402

DEFAULT_OUT = RESULTS / "tracker_overhead.md"
VARIANTS = ("none", "wandb", "mlflow")


def digits_run(steps: int, attach=None) -> tuple[float, float, float]:
    """Train the digits run; return (loop seconds, drain seconds, outputs seconds)."""
    from cockpit import Cockpit
    from cockpit.demo import load_digits_tensors, make_demo_model
    from cockpit.engines.backpack.api import extend
    from cockpit.utils.configuration import configuration

    x, y = load_digits_tensors()
    cut = int(0.8 * x.shape[0])
    (x_train, y_train), (x_valid, y_valid) = (x[:cut], y[:cut]), (x[cut:], y[cut:])
    model = make_demo_model(0)
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    individual = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    subscriber = attach(cockpit) if attach is not None else None
    if subscriber is not None:
        subscriber.history = None  # outputs are timed apart (below)
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(steps):
        index = torch.randint(0, cut, (64,), generator=generator)
        inputs, targets = x_train[index], y_train[index]
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = loss_fn(outputs, targets)
        info = {"batch_size": 64, "individual_losses": individual(outputs, targets),
                "loss": loss, "optimizer": optimizer}  # fmt: skip
        with cockpit(step, info=info):
            loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == steps - 1:
            with torch.no_grad():
                train = float(loss_fn(model(x_train), y_train))
                valid = float(loss_fn(model(x_valid), y_valid))
            cockpit.log(step, 0, train, valid, None, None, None, None, 0.1)
    loop = time.perf_counter() - start
    start = time.perf_counter()
    if subscriber is not None:  # what close() does before the outputs:
        subscriber._send_pending()  # the last step
        worker, subscriber._worker = subscriber._worker, None
        if worker is not None:
            worker.close()  # wait for the worker to send the rest
        flush = getattr(subscriber.sink, "flush", None)
        if flush is not None:  # MLflow: the last batch
            flush()
        subscriber._closed = True
    drain = time.perf_counter() - start
    outputs = 0.0
    if subscriber is not None:
        from cockpit.integrations.trackers import make_outputs

        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            made = make_outputs(cockpit.history, folder)
            subscriber.sink.finish(made)
            close = getattr(subscriber.sink, "close", None)
            if close is not None:
                close()
        outputs = time.perf_counter() - start
    cockpit.close()
    return loop, drain, outputs


def attacher(variant: str, folder: str, mlflow_uri: str | None = None):
    """The ``attach(cockpit)`` of a variant (``None`` for ``none``)."""
    if variant == "wandb":
        import wandb

        from cockpit.integrations.wandb import log_to

        def attach(cockpit):
            run = wandb.init(project="overhead", dir=folder, mode="offline",
                             reinit="create_new")  # fmt: skip
            log = log_to(cockpit, run)
            log.sink.owns = True  # finish the run when done
            return log

        return attach
    if variant == "mlflow":
        import mlflow

        from cockpit.integrations.mlflow import log_to

        uri = mlflow_uri
        client = mlflow.MlflowClient(uri)
        experiment = client.create_experiment(f"overhead-{time.time_ns()}")

        def attach(cockpit):
            run = client.create_run(experiment)
            log = log_to(cockpit, run.info.run_id, tracking_uri=uri)
            log.sink.owns = True
            return log

        return attach
    return None


def main(argv=None) -> None:
    """Measure and write the results file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    os.environ.setdefault("WANDB_SILENT", "true")
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    drains: dict[str, list[float]] = {v: [] for v in VARIANTS}
    outputs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    from tests.utils.mlflow_server import mlflow_server

    with tempfile.TemporaryDirectory() as folder, mlflow_server(folder) as uri:
        attachers = {v: attacher(v, folder, uri) for v in VARIANTS}
        digits_run(10, attachers["wandb"])  # warm-up: imports, the first run
        digits_run(10, attachers["mlflow"])
        for round_ in range(args.rounds):
            order = VARIANTS[round_ % 3 :] + VARIANTS[: round_ % 3]
            for variant in order:
                loop, drain, made = digits_run(args.steps, attachers[variant])
                times[variant].append((loop + drain) / args.steps)
                drains[variant].append(drain)
                outputs[variant].append(made)
                per_step = 1e3 * (loop + drain) / args.steps
                print(f"round {round_} {variant}: {per_step:.2f}"
                      f" ms/step (drain {drain * 1e3:.0f} ms)", flush=True)  # fmt: skip
    write(args, times, drains, outputs)


def write(args, times, drains, outputs) -> None:
    """The Markdown table of medians and ratios."""
    base = statistics.median(times["none"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info
                       if line.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        pass
    lines = [
        "# What sending cockpit's values to a tracker adds to a tracked step",
        "",
        f"`python -m benchmarks.tracker_overhead --steps {args.steps} --rounds "
        f"{args.rounds}`; {datetime.date.today()}, commit {commit}, {cpu}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, torch "
        f"{torch.__version__}, one thread; variants interleaved, medians of the "
        "rounds. The machine is shared with other jobs, so single rounds vary.",
        "",
        "The economy digits run, every step tracked; time per step = (training "
        "loop + waiting for the tracker's worker to send the rest) / steps.",
        "",
        "| variant | ms per tracked step | vs. none | drain at close (ms) | "
        "outputs at the end (s) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for variant in VARIANTS:
        median = statistics.median(times[variant])
        ratio = f"{100 * (median / base - 1):+.1f} %" if variant != "none" else "-"
        made = (f"{statistics.median(outputs[variant]):.1f}"
                if variant != "none" else "-")  # fmt: skip
        lines.append(
            f"| {variant} | {1e3 * median:.2f} | {ratio} | "
            f"{1e3 * statistics.median(drains[variant]):.0f} | {made} |"
        )
    lines += [
        "",
        "Rounds (ms per step): "
        + "; ".join(
            f"{v}: " + ", ".join(f"{1e3 * t:.2f}" for t in times[v]) for v in VARIANTS
        ),  # fmt: skip
        "",
        "Outputs at the end: the dashboard PNG, the HTML dashboard, the diagnosis "
        "and their upload, once per run.",
    ]
    with open(args.out, "w", encoding="utf-8") as file:
        file.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
