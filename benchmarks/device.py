"""The device check: the CUDA tests, the overhead table against 1.0.2, GPT-2, memory.

Run from the repository root, on a fresh GPU machine (``benchmarks/device_check.sh``
installs first, then runs this)::

    python -m benchmarks.device                # -> benchmarks/results/device_<gpu>.md
    python -m benchmarks.device --quick --no-reference --out /tmp/device.md   # tests

On the GPU (the first CUDA device), in this order, each part in its own process:

1. **Tests**: ``pytest -m cuda`` on the test files with device cases (:data:`TESTS`):
   their CUDA cases, against the float64 brute force on the CPU.
2. **Overhead on 3C3D** (batch 128, float32, as the paper's Fig. 6): for ``economy``,
   ``business`` and ``full`` one child per cockpit (this checkout's, and
   cockpit-for-pytorch 1.0.2 installed by :mod:`benchmarks.reference` unless
   ``--no-reference``) trains three copies of the model, interleaved window by
   window (the order rotates): plain steps, the configuration tracking every step,
   and tracking every 16th step. A window is 16 steps (the every-step variant's is
   ``--every-window`` steps); the ratio is the median over windows of the mean step
   time over the plain step's. ``torch.cuda.synchronize()`` closes every step.
3. **GPT-2** (11.5M parameters, from a config; :mod:`benchmarks.real_models`), batch
   8: a plain step, the hand-written ``vmap(grad)`` step (per-sample gradient norms
   and the variance), cockpit with Variance and NormTest, and ``economy``, every step,
   interleaved (:mod:`benchmarks.real_models_speed`'s variants).
4. **Memory**: for every variant the peak CUDA memory a step allocates above what
   was allocated before it (``torch.cuda.max_memory_allocated``).

Without a GPU the same command runs on the CPU (one thread) with small sizes:
3C3D at batch 8, the every-step window 2 steps, a one-layer GPT-2; memory is then not
measured. Writes the Markdown report ``--out`` (default
``benchmarks/results/device_<device name>.md``) and its JSON record beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import driver, record
from benchmarks.measure import REPO, Interpreter, spawn

#: The test files with device cases (``pytest -m cuda`` selects those cases).
TESTS = (
    "tests/quantities/test_core_quantities.py",
    "tests/quantities/test_curvature_instruments.py",
    "tests/quantities/test_histograms.py",
    "tests/quantities/test_first_order_instruments.py",
    "tests/test_mixed_precision.py",
    "tests/test_devices.py",
)
SPECS = ("economy", "business", "full")
INTERVAL = 16
#: The paper's GPU figures (3C3D on CIFAR-10, Fig. 6): every step, every 16th.
PAPER = {
    "economy": (1.51, 1.04),
    "business": (2.02, 1.08),
    "full": (21.1, 2.2),
}
GPT2_VARIANTS = ("plain", "vmap", "vnt", "economy")
GPT2_NAMES = {
    "plain": "plain step",
    "vmap": "`vmap(grad)` (per-sample norms, variance)",
    "vnt": "cockpit Variance + NormTest",
    "economy": "cockpit economy",
}


# ======================================================================================
# child side
# ======================================================================================
def _setup(config: dict):
    import torch

    device = torch.device(config["device"])
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    return torch, device


def _synced(torch, device):
    """A function that waits for the device's queued work (nothing on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class _Window:
    """Times windows of steps of one variant and its peak device memory."""

    def __init__(self, torch, device, step, length: int):
        self.torch, self.device, self.step, self.length = torch, device, step, length
        self.sync = _synced(torch, device)
        self.means: list[float] = []
        self.peak_mib = None

    def run(self, keep: bool) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            before = self.torch.cuda.memory_allocated(self.device)
            self.torch.cuda.reset_peak_memory_stats(self.device)
        self.sync()
        start = time.perf_counter()
        for _ in range(self.length):
            self.step()
        self.sync()
        if keep:
            self.means.append((time.perf_counter() - start) / self.length)
        if cuda:
            peak = self.torch.cuda.max_memory_allocated(self.device) - before
            self.peak_mib = max(self.peak_mib or 0.0, peak / 2**20)


def _interleave(windows: dict, warmup: int, rounds: int) -> dict:
    """Run the windows round by round (rotating order); ratios over ``plain``."""
    names = list(windows)
    for index in range(warmup + rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            windows[name].run(keep=index >= warmup)
    base = statistics.median(windows["plain"].means)
    return {
        "step_s": {k: statistics.median(w.means) for k, w in windows.items()},
        "ratio": {k: statistics.median(w.means) / base for k, w in windows.items()},
        "peak_mib": {k: w.peak_mib for k, w in windows.items()},
        "windows": {k: len(w.means) for k, w in windows.items()},
    }


def child_overhead(config: dict) -> dict:
    """Plain, every-step and every-16th-step training of 3C3D with one configuration."""
    torch, device = _setup(config)
    from backpack import extend

    from benchmarks import internals, measure
    from benchmarks.problems import make

    bench = make("3c3d", batch_size=config["batch"], need_extended=False)
    batches = [(x.to(device), y.to(device)) for x, y in bench.batches]
    plain = bench.plain.to(device)
    loss_fn = torch.nn.CrossEntropyLoss()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    counter = {"plain": 0}

    def plain_step():
        x, y = batches[counter["plain"] % len(batches)]
        counter["plain"] += 1
        plain_opt.zero_grad()
        loss_fn(plain(x), y).backward()
        plain_opt.step()

    def tracked(interval: int):
        model = extend(copy.deepcopy(plain))
        tracked_loss = extend(torch.nn.CrossEntropyLoss())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        cockpit = internals.make_cockpit(
            list(model.parameters()),
            internals.configuration_quantities(
                config["spec"], internals.schedule_every(interval)
            ),
        )
        steps = {"n": 0}

        def step():
            n = steps["n"]
            steps["n"] += 1
            batch = batches[n % len(batches)]
            measure.tracked_step(cockpit, model, tracked_loss, opt, batch, n)

        return step

    windows = {
        "plain": _Window(torch, device, plain_step, INTERVAL),
        "every": _Window(torch, device, tracked(1), config["every_window"]),
        "sparse": _Window(torch, device, tracked(INTERVAL), INTERVAL),
    }
    result = _interleave(windows, config["warmup"], config["rounds"])
    result["about"] = internals.describe()
    return result


def child_gpt2(config: dict) -> dict:
    """GPT-2's plain, ``vmap(grad)`` and cockpit steps, interleaved."""
    torch, device = _setup(config)
    from benchmarks import real_models_speed as speed

    load = speed.workload("gpt2", config["quick"])
    load.model.to(device)
    cache = {}

    def batches(step: int):
        key = step % 4
        if key not in cache:
            cache[key] = tuple(t.to(device) for t in load.batch(config["batch"], key))
        return cache[key]

    variants = {k: speed.Variant(k, load, batches) for k in GPT2_VARIANTS}
    windows = {
        k: _Window(torch, device, v.step, config["window"]) for k, v in variants.items()
    }
    result = _interleave(windows, config["warmup"], config["rounds"])
    result["parameters"] = load.parameters
    return result


def child_main(config: dict) -> None:
    """Run one child (``config["part"]``) and print its result line."""
    from benchmarks.measure import emit

    part = {"overhead": child_overhead, "gpt2": child_gpt2}[config["part"]]
    emit(part(config))


# ======================================================================================
# parent side
# ======================================================================================
def describe_device(name: str) -> dict:
    """The device the check runs on: kind, name, torch and CUDA versions."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    about = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda}
    if name.startswith("cuda"):
        about["name"] = torch.cuda.get_device_name(torch.device(name))
        props = torch.cuda.get_device_properties(torch.device(name))
        about["memory_gib"] = round(props.total_memory / 2**30, 1)
    else:
        about["name"] = "cpu"
    return about


def slug(name: str) -> str:
    """A device name as a file name part (``NVIDIA H200`` -> ``nvidia-h200``)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def sizes(args, on_gpu: bool) -> dict:
    """The sizes of this run: the issue's on the GPU, small ones on the CPU."""
    quick = args.quick or not on_gpu
    return {
        "batch": 128 if not quick else 8,
        "every_window": INTERVAL if not quick else 2,
        "warmup": 1,
        "rounds": args.rounds or (5 if on_gpu else 1),
        "gpt2_batch": 8 if on_gpu else 2,
        "gpt2_window": 8 if on_gpu else 1,
        "gpt2_quick": not on_gpu or args.quick,
    }


def run_tests(device: str, timeout: float) -> dict:
    """``pytest -m cuda`` on :data:`TESTS`; its summary line, status and time."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda",
        "-p",
        "no:cacheprovider",
    ]
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [*command, *TESTS],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"summary": f"timed out after {timeout:.0f} s", "status": None}
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else proc.stderr.strip()[-200:]
    counts = {
        kind: int(n)
        for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)
    }
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return {
        "command": " ".join(["python", *command[1:], *TESTS]),
        "summary": summary,
        "counts": counts,
        "status": proc.returncode,
        "failed": failed[:20],
        "wall_s": time.perf_counter() - started,
    }


@contextlib.contextmanager
def reference_interpreter(args):
    """Yield the 1.0.2 children's interpreter and its name, or ``(None, reason)``."""
    if not args.reference:
        yield None, "not run (--no-reference)"
        return
    from benchmarks import reference

    try:
        with reference.interpreter(args.reference_venv) as (found, name, _about):
            yield found, name
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        yield None, f"not installed: {str(error).splitlines()[-1][:160]}"


def measure_all(args) -> dict:
    """Every part of the check (see the module); the record's measured part."""
    about = describe_device(args.device)
    on_gpu = about["device"] != "cpu"
    size = sizes(args, on_gpu)
    timeout = args.timeout
    say = lambda text: print(f"[device] {text}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"on {about['name']} ({about['device']}), sizes {size}")
    tests = (
        run_tests(about["device"], timeout) if args.tests else {"summary": "not run"}
    )
    say(f"tests: {tests['summary']}")
    overhead = {"ours": {}, "reference": {}}
    base = {"part": "overhead", "device": about["device"], "batch": size["batch"]}
    base |= {k: size[k] for k in ("every_window", "warmup", "rounds")}
    with reference_interpreter(args) as (theirs, reference_name):
        for spec in args.configs:
            for label, interpreter in (("ours", Interpreter()), ("reference", theirs)):
                if interpreter is None:
                    continue
                config = {**base, "spec": spec}
                overhead[label][spec] = spawn(
                    "benchmarks.device",
                    ["--child", json.dumps(config)],
                    1,
                    timeout,
                    interpreter,
                )
                say(f"3c3d {spec} {label}: {_brief(overhead[label][spec])}")
    gpt2_config = {
        "part": "gpt2",
        "device": about["device"],
        "batch": size["gpt2_batch"],
        "window": size["gpt2_window"],
        "warmup": 1,
        "rounds": size["rounds"],
        "quick": size["gpt2_quick"],
    }
    gpt2 = spawn("benchmarks.device", ["--child", json.dumps(gpt2_config)], 1, timeout)
    say(f"gpt2: {_brief(gpt2)}")
    return {
        "device": about,
        "sizes": size,
        "tests": tests,
        "reference": reference_name,
        "overhead": overhead,
        "gpt2": gpt2,
    }


def _brief(result: dict) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    return ", ".join(f"{k} {v:.2f}x" for k, v in result["ratio"].items())


def _x(value) -> str:
    return "–" if value is None else f"{value:.2f}x"


def _mib(value) -> str:
    return "–" if value is None else f"{value:.0f}"


def _overhead_rows(data: dict) -> list[tuple]:
    rows = []
    for spec in data["overhead"]["ours"]:
        ours = data["overhead"]["ours"].get(spec, {})
        theirs = data["overhead"]["reference"].get(spec, {})
        for kind, schedule, paper in zip(
            ("every", "sparse"), ("every step", f"every {INTERVAL}th step"), PAPER[spec]
        ):
            mine = None if "error" in ours else ours.get("ratio", {}).get(kind)
            ref = None if "error" in theirs else theirs.get("ratio", {}).get(kind)
            share = f"{mine / ref:.2f}" if mine and ref else "–"
            rows.append(
                (
                    spec,
                    schedule,
                    ours.get("error") or _x(mine),
                    theirs.get("error") or _x(ref),
                    share,
                    f"{paper}x",
                    _mib(ours.get("peak_mib", {}).get(kind)),
                    _mib(theirs.get("peak_mib", {}).get(kind)),
                )
            )
    return rows


def render(data: dict) -> str:
    """The Markdown report of a record."""
    device, size, tests = data["device"], data["sizes"], data["tests"]
    lines = [
        f"# Device check: {device['name']}",
        "",
        driver.machine_line(data) + f". Device `{device['device']}` "
        f"({device['name']}, torch {device['torch']}, CUDA {device['cuda'] or '–'}).",
        "",
        "## Tests: the CUDA cases",
        "",
        f"`{tests.get('command', 'pytest -m cuda')}`: {tests['summary']}.",
        *[f"* {line}" for line in tests.get("failed", ())],
        "",
        f"## Overhead on 3C3D, batch {size['batch']}, against {data['reference']}",
        "",
        "Median over windows of the mean step time over a plain step's (the "
        f"every-step window {size['every_window']} steps, the others {INTERVAL}; "
        f"{size['rounds']} windows each); memory: the peak a step allocates above "
        "what was allocated before it (MiB, CUDA only). `ours / 1.0.2`: the goal is "
        "at most 0.5; the paper's figures are 1.0.2 on a GPU.",
        "",
    ]
    header = (
        "configuration",
        "tracked",
        "ours",
        "1.0.2",
        "ours / 1.0.2",
        "paper",
        "peak MiB ours",
        "peak MiB 1.0.2",
    )
    lines += driver.table(header, _overhead_rows(data))
    gpt2 = data["gpt2"]
    lines += ["", f"## GPT-2, batch {size['gpt2_batch']}", ""]
    if "error" in gpt2:
        lines.append(f"error: {gpt2['error']}")
        return "\n".join(lines) + "\n"
    lines += [
        f"{gpt2['parameters']:,} parameters, every step tracked; median over "
        f"{size['rounds']} windows of {size['gpt2_window']} steps each.",
        "",
    ]
    rows = [
        (
            GPT2_NAMES[k],
            _x(gpt2["ratio"][k]),
            f"{gpt2['step_s'][k] * 1e3:.1f}",
            _mib(gpt2["peak_mib"][k]),
        )
        for k in GPT2_VARIANTS
    ]
    lines += driver.table(
        ("variant", "ratio to plain", "ms per step", "peak MiB"), rows
    )
    share = gpt2["ratio"]["vnt"] / gpt2["ratio"]["vmap"]
    lines += [
        "",
        f"Variance + NormTest over `vmap(grad)`: {share:.2f} (goal: at most 1).",
    ]
    return "\n".join(lines) + "\n"


def parse(argv):
    """The command line (see the module)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.device", description=__doc__
    )
    parser.add_argument(
        "--device", default="auto", help="auto (CUDA if present), cpu, cuda"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes on any device"
    )
    parser.add_argument(
        "--rounds", type=int, help="windows per variant (default 5 GPU, 1 CPU)"
    )
    parser.add_argument(
        "--configs",
        default=",".join(SPECS),
        help="configurations on 3C3D (%(default)s)",
    )
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="leave out cockpit-for-pytorch 1.0.2")  # fmt: skip
    parser.add_argument("--reference-venv", metavar="DIR",
                        help="create (or reuse) 1.0.2's environment here")  # fmt: skip
    parser.add_argument("--no-tests", dest="tests", action="store_false",
                        help="leave out the CUDA tests")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=300, help="seconds per part")
    parser.add_argument(
        "--out", help="Markdown report (default: results/device_<name>.md)"
    )
    parser.add_argument("--table", metavar="JSON", help="print a record's report")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    if unknown := set(args.configs) - set(SPECS):
        parser.error(f"--configs: unknown {sorted(unknown)}; choose from {SPECS}")
    if args.out is None and not (args.child or args.table):
        args.out = str(
            driver.RESULTS / f"device_{slug(describe_device(args.device)['name'])}.md"
        )
    return args


def main(argv=None) -> int:
    """Run the check (or one child, or print a record's report)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if driver.answered(args, child_main, render):
        return 0
    started = time.perf_counter()
    measured = measure_all(args)
    data = {
        "machine": record.machine(),
        "argv": ["python -m benchmarks.device", *argv],
        "wall_s": time.perf_counter() - started,
        **measured,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    text = render(data)
    out.write_text(text)
    print(text)
    print(f"wrote {out} ({data['wall_s']:.0f} s)", file=sys.stderr)
    failed = [
        f"3c3d {k} {s}"
        for k in ("ours",)
        for s, r in data["overhead"][k].items()
        if "error" in r
    ]
    failed += ["gpt2"] if "error" in data["gpt2"] else []
    failed += (
        ["tests"]
        if data["tests"].get("status") not in (0, 5, None)
        or (args.tests and data["tests"].get("status") is None)
        else []
    )
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
