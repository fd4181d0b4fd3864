"""``cockpit serve``: the live dashboard, its incremental reader, its safety, its CLI.

* The reader (:class:`cockpit.serve.live.LiveRun`) against the CLI's: the series it
  builds from the appended bytes equal those :func:`cockpit.log.files.open_log`
  and the dashboard's reductions give for the whole file; a line still being
  written waits; a resume marker voids later steps; a long series is thinned to
  a bounded size keeping its extremes.
* Live, in headless Chromium: training processes append to their streams (the
  real :class:`~cockpit.log.stream.LogStream`), ``cockpit serve`` runs as the
  user runs it; the page's step count grows without a reload, a second run
  appears while both write, a finished run says so; Ctrl-C ends it cleanly.
* Safe: ``..``, absolute paths, links leading out of the served folder, a huge
  binary ``.jsonl``, a foreign ``.json``, a log deleted while served, methods
  that write, a foreign ``Host``: each answered with an error status, the server
  up after each, and (an audit hook in the server's process) no file outside the
  served folder opened.
* CLI manners: a missing path and a port in use exit 1 with one line.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse

import numpy as np
import pytest

from cockpit.log.files import open_log
from cockpit.log.stream import LogStream, record_line
from cockpit.plotting.data import DashboardData
from cockpit.serve.live import LiveRun, Points
from tests.utils.browser import Browser, find_chromium

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")

needs_chromium = pytest.mark.skipif(
    find_chromium() is None,
    reason="chromium is not installed (Debian: apt-get install -y chromium; "
    ".ci/run installs it)",
)

#: A training process: appends one record per step to its stream with the
#: writer every Cockpit uses (lock included), ``pause`` seconds apart, until the
#: file ``<log>.stop`` appears.
WRITER = """
import math, os, sys, time
import numpy as np
from cockpit.log.stream import LogStream
path, pause = sys.argv[1], float(sys.argv[2])
rng = np.random.default_rng(len(path))
stream = LogStream(path)
edges = np.linspace(-1, 1, 21)
t = 0
while not os.path.exists(path + ".stop"):
    stream.write({t: {
        "Loss": 2 * math.exp(-t / 50) + 0.05 * rng.random(),
        "GradNorm": (rng.random(3) + 0.5).tolist(),
        "Alpha": float(rng.normal(0, 0.3)),
        "learning_rates": [0.1],
        "GradHist1d": {"hist": np.histogram(rng.normal(0, 0.3, 200), edges)[0]
                       .tolist(), "edges": edges.tolist()},
    }})
    t += 1
    time.sleep(pause)
stream.close()
"""


def _values(t: int, rng) -> dict:
    return {
        "Loss": float(math.exp(-t / 30) + 0.1 * rng.random()),
        "GradNorm": (rng.random(3) + 0.1).tolist(),
        "Alpha": float(rng.normal()),
        "UpdateSize": (0.01 * rng.random(3)).tolist(),
        "learning_rates": [0.1, 0.01],
    }


# --- the reader -----------------------------------------------------------------------
def test_appended_bytes_give_the_series_of_the_whole_file(tmp_path):
    path = str(tmp_path / "run.jsonl")
    rng = np.random.default_rng(0)
    stream = LogStream(path)
    run = LiveRun(path, "run.jsonl", 0)
    for t in range(120):
        stream.write({t: _values(t, rng)})
        if t % 17 == 0:
            run.poll(set())
    stream.close()
    with open(path, "ab") as handle:  # a record still being written: waits
        handle.write(record_line(120, _values(120, rng))[:40].encode())
    run.poll(set())
    assert run.last_step == 119 and run.error is None
    with pytest.warns(UserWarning, match="torn last record"):
        data = DashboardData(open_log(path))
    data.refresh()
    for key, reduce in [("Loss", "scalar"), ("GradNorm", "norm"),
                        ("UpdateSize", "norm")]:  # fmt: skip
        want = data.series(key, reduce)
        got = run.payload()["series"][f"{key}|{reduce}"]
        assert got["steps"] == want.steps.tolist()
        # six significant digits, as the HTML file writes them
        assert got["values"] == pytest.approx(want.values.tolist(), rel=5e-6)
    rates = run.payload()["series"]["learning_rates#1"]
    assert set(rates["values"]) == {0.01} and len(rates["steps"]) == 120
    with open(path, "ab") as handle:  # the rest of the torn line, then a resume
        handle.write(record_line(120, _values(120, rng))[40:].encode())
        handle.write(b'{"resume_after":99}\n')
    epoch = run.epoch
    run.poll(set())
    loss = run.payload()["series"]["Loss|scalar"]
    assert loss["steps"][-1] == 99 and run.epoch > epoch  # the page refetches


def test_points_stay_bounded_and_keep_the_extremes():
    rng = np.random.default_rng(1)
    values = rng.normal(size=50_000)
    values[12_345] = 40.0  # a spike, and a dip
    values[33_333] = -40.0
    points = Points(limit=500)
    for step, value in enumerate(values):
        points.add(step, float(value))
        assert len(points) <= 2 * 500 + 2 * points.stride
    part = points.part(0)
    assert 40.0 in part["values"] and -40.0 in part["values"]
    assert part["steps"] == sorted(part["steps"]) and part["steps"][-1] == 49_999
    # in arrays at once: the very same points
    for sample in (False, True):
        one, many = Points(limit=500, sample=sample), Points(limit=500, sample=sample)
        for step, value in enumerate(values):
            one.add(step, float(value))
        steps = np.arange(len(values))
        for part_steps in np.array_split(steps, 7):
            many.extend(
                part_steps, values[part_steps], np.full(len(part_steps), np.nan)
            )
        assert many.part(0) == one.part(0) and many.stride == one.stride
    # even density: each point stands for about as many steps early and late
    gaps = np.diff(part["steps"][: points.n])
    assert gaps[: len(gaps) // 4].mean() == pytest.approx(
        gaps[-len(gaps) // 4 :].mean(), rel=0.35
    )


# --- a server as a user starts it -----------------------------------------------------
def _serve(args: list[str], audit: str | None = None) -> subprocess.Popen:
    """``cockpit serve ARGS`` in a process (``audit``: file of the paths it opens)."""
    code = "import sys\n"
    if audit is not None:
        code += (
            f"_log = open({audit!r}, 'a', buffering=1)\n"
            "def _hook(event, args):\n"
            "    if event == 'open' and isinstance(args[0], str):\n"
            "        _log.write(args[0] + '\\n')\n"
            "sys.addaudithook(_hook)\n"
        )
    code += "from cockpit.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.Popen(
        [sys.executable, "-c", code, "serve", *args], env=ENV,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait_url(process: subprocess.Popen) -> str:
    line = process.stdout.readline()
    found = re.search(r"(http://\S+/)", line)
    assert found, (line, process.stderr.read() if process.poll() is not None else "")
    return found[1]


def _get(url: str, path: str, host: str | None = None, method: str = "GET"):
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=20)
    headers = {} if host is None else {"Host": host}
    connection.putrequest(method, path, skip_host=host is not None)
    for name, value in headers.items():
        connection.putheader(name, value)
    connection.endheaders()
    reply = connection.getresponse()
    body = reply.read()
    connection.close()
    return reply.status, body


def _wait(condition, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@needs_chromium
def test_live_page_grows_a_second_run_appears_and_ctrl_c_ends_it(tmp_path):
    root = tmp_path / "runs"
    (root / "lr=0.1").mkdir(parents=True)
    logs = [root / "lr=0.1" / "log.jsonl", root / "lr=0.3" / "log.jsonl"]
    first = subprocess.Popen([sys.executable, "-c", WRITER, str(logs[0]), "0.05"],
                             env=ENV)  # fmt: skip
    server = _serve([str(root), "--port", "0"])
    second = None
    (root / "lr=0.3").mkdir()
    try:
        url = _wait_url(server)
        with Browser(width=1400, height=1000) as browser:
            browser.open(url)
            browser.evaluate("window.notReloaded = true")
            steps = "cockpit.runs().map(r => r.last_step)"
            early = _wait(lambda: (browser.evaluate(steps) or [None])[0], what="steps")
            second = subprocess.Popen([sys.executable, "-c", WRITER, str(logs[1]),
                                       "0.05"], env=ENV)  # fmt: skip
            both = _wait(lambda: (lambda s: len(s) == 2 and s[1] is not None and s)(
                browser.evaluate(steps)), what="the second run")  # fmt: skip
            assert both[0] > early  # new steps without a reload
            assert browser.evaluate("window.notReloaded") is True
            # both drawn while both write: each run's points on the loss chart
            drawn = _wait(lambda: browser.evaluate(
                "(() => { const p = cockpit.gauges.performance; if (!p) return null;"
                " const runs = new Set(p.parts.map(q => q.run));"
                " return runs.size === 2 && cockpit.runs().map(r => r.status); })()"
            ), what="both runs drawn")  # fmt: skip
            assert drawn == ["live", "live"], drawn
            for log, writer in zip(logs, (first, second)):
                open(f"{log}.stop", "w").close()
                writer.wait(timeout=60)
            last = [open_log(log).steps[-1] for log in logs]
            _wait(lambda: browser.evaluate(
                "cockpit.runs().every(r => r.status === 'finished' && r.diagnosis"
                " === 'report') && document.querySelectorAll("
                "'.runtable td.status.finished').length === 2"),
                timeout=40, what="finished runs")  # fmt: skip
            counts = browser.evaluate(steps)
            assert counts == last
            assert browser.evaluate("window.notReloaded") is True
            browser.screenshot(tmp_path / "live.png")
            assert browser.errors() == []
        server.send_signal(signal.SIGINT)
        out, err = server.communicate(timeout=20)
        assert server.returncode == 0, err
        assert "stopped" in out and "Traceback" not in err
    finally:
        for process in (first, second, server):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


# --- safety ---------------------------------------------------------------------------
def test_only_the_dashboard_and_served_logs_are_answered(tmp_path):
    root, secret = tmp_path / "runs", tmp_path / "secret"
    root.mkdir()
    secret.mkdir()
    rng = np.random.default_rng(2)
    outside = secret / "outside.jsonl"
    stream = LogStream(str(outside))
    stream.write({0: {"Loss": 0.123456789}})
    stream.close()
    stream = LogStream(str(root / "good.jsonl"))
    for t in range(30):
        stream.write({t: _values(t, rng)})
    stream.close()
    doomed = LogStream(str(root / "doomed.jsonl"))
    doomed.write({0: _values(0, rng)})
    doomed.close()
    os.symlink(outside, root / "link.jsonl")  # a link leading out
    os.symlink(secret, root / "folder_link")
    with open(root / "huge.jsonl", "wb") as handle:  # 2 GiB, sparse, binary
        handle.truncate(2 << 30)
    (root / "config.json").write_text('{"lr": 0.1}')  # not a log: not listed
    (root / "torn.jsonl").write_bytes(b'{"format":"cockpit-log-stream","ver')
    audit = tmp_path / "opened.txt"
    server = _serve([str(root), "--port", "0", "--host", "127.0.0.2"], str(audit))
    try:
        url = _wait_url(server)
        assert "warning: listening on 127.0.0.2" in server.stderr.readline()

        def runs():
            status, body = _get(url, "/api/runs")
            assert status == 200
            return {r["path"]: r for r in json.loads(body)["runs"]}

        listed = _wait(lambda: (lambda r: r if r["good.jsonl"]["steps"] == 30 and
                                r["huge.jsonl"]["status"] == "error" else None)(runs()),
                       what="the logs read")  # fmt: skip
        assert set(listed) == {"good.jsonl", "doomed.jsonl", "huge.jsonl", "torn.jsonl"}
        assert "not a cockpit log" in listed["huge.jsonl"]["error"]
        os.remove(root / "doomed.jsonl")
        gone = _wait(lambda: runs()["doomed.jsonl"]["error"], what="deleted")
        assert "deleted" in gone
        answers = {}
        for path in ["/logs/../secret/outside.jsonl",
                     "/logs/%2e%2e/secret/outside.jsonl",
                     "/logs/" + str(outside), "/logs//" + str(outside),
                     "/logs/link.jsonl", "/logs/folder_link/outside.jsonl",
                     "/../secret/outside.jsonl", str(outside), "/etc/passwd",
                     "/logs/", "/api/run/99", "/api/run/-1", "/api/run/..%2f1",
                     f"/api/run/{listed['huge.jsonl']['id']}",
                     f"/api/run/{listed['doomed.jsonl']['id']}", "/logs/huge.jsonl",
                     "/logs/doomed.jsonl", "/api/run/0?have=[1]"]:  # fmt: skip
            answers[path] = _get(url, path)
        for path, (status, body) in answers.items():
            assert 400 <= status < 500, (path, status)
            assert b"0.123456789" not in body, path
        assert answers["/logs/../secret/outside.jsonl"][0] == 400
        assert answers[f"/api/run/{listed['huge.jsonl']['id']}"][0] == 422
        assert _get(url, "/", method="POST")[0] == 405
        assert _get(url, "/api/runs", method="DELETE")[0] == 405
        assert _get(url, "/", host="evil.example:80")[0] == 403  # DNS rebinding
        status, body = _get(url, "/logs/good.jsonl")  # a served log: its bytes
        assert status == 200 and body == (root / "good.jsonl").read_bytes()
        status, body = _get(url, "/")
        assert status == 200 and b"cockpit-data" in body
        assert runs()["good.jsonl"]["status"] == "finished"  # still up
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=20)
    opened = [p for p in audit.read_text().splitlines() if p]
    assert opened  # the hook saw the logs read
    real_secret = os.path.realpath(secret)
    assert not [p for p in opened if os.path.realpath(p).startswith(real_secret)]


# --- CLI manners ----------------------------------------------------------------------
def test_missing_path_and_port_in_use_exit_with_one_line(tmp_path):
    missing = tmp_path / "nothing"
    done = subprocess.run([sys.executable, "-m", "cockpit", "serve", str(missing)],
                          env=ENV, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "Fix:" in lines[0], lines
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "cockpit", "serve", str(tmp_path), "--port",
             str(port)], env=ENV, capture_output=True, text=True,
        )  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"port {port}" in lines[0] and "--port" in lines[0], lines


def test_the_two_line_recipe_serves_from_a_thread(tmp_path, capsys):
    """README.md and docs/serve.md: ``start(folder, port=...)`` in the script."""
    recipe = open(os.path.join(REPO, "docs", "serve.md"), encoding="utf-8").read()
    assert 'from cockpit.serve import start\nstart("runs", port=6007)' in recipe
    from cockpit.serve import start

    stream = LogStream(str(tmp_path / "log.jsonl"))
    stream.write({0: {"Loss": 1.5}})
    server = start(str(tmp_path), port=0)
    try:
        assert server.url in capsys.readouterr().out
        status, body = _get(server.url, "/api/runs")
        assert status == 200 and json.loads(body)["runs"][0]["path"] == "log.jsonl"
    finally:
        server.shutdown()
        stream.close()
