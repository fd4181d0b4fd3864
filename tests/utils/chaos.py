"""Writers killed at random moments while another process reads their log.

:func:`run` plays one seeded scenario with real processes (forked from the fork
server of :mod:`tests.utils.ddp`, which has torch, BackPACK and cockpit imported):

* writers train a small model with a cockpit that streams its log to one path
  (1-D and 2-D histograms at every step, two-step values, ``cockpit.log`` records),
  each writing the steps it completed to a file of its own;
* a reader runs ``cockpit report --json`` and ``cockpit plot`` on the log, in a
  loop, for as long as the writers go (``cockpit.cli.main`` in one process);
* the scenario, drawn from the seed: writer 1 starts; after a random number of
  completed steps and a random delay it is killed (``SIGKILL``), or a second
  writer is started on the same path first (it must be refused, naming writer
  1); then, maybe, a new run starts on the path (replacing the log) and is killed
  in turn.

It returns what every process did; :func:`problems` lists what went wrong: a
reader command that failed other than on an empty log (or on a log a new run
replaced during the read), any traceback, a log that lost a completed step or
changed its values, or a second writer that was not refused. The seed replays the
scenario's choices; the processes' timing varies from run to run.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import time
import traceback
from typing import Any

#: Steps a writer may complete before it is killed (drawn per writer).
KILL_STEPS = (2, 14)
#: ``cockpit plot`` runs while the writers write (and one after the last kill).
PLOTS = 2


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def _done_steps(path: str) -> list[tuple[int, str, float]]:
    """``(step, repr of the loss, when)`` a writer reported complete."""
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        text = handle.read()
    done = []
    for line in text.splitlines(keepends=True):
        if line.endswith("\n") and line.startswith("done "):
            _, step, loss, when = line.split()
            done.append((int(step), loss, float(when)))
    return done


def _rewrites(writer: dict[str, Any]) -> tuple[float, float] | None:
    """When a run may have rewritten the log: from its start to its first step."""
    text = writer["text"]
    if "started " not in text:
        return None
    began = float(text.split("started ", 1)[1].split()[1])
    done = writer["done"]
    return began, done[0][2] if done else math.inf


def writer(logpath: str, report: str, seed: int) -> None:
    """Train until killed, streaming the log; report each completed step."""
    import torch

    from cockpit import Cockpit
    from cockpit import quantities as Q
    from cockpit.log.lock import LogInUseError
    from cockpit.utils.schedules import linear
    from tests.utils.problems import make_problem

    torch.set_num_threads(1)
    rng = random.Random(seed)
    problem = make_problem("mlp", "ce", "sgd")
    every = linear(1)
    quantities = [
        Q.Loss(every), Q.GradNorm(every), Q.Distance(every), Q.UpdateSize(every),
        Q.Alpha(every), Q.GradHist1d(every), Q.GradHist2d(linear(2)),
    ]  # fmt: skip
    with open(report, "a") as out:
        try:
            cockpit = Cockpit(problem.params, quantities, logpath=logpath)
        except LogInUseError as error:
            out.write(f"refused {json.dumps(str(error))}\n")
            out.flush()
            os._exit(3)
        out.write(f"started {os.getpid()} {time.time()!r}\n")
        out.flush()
        optimizer = problem.optimizer()
        for step in range(10**6):
            x, y = problem.make_batch(step)
            optimizer.zero_grad()
            outputs = problem.model(x)
            loss = problem.loss_fn(outputs, y)
            info = {
                "batch_size": x.shape[0],
                "individual_losses": problem.individual_loss_fn(outputs, y),
                "loss": loss,
                "optimizer": optimizer,
            }
            with cockpit(step, info=info):
                loss.backward()
            optimizer.step()
            if step % 3 == 0:
                cockpit.log(
                    step, step // 3, loss.item(), None, None, 0.5, None, None, 0.1
                )
            out.write(f"done {step} {loss.item()!r} {time.time()!r}\n")  # on disk
            out.flush()
            time.sleep(rng.uniform(0.0, 0.02))


def reader(logpath: str, stop: str, result: str, seed: int) -> None:
    """Run ``cockpit report`` and ``cockpit plot`` on the log until told to stop."""
    from cockpit.cli import main

    rng = random.Random(seed)
    runs: list[dict[str, Any]] = []
    image = os.path.join(os.path.dirname(result), "dashboard.png")
    plots = PLOTS  # drawing takes seconds: a few while the writers write
    while True:
        last = os.path.exists(stop)  # one more round after the stop sign
        command = "report"
        if last or (plots and rng.random() < 0.2):
            command, plots = "plot", plots - 1
        argv = [command, logpath, "--json"] if command == "report" else [
            command, logpath, "-o", image]  # fmt: skip
        out, err = io.StringIO(), io.StringIO()
        started = time.time()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
        except BaseException:  # noqa: BLE001 - reported to the test
            code, err = -1, io.StringIO(traceback.format_exc())
        entry = {
            "command": command,
            "rc": code,
            "start": started,
            "end": time.time(),
            "stderr": err.getvalue(),
            "last": last,
        }
        if command == "report" and code == 0:
            try:
                entry["findings"] = len(json.loads(out.getvalue())["findings"])
            except (ValueError, KeyError) as error:
                entry["bad_json"] = f"{error}: {out.getvalue()[:200]}"
        runs.append(entry)
        if last:
            break
    if os.path.exists(logpath):  # what the last reads saw, with the values
        from cockpit.history import History

        with contextlib.redirect_stderr(io.StringIO()):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    history = History.from_json(logpath)
                    final = {s: repr(float(v)) for s, v in zip(*history.series("Loss"))}
                except Exception as error:  # noqa: BLE001
                    final = {"error": f"{type(error).__name__}: {error}"}
    else:
        final = {}
    with open(result, "w") as handle:
        json.dump({"runs": runs, "final": final}, handle)


def run(
    seed: int,
    folder: str,
    seconds: float = 60.0,
    second: bool | None = None,
    replace: bool | None = None,
) -> dict[str, Any]:
    """Play the scenario of ``seed`` in ``folder``; return what happened.

    Args:
        seed: Draws the scenario: whether a second writer tries the path while
            the first writes, whether a new run replaces the log, after how many
            steps and how long after a step each writer is killed.
        folder: Where the log, the writers' reports and the reader's go.
        seconds: The longest wait for any process.
        second: Instead of the seed's choice, whether a second writer tries.
        replace: Instead of the seed's choice, whether a new run follows.
    """
    from tests.utils.ddp import _start_method

    rng = random.Random(seed)
    context = _start_method()
    logpath = os.path.join(folder, "run", "log")
    stop = os.path.join(folder, "stop")
    result = os.path.join(folder, "reader.json")
    events: list[str] = []
    reader_process = context.Process(
        target=reader, args=(logpath + ".jsonl", stop, result, seed)
    )
    writers: list[dict[str, Any]] = []

    def start_writer() -> dict[str, Any]:
        report = os.path.join(folder, f"writer{len(writers)}.txt")
        process = context.Process(
            target=writer, args=(logpath, report, rng.randrange(2**31))
        )
        process.start()
        found = {"process": process, "report": report, "started": time.time()}
        writers.append(found)
        events.append(f"writer {len(writers) - 1} started (pid {process.pid})")
        return found

    def started(found) -> bool:
        text = open(found["report"]).read() if os.path.exists(found["report"]) else ""
        return "started" in text or "refused" in text

    def kill_after(found, steps: int) -> None:
        _wait_for(lambda: len(_done_steps(found["report"])) >= steps, seconds)
        time.sleep(rng.uniform(0.0, 0.03))  # somewhere inside a step
        found["process"].kill()
        found["process"].join(seconds)
        found["killed"] = time.time()
        done = _done_steps(found["report"])
        events.append(f"killed after {len(done)} steps ({steps} asked)")

    reader_first = rng.random() < 0.5
    if reader_first:
        reader_process.start()
    first = start_writer()
    if not reader_first:
        time.sleep(rng.uniform(0.0, 0.3))
        reader_process.start()
    _wait_for(lambda: started(first), seconds)
    tries, again = rng.random() < 0.5, rng.random() < 0.6
    tries = tries if second is None else second
    again = again if replace is None else replace
    second = None
    if tries:  # a second Cockpit on the same path, while the first runs
        after = rng.randint(0, 3)
        _wait_for(lambda: len(_done_steps(first["report"])) >= after, seconds)
        second = start_writer()
        second["process"].join(seconds)
        events.append(f"second writer exited with {second['process'].exitcode}")
    kill_after(first, rng.randint(*KILL_STEPS))
    if again:  # a new run replaces the log, and is killed too
        time.sleep(rng.uniform(0.0, 0.3))
        third = start_writer()
        _wait_for(lambda: started(third), seconds)
        kill_after(third, rng.randint(*KILL_STEPS))
    time.sleep(rng.uniform(0.0, 0.2))
    open(stop, "w").close()
    reader_process.join(seconds + 60)
    if reader_process.is_alive():
        reader_process.kill()
        events.append("reader hung")
    with open(result) if os.path.exists(result) else contextlib.nullcontext() as f:
        read = json.load(f) if f else {"runs": [], "final": {}}
    return {
        "seed": seed,
        "events": events,
        "writers": [
            {
                "report": w["report"],
                "exitcode": w["process"].exitcode,
                "started": w["started"],
                "killed": w.get("killed"),
                "done": _done_steps(w["report"]),
                "text": open(w["report"]).read() if os.path.exists(w["report"]) else "",
            }
            for w in writers
        ],
        "second": second is not None,
        "reader": read,
    }


#: What a reader command may say instead of drawing or reporting: no step yet, or
#: a new run rewrote the log while it was read (and, before the first writer made
#: the file, that there is none).
ALLOWED = ("is empty", "holds no tracked step", "changed while it was read")


def problems(outcome: dict[str, Any]) -> list[str]:
    """What went wrong in a scenario (empty: nothing)."""
    found: list[str] = []
    writers = outcome["writers"]
    runs = outcome["reader"]["runs"]
    if not runs:
        found.append("the reader ran no command")
    if outcome["second"]:
        refused = writers[1]
        holder = writers[0]
        pid = holder["text"].split("started ", 1)[1].split()[0]  # its pid
        if refused["exitcode"] != 3 or f"process {pid}" not in refused["text"]:
            found.append(f"the second writer was not refused naming {pid}: {refused}")
    for entry in runs:
        said = entry["stderr"]
        if "Traceback" in said or entry["rc"] not in (0, 1):
            found.append(f"{entry['command']} crashed: {said[-2000:]}")
        elif entry["rc"] == 1 and "no such file" in said:
            began = _rewrites(writers[0])  # the first Cockpit makes the file
            if began is None or entry["start"] > began[0]:
                found.append(f"{entry['command']}: no file after it was made")
        elif entry["rc"] == 1 and not any(text in said for text in ALLOWED):
            found.append(f"{entry['command']} failed: {said.strip()}")
        elif entry["rc"] == 1 and "changed while" in said:
            # only while a new run started writing the log (its first record)
            spans = [_rewrites(w) for w in writers[1:] if w["exitcode"] != 3]
            if not any(
                span and span[0] - 0.5 <= entry["end"] and entry["start"] <= span[1]
                for span in spans
            ):
                found.append(f"{entry['command']}: changed, but no run restarted")
        if "bad_json" in entry:
            found.append(f"report printed no JSON: {entry['bad_json']}")
    last = [e for e in runs if e["last"]]
    if not last or last[-1]["rc"] != 0:
        found.append(f"the read after the last kill failed: {last[-1:]}")
    final = outcome["reader"]["final"]
    running = [w for w in writers if w["exitcode"] != 3]  # runs that wrote the log
    if running and "error" in final:
        found.append(f"the log cannot be read at the end: {final['error']}")
    elif running:
        done = running[-1]["done"]  # the log holds the last run
        for step, loss, _ in done:
            got = final.get(str(step), final.get(step))
            if (
                got is None
                or float(got) != float(loss)
                and not (math.isnan(float(got)) and math.isnan(float(loss)))
            ):
                found.append(f"step {step}: logged {got}, the run had {loss}")
        steps = sorted(int(s) for s in final)
        if steps != list(range(len(steps))):
            found.append(f"the log's steps have gaps: {steps}")
    return found


def summary(outcome: dict[str, Any]) -> str:
    """One line per event, for a failure message."""
    runs = outcome["reader"]["runs"]
    counts = {}
    for entry in runs:
        key = (entry["command"], entry["rc"])
        counts[key] = counts.get(key, 0) + 1
    steps = [len(w["done"]) for w in outcome["writers"]]
    return (
        f"seed {outcome['seed']}: {'; '.join(outcome['events'])}; steps {steps}; "
        f"reader {counts}"
    )
