"""``cockpit serve`` on many long runs: page ready, all read, server memory, deltas.

Run from the repository root (a few minutes on two CPU cores)::

    python -m benchmarks.serve --out benchmarks/results/serve.md
    python -m benchmarks.serve --runs 5 --steps 2000 --out /tmp/serve.md   # quick

``--runs`` streamed logs of ``--steps`` steps each are written in a folder tree
(``runs/lr=<x>/seed=<k>/log.jsonl``), what the ``economy`` configuration records at
every step of a 4-tensor network (:func:`benchmarks.html_dashboard.write_log`'s
values, written with :class:`cockpit.log.stream.LogStream`); five distinct logs
are written and copied (reading costs the same for a copy). Then
``cockpit serve`` starts in a fresh process (``MALLOC_MMAP_MAX_=0``, a huge
``MALLOC_TRIM_THRESHOLD_``, as :mod:`benchmarks.measure`), and:

* *page ready*: seconds from opening the page in headless Chromium until it
  lists every run and has drawn the runs it shows (the ten most recent);
* *all read*: seconds from the server's start until no run is still being read;
* the server's resident memory (``VmRSS``) and its high-water mark (``VmHWM``)
  then, and again after ``--live`` seconds in which five runs keep writing
  (bounded: it must not grow with the steps);
* the bytes of a run fetched whole and of the page's next fetch of it (only the
  points added since).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchmarks.html_dashboard import economy_steps
from benchmarks.internals import open_stream
from benchmarks.measure import CHILD_ENV, REPO

DEFAULT_OUT = REPO / "benchmarks" / "results" / "serve.md"
MIB = 2**20

WRITER = """
import sys, time
import numpy as np
from cockpit.log.stream import record_line
from cockpit.log.files import open_log
path, seconds = sys.argv[1], float(sys.argv[2])
start = open_log(path).steps[-1] + 1
rng = np.random.default_rng(0)
t, end = start, time.monotonic() + seconds
with open(path, "a") as handle:  # appended as a stream's writer appends
    while time.monotonic() < end:
        handle.write(record_line(t, {"Loss": float(rng.random()),
                     "GradNorm": rng.random(4).tolist(), "Alpha": float(rng.normal())}))
        handle.flush()
        t += 1
        time.sleep(0.01)
print(t - start)
"""


def write_stream(path: str, steps: int, seed: int) -> None:
    """A streamed log with ``economy``-shaped values at every step."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    stream = open_stream(path)
    batch = {}
    for step, values in economy_steps(steps, seed, accuracies=False):
        batch[step] = values
        if len(batch) == 500:
            stream.write(batch)
            batch = {}
    stream.write(batch)
    stream.close()


def _memory(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as handle:
        text = handle.read()
    return {
        k: int(re.search(rf"{k}:\s+(\d+)", text)[1]) / 1024 for k in ("VmRSS", "VmHWM")
    }


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as reply:
        return reply.read()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the results file."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--live", type=float, default=20.0)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from tests.utils.browser import Browser

    work = tempfile.mkdtemp(prefix="cockpit-serve-bench-")
    try:
        root = os.path.join(work, "runs")
        started = time.monotonic()
        paths = []
        for k in range(args.runs):
            path = os.path.join(root, f"lr={0.01 * (1 + k % 5):g}", f"seed={k}",
                                "log.jsonl")  # fmt: skip
            if k < 5:
                write_stream(path, args.steps, k)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                shutil.copy(paths[k % 5], path)
            paths.append(path)
        written = time.monotonic() - started
        size = sum(os.path.getsize(p) for p in paths)
        env = dict(CHILD_ENV, PYTHONPATH=str(REPO))
        t0 = time.monotonic()
        server = subprocess.Popen(
            [sys.executable, "-m", "cockpit", "serve", root, "--port", "0"],
            env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            url = re.search(r"(http://\S+/)", server.stdout.readline())[1]
            listening = time.monotonic() - t0
            with Browser(width=1400, height=1000) as browser:
                t1 = time.monotonic()
                browser.open(url)
                ready_js = (
                    "(() => { const runs = cockpit.runs(); return runs.length === "
                    f"{args.runs} && runs.every((r, i) => !cockpit.shown[i] || "
                    "r.epoch != null) && cockpit.stepPlots.length > 0; })()"
                )
                while not browser.evaluate(ready_js):
                    time.sleep(0.1)
                page_ready = time.monotonic() - t1
                shown = browser.evaluate("cockpit.shown.filter(Boolean).length")
                coarse_points = browser.evaluate(
                    "cockpit.stepPlots.reduce((n, p) => n + p.u.data.slice(1)"
                    ".reduce((m, c) => m + c.filter(v => v != null).length, 0), 0)"
                )
                full_js = (
                    "cockpit.runs().every((r, i) => !cockpit.shown[i] || "
                    "(r.epoch != null && !r.coarse))"
                )
                while not browser.evaluate(full_js):
                    time.sleep(0.2)
                time.sleep(2)  # the next redraw
                page_full = time.monotonic() - t1
                points = browser.evaluate(
                    "cockpit.stepPlots.reduce((n, p) => n + p.u.data.slice(1)"
                    ".reduce((m, c) => m + c.filter(v => v != null).length, 0), 0)"
                )
                errors = browser.errors()
            while any(r["status"] == "reading" or not r["steps"]
                      for r in json.loads(_get(url + "api/runs"))["runs"]):  # fmt: skip
                time.sleep(0.2)
            all_read = time.monotonic() - t0
            read_memory = _memory(server.pid)
            whole = _get(url + "api/run/0")
            answer = json.loads(whole)
            have = {k: v["from"] + len(v["steps"]) - v["tail"]
                    for k, v in answer["series"].items()}  # fmt: skip
            have.update({"hist:" + k: len(v["items"])
                         for k, v in answer["hists"].items()})  # fmt: skip
            writers = [subprocess.Popen([sys.executable, "-c", WRITER, p,
                                         str(args.live)], env=env,
                                        stdout=subprocess.PIPE, text=True)
                       for p in paths[:5]]  # fmt: skip
            time.sleep(args.live / 2)
            half_memory = _memory(server.pid)
            appended = [int(w.communicate()[0].strip() or 0) for w in writers]
            time.sleep(3)  # a poll or two
            query = urllib.request.quote(json.dumps(have))
            delta = _get(url + f"api/run/0?epoch={answer['epoch']}&have={query}")
            delta_whole = json.loads(delta)["whole"]
            # a steady state: what the page fetches a second after its last fetch
            answer = json.loads(delta)
            have = {k: v["from"] + len(v["steps"]) - v["tail"]
                    for k, v in answer["series"].items()} if delta_whole else {
                **have, **{k: v["from"] + len(v["steps"]) - v["tail"]
                           for k, v in answer["series"].items()}}  # fmt: skip
            one = subprocess.Popen(
                [sys.executable, "-c", WRITER, paths[0], "1"],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            one.communicate()
            time.sleep(1.5)
            query = urllib.request.quote(json.dumps(have))
            second = _get(url + f"api/run/0?epoch={answer['epoch']}&have={query}")
            second_whole = json.loads(second)["whole"]
            live_memory = _memory(server.pid)
        finally:
            server.terminate()
            server.wait(timeout=30)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True,
                         text=True).stdout.split(":", 1)[-1].strip()  # fmt: skip
    lines = [
        "# `cockpit serve` on many long runs",
        "",
        f"`python -m benchmarks.serve --runs {args.runs} --steps {args.steps} --live "
        f"{args.live:g}`; {datetime.date.today()}, commit {commit}, {cpu}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}; one server "
        "process, one headless Chromium, on a machine shared with other jobs (wall "
        "times vary).",
        "",
        f"Logs: {args.runs} streamed logs of {args.steps:,} steps each "
        f"({size / MIB:.0f} MiB in all; what `economy` records at every step, a "
        f"100-bin gradient histogram included), written in {written:.0f} s.",
        "",
        "| measure | value |",
        "| --- | ---: |",
        f"| server listening after start (s) | {listening:.1f} |",
        f"| page ready: every run listed, the {shown} shown drawn (s) | "
        f"{page_ready:.1f} |",
        f"| points drawn then (a preview: every 20th record) | {coarse_points:,} |",
        f"| the {shown} shown runs drawn in full (s) | {page_full:.1f} |",
        f"| points drawn on the page's step charts then | {points:,} |",
        f"| all {args.runs} runs read, from the server's start (s) | {all_read:.1f} |",
        f"| server memory after reading all (VmRSS / VmHWM, MiB) | "
        f"{read_memory['VmRSS']:.0f} / {read_memory['VmHWM']:.0f} |",
        f"| halfway through {args.live:g} s of 5 runs writing (VmRSS / VmHWM, MiB) | "
        f"{half_memory['VmRSS']:.0f} / {half_memory['VmHWM']:.0f} |",
        f"| at the end ({sum(appended):,} steps more) and one more second of writing "
        f"(VmRSS / VmHWM, MiB) | {live_memory['VmRSS']:.0f} / "
        f"{live_memory['VmHWM']:.0f} |",
        f"| one run fetched whole (KiB) | {len(whole) / 1024:.0f} |",
        f"| its next fetch after the {args.live:g} s of writing (KiB; "
        f"{'whole again: thinned, a new epoch' if delta_whole else 'the points added'}"
        f") | {len(delta) / 1024:.1f} |",
        f"| its fetch after one more second of writing (KiB; "
        f"{'whole' if second_whole else 'the points added'}) | "
        f"{len(second) / 1024:.1f} |",
        "",
        f"Browser errors: {errors or 'none'}.",
        "",
    ]
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
