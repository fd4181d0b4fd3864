"""Peak memory and time of every ``cockpit`` command on long logs.

Run from the repository root (the 1 GB log takes a few minutes to write and tens of
minutes to read five times on two loaded cores; logs are deleted after measuring)::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \\
        python -m benchmarks.cli_memory --out benchmarks/results/cli_memory.md
    python -m benchmarks.cli_memory --sizes 20 --kinds stream --commands plot \\
        --baseline /tmp/main-checkout --out /tmp/cli.md

For each log kind (``stream``: a streamed ``.jsonl`` as ``Cockpit(logpath=...)``
writes it; ``json``: what ``Cockpit.write`` writes; ``legacy``: cockpit-for-pytorch
1.0.2's format) and size (MB), a synthetic log shaped like a ``full`` run's is
written (:mod:`benchmarks.big_logs`), and each command runs as its own process
(``python -m cockpit ...``, one torch thread): its peak resident memory and CPU
time come from ``os.wait4`` (the child's own ``ru_maxrss`` and ``ru_utime +
ru_stime``), its wall time from the parent's clock. With ``--baseline SRC`` the
same commands run a second time with ``PYTHONPATH=SRC`` (another checkout of
cockpit, e.g. the main branch before a change), interleaved with this checkout's
runs. Commands:

* ``plot``: ``cockpit plot LOG -o PNG``;
* ``report``: ``cockpit report LOG --json``;
* ``timelapse``: ``cockpit timelapse LOG -o GIF --frames 10 --no-progress``;
* ``export``: ``cockpit export LOG --tensorboard DIR`` (only for sizes up to
  ``--export-max-mb``: TensorBoard's writer takes minutes per 100 MB).

``--limit-gb`` caps each child's address space (``RLIMIT_AS``), so that a
baseline that would need more memory than the machine has fails (reported as
such) instead of pushing others out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks import big_logs

COMMANDS = ("plot", "report", "timelapse", "export")


def _argv(command: str, log: str, out: str) -> list[str]:
    if command == "plot":
        return ["plot", log, "-o", os.path.join(out, "dashboard.png")]
    if command == "report":
        return ["report", log, "--json"]
    if command == "timelapse":
        gif = os.path.join(out, "run.gif")
        return ["timelapse", log, "-o", gif, "--frames", "10", "--no-progress"]
    if command == "export":
        return ["export", log, "--tensorboard", os.path.join(out, "tb")]
    raise ValueError(command)


def run_command(command: str, log: str, source: str | None, limit_gb: float) -> dict:
    """Run one command in a child process; its wall and CPU time, peak memory."""
    out = tempfile.mkdtemp(prefix="cockpit-cli-")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if source is not None:  # another checkout's cockpit
        env["PYTHONPATH"] = source
    limit = int(limit_gb * 2**30)

    def cap() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    argv = [sys.executable, "-m", "cockpit", *_argv(command, log, out)]
    start = time.perf_counter()
    child = subprocess.Popen(  # in an empty folder: ``-m`` puts it on sys.path
        argv, env=env, cwd=out, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=cap,
    )  # fmt: skip
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    error = child.stderr.read().decode(errors="replace").strip().splitlines()
    child.stderr.close()
    shutil.rmtree(out, ignore_errors=True)
    return {
        "command": command,
        "rc": child.returncode,
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_mb": round(usage.ru_maxrss / 1024, 1),  # Linux: KB
        "error": error[-1][:200] if child.returncode else "",
    }


def _git(*args: str) -> str:
    try:
        return subprocess.check_output(["git", *args], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _cpu() -> str:
    try:
        for line in subprocess.check_output(["lscpu"], text=True).splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "?"


def _table(rows: list[dict]) -> list[str]:
    lines = [
        "| log | size (MB) | steps | code | command | rc | wall (s) | CPU (s) "
        "| peak RSS (MB) | CPU s per 100 MB | RSS MB per 100 MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per = 100.0 / r["mb"]
        lines.append(
            f"| {r['kind']} | {r['mb']:.0f} | {r['steps']} | {r['code']} "
            f"| {r['command']} | {r['rc']} | {r['wall_s']} | {r['cpu_s']} "
            f"| {r['peak_mb']} | {r['cpu_s'] * per:.1f} | {r['peak_mb'] * per:.0f} |"
            + (f" {r['error']}" if r["error"] else "")
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results file (.md; .json too)")
    parser.add_argument("--sizes", default="200,1000", help="log sizes in MB")
    parser.add_argument("--kinds", default="stream,json,legacy")
    parser.add_argument("--commands", default=",".join(COMMANDS))
    parser.add_argument("--baseline", default=None, metavar="SRC")
    parser.add_argument("--baseline-max-mb", type=float, default=50.0)
    parser.add_argument("--export-max-mb", type=float, default=250.0)
    parser.add_argument(
        "--json-max-mb",
        type=float,
        default=250.0,
        help="largest json/legacy log (the stream goes to all sizes)",
    )
    parser.add_argument("--limit-gb", type=float, default=6.0)
    parser.add_argument("--dir", default=None, help="where logs are written")
    parser.add_argument("--keep", action="store_true", help="keep the logs")
    parser.add_argument(
        "--reuse", action="store_true", help="use logs already in --dir (and keep them)"
    )
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    commands = args.commands.split(",")
    folder = args.dir or tempfile.mkdtemp(prefix="cockpit-big-logs-")
    os.makedirs(folder, exist_ok=True)
    rows: list[dict] = []
    started = time.time()
    load_before = os.getloadavg()
    for kind in kinds:
        for mb in sizes:
            if kind != "stream" and mb > args.json_max_mb:
                continue
            suffix = "jsonl" if kind == "stream" else "json"
            path = os.path.join(folder, f"{kind}-{mb:g}mb.{suffix}")
            steps = big_logs.steps_for(mb, kind)
            t = time.perf_counter()
            if args.reuse and os.path.exists(path):  # written by an earlier run
                size = os.path.getsize(path)
                steps = (
                    sum(1 for _ in open(path, "rb")) // 2 if kind == "stream" else steps
                )
            else:
                size = big_logs.write_log(path, kind, steps)
            print(f"{path}: {steps} steps, {size / 1e6:.1f} MB in "
                  f"{time.perf_counter() - t:.0f} s", flush=True)  # fmt: skip
            try:
                for command in commands:
                    if command == "export" and mb > args.export_max_mb:
                        continue
                    codes = [("this", None)]
                    if args.baseline and mb <= args.baseline_max_mb:
                        codes.append(("baseline", args.baseline))
                    for code, source in codes:
                        result = run_command(command, path, source, args.limit_gb)
                        result.update(kind=kind, mb=size / 1e6, steps=steps, code=code)
                        rows.append(result)
                        print(json.dumps(result), flush=True)
            finally:
                if not (args.keep or args.reuse):
                    os.remove(path)
    if not args.keep and args.dir is None:
        shutil.rmtree(folder, ignore_errors=True)
    header = [
        "# Peak memory and time of the cockpit commands on long logs",
        "",
        f"`python -m benchmarks.cli_memory {' '.join(argv or sys.argv[1:])}`",
        "",
        f"- commit {_git('rev-parse', '--short', 'HEAD')} "
        f"({_git('log', '-1', '--format=%s')[:80]})",
        f"- machine: {_cpu()}, {os.cpu_count()} cores; load average "
        f"{load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
        f"({(time.time() - started) / 60:.0f} min)",
        f"- baseline: {args.baseline or 'none'}",
        "",
    ]
    text = "\n".join(header + _table(rows)) + "\n"
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
