"""The HTTP server of ``cockpit serve``: the dashboard page and its data, read-only.

Standard library only (:class:`http.server.ThreadingHTTPServer`): the page asks
for little (the run list once a second, then the points added to the runs it
shows), so a thread per request is plenty, and no dependency is added.

What it answers (``GET`` and ``HEAD`` only; every other method is refused with
405, there is nothing to write):

* ``/``: the dashboard page (:mod:`cockpit.plotting.html`, in live mode);
* ``/api/runs``: the run list (status, steps, error line) and, when it changed,
  the gauges to show;
* ``/api/run/<id>?epoch=E&have={...}``: one run's data, or only what was added
  since what the page holds (see :meth:`cockpit.serve.live.LiveRun.payload`);
  422 for a run whose log cannot be read (the error line is in the list);
* ``/logs/<name>``: a served log file itself, by the name the run list shows.

Nothing else: no listing, no other file. A ``<name>`` is looked up among the
runs found (never joined to a folder), and the file's real path is checked
again, at each request, to lie inside a served path. The ``Host`` header must
name the address the server listens on or ``localhost`` (a page of another site
cannot reach it through DNS rebinding).
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

from cockpit.errors import CockpitWarning
from cockpit.serve.discover import MAX_RUNS, find_logs, inside, writers
from cockpit.serve.live import LiveRun

#: Seconds between two reads of the logs.
POLL_SECONDS = 1.0

#: Seconds between two searches for new logs in the served folders.
SCAN_SECONDS = 3.0

_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src data: blob:; connect-src 'self'; base-uri 'none'; form-action 'none'"
)


def run_color(index: int) -> str:
    """The colour of run ``index``: the PNG's palette, then hues spread apart."""
    from cockpit.plotting.runs import RUN_COLORS

    if index < len(RUN_COLORS):
        return RUN_COLORS[index]
    import colorsys

    hue = (index * 0.618033988749895) % 1.0
    r, g, b = colorsys.hls_to_rgb(hue, 0.42, 0.75)
    return "#{:02x}{:02x}{:02x}".format(*(int(255 * c) for c in (r, g, b)))


def _label(rel: str) -> str:
    """A run's name: its path without the suffix, ``log`` files by their folder."""
    stem = rel.rsplit(".", 1)[0]
    head, _, tail = stem.rpartition("/")
    return head if head and tail in ("log", "cockpit", "logfile") else stem


class Registry:
    """The runs under the served paths, kept up to date by :meth:`poll`."""

    def __init__(self, paths: Sequence[str], title: str | None = None):
        self.paths = [os.path.abspath(p) for p in paths]
        self.roots = [os.path.realpath(p) for p in self.paths]
        self.runs: list[LiveRun] = []
        self.by_name: dict[str, LiveRun] = {}
        self._known: set[str] = set()
        self.lock = threading.Lock()
        self.title = title or "Cockpit: " + ", ".join(
            os.path.basename(p.rstrip("/")) or p for p in paths
        )
        self._frame: tuple[Any, dict] | None = None
        self.last_scan = 0.0
        self.full = False
        self.caught_up = False  # every log read up to its end (at the last poll)

    # --- finding and reading -------------------------------------------------------
    def scan(self) -> None:
        """Add the logs that appeared under the served paths."""
        several = len(self.paths) > 1
        for given in self.paths:
            prefix = (os.path.basename(given.rstrip("/")) + "/") if several else ""
            for path, rel in find_logs(given):
                real = os.path.realpath(path)
                if real in self._known:
                    continue
                if len(self.runs) >= MAX_RUNS:
                    if not self.full:
                        self.full = True
                        warnings.warn(f"more than {MAX_RUNS} logs: the rest are "
                                      "not served. Fix: serve fewer folders.",
                                      CockpitWarning, stacklevel=2)  # fmt: skip
                    return
                name = prefix + rel if os.path.isdir(given) else rel
                while name in self.by_name:
                    name = "_" + name
                run = LiveRun(path, name, len(self.runs))
                run.label = _label(name)
                run.color = run_color(run.index)
                run.root = os.path.realpath(given if os.path.isdir(given) else
                                            os.path.dirname(given))  # fmt: skip
                run.given = not os.path.isdir(given)
                with self.lock:
                    self.runs.append(run)
                    self.by_name[name] = run
                    self._known.add(real)
        self.last_scan = time.monotonic()

    def poll(self) -> bool:
        """Read every log's new bytes; ``True`` if any run changed."""
        if time.monotonic() - self.last_scan >= SCAN_SECONDS:
            self.scan()
        held = writers()
        # in the order of the run list (the page draws its first runs first)
        order = list(self.runs)
        changed = False
        for run in order:
            changed |= run.poll(held)
        self.caught_up = all(
            r.error is not None or not r.pending_bytes() for r in order
        )
        return changed

    def diagnose(self) -> bool:
        """Diagnose a little more (the runs the page shows first); ``True``: done some.

        A finished run gets the report of the whole run (:func:`diagnose`, as
        ``cockpit report``), a live one its live diagnosis, behind the reader.
        """
        if not self.caught_up:
            return False  # the charts first: diagnose once every log is read
        order = sorted(self.runs, key=lambda r: (not r.wanted, r.index))
        for run in order:
            if run.error is not None or not run.steps or run.report is not None:
                continue
            if run.status == "finished":
                try:
                    run.run_report()
                except Exception:  # a report that fails leaves the live findings
                    run.report = []
                return True
            if run.diagnose_some():
                return True
            if run.diag_offset < run.offset:
                return True
        return False

    # --- answers ---------------------------------------------------------------------
    def frame(self) -> tuple[str, dict]:
        """``(key, gauges and layout)`` of the page for the runs read so far."""
        with_steps = [r for r in self.runs if r.steps and r.error is None]
        signature = tuple(sorted({k for r in with_steps for k in r.sketch})) + tuple(
            sorted(r.layer_count() for r in with_steps)
        )
        if self._frame is not None and self._frame[0] == signature:
            return self._frame[1]["key"], self._frame[1]
        from cockpit.plotting import CockpitPlotter
        from cockpit.plotting.html import frame as page_frame

        if with_steps:
            plotter = CockpitPlotter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plotter.load([r.sketch_history() for r in with_steps],
                             labels=[r.label for r in with_steps])  # fmt: skip
            layout, left_out = plotter.layout(), plotter.left_out("primary")
        else:
            layout, left_out = ((), ("findings",), (), False), []
        found = page_frame(layout, self.title, True, left_out)
        found["key"] = str(abs(hash(signature)))
        self._frame = (signature, found)
        return found["key"], found

    def listing(self, frame_key: str | None) -> dict:
        """The run list, with the frame when the page's one is out of date."""
        key, frame = self.frame()
        runs = []
        for run in list(self.runs):
            item = run.summary()
            item.update(label=run.label, color=run.color, config=run.config())
            runs.append(item)
        answer = {"runs": runs, "frame_key": key, "time": time.time()}
        if frame_key != key:
            answer["frame"] = frame
        return answer

    def page(self) -> str:
        """The dashboard page in live mode."""
        from cockpit.plotting.html import render

        _, frame = self.frame()
        data = dict(frame, runs=[], live={"interval": int(POLL_SECONDS * 1000)})
        return render(data)

    def log_file(self, name: str) -> str | None:
        """The file of a served log by its name, if it is still inside its folder."""
        run = self.by_name.get(name)
        if run is None:
            return None
        real = os.path.realpath(run.path)
        if not run.given and not inside(real, run.root):
            return None
        return real if os.path.isfile(real) else None


class Handler(BaseHTTPRequestHandler):
    """Answers the page's requests (see the module docstring)."""

    server_version = "cockpit-serve"
    registry: Registry
    allowed_hosts: frozenset

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """Quiet: no line per request."""

    # --- replies ---------------------------------------------------------------------
    def _send(self, status: int, body: bytes, kind: str, extra=None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", _CSP)
        self.send_header("Referrer-Policy", "no-referrer")
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, value: Any) -> None:
        body = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
        self._send(status, body, "application/json")

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": message})

    def _refuse(self) -> None:
        self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815

    def do_HEAD(self) -> None:  # noqa: N802
        """As GET, without the body."""
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        """Route a request."""
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]").lower()
        if self.allowed_hosts and host not in self.allowed_hosts:
            self._error(HTTPStatus.FORBIDDEN, "unknown Host header")
            return
        try:
            self._route()
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as error:  # a bug: answered, never the end of the server
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR,
                        f"{type(error).__name__}: {error}")  # fmt: skip

    def _route(self) -> None:
        parts = urlsplit(self.path)
        path = parts.path
        query = parse_qs(parts.query)
        registry = self.registry
        if path in ("/", "/index.html"):
            body = registry.page().encode("utf-8")
            self._send(HTTPStatus.OK, body, "text/html; charset=utf-8")
        elif path == "/api/runs":
            frame = query.get("frame", [None])[0]
            self._json(HTTPStatus.OK, registry.listing(frame))
        elif path.startswith("/api/run/"):
            self._run(path[len("/api/run/") :], query)
        elif path.startswith("/logs/"):
            self._log(unquote(path[len("/logs/") :]))
        else:
            self._error(HTTPStatus.NOT_FOUND, "not found")

    def _run(self, ident: str, query: dict) -> None:
        runs = self.registry.runs
        if not ident.isdigit() or int(ident) >= len(runs):
            self._error(HTTPStatus.NOT_FOUND, "no such run")
            return
        run = runs[int(ident)]
        if run.error is not None:
            self._error(HTTPStatus.UNPROCESSABLE_ENTITY, f"{run.rel}: {run.error}")
            return
        try:
            epoch = int(query.get("epoch", ["-1"])[0])
            have = json.loads(query.get("have", ["{}"])[0])
            if not isinstance(have, dict):
                raise ValueError("have must be an object")
        except ValueError as error:
            self._error(HTTPStatus.BAD_REQUEST, f"bad query ({error})")
            return
        answer = run.payload(epoch, have)
        answer.update(label=run.label, color=run.color)
        self._json(HTTPStatus.OK, answer)

    def _log(self, name: str) -> None:
        if "\0" in name or name.startswith("/") or ".." in name.split("/"):
            self._error(HTTPStatus.BAD_REQUEST, "a log name, not a path")
            return
        run = self.registry.by_name.get(name)
        if run is not None and run.error is not None:
            self._error(HTTPStatus.UNPROCESSABLE_ENTITY, f"{name}: {run.error}")
            return
        real = self.registry.log_file(name)
        if real is None:
            self._error(HTTPStatus.NOT_FOUND, "no such log")
            return
        try:
            handle = open(real, "rb")  # noqa: SIM115
        except OSError:
            self._error(HTTPStatus.NOT_FOUND, "no such log")
            return
        with handle:
            size = os.fstat(handle.fileno()).st_size
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.send_header("X-Content-Type-Options", "nosniff")
            base = os.path.basename(name).replace('"', "")
            self.send_header("Content-Disposition", f'attachment; filename="{base}"')
            self.end_headers()
            if self.command != "HEAD":
                left = size
                while left > 0:
                    chunk = handle.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    left -= len(chunk)


class Server:
    """``cockpit serve`` in a process: the registry, its poller and the server.

    Args:
        paths: Folders (searched at any depth) and log files.
        port: TCP port (0: a free one, see :attr:`port`).
        host: Address to listen on (default: this machine only).
        title: The page's title.

    Raises:
        OSError: If the port cannot be bound (``errno.EADDRINUSE``: in use).
    """

    def __init__(self, paths: Sequence[str], port: int = 6007,
                 host: str = "127.0.0.1", title: str | None = None):  # fmt: skip
        self.registry = Registry(paths, title)
        self.registry.scan()
        allowed = {"localhost", "127.0.0.1", "::1"}
        if host not in ("0.0.0.0", "::", ""):
            allowed.add(host.lower())
        handler = type("BoundHandler", (Handler,), {
            "registry": self.registry,
            "allowed_hosts": frozenset() if host in ("0.0.0.0", "::", "")
            else frozenset(allowed),
        })  # fmt: skip
        server_class = ThreadingHTTPServer
        if ":" in host:
            import socket

            server_class = type("Server6", (ThreadingHTTPServer,),
                                {"address_family": socket.AF_INET6})  # fmt: skip
        self.httpd = server_class((host, port), handler)
        self.httpd.daemon_threads = True
        self.host = host
        self.port = self.httpd.server_address[1]
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True,
                                        name="cockpit-serve-poll")  # fmt: skip
        self._diagnoser = threading.Thread(target=self._diagnose, daemon=True,
                                           name="cockpit-serve-diagnosis")  # fmt: skip
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The page's address."""
        host = "localhost" if self.host in ("127.0.0.1", "0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/"

    def _poll(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.registry.poll()
            except Exception:  # never the end of the server (each run keeps its own)
                pass
            self._stop.wait(max(0.05, POLL_SECONDS - (time.monotonic() - started)))

    def _diagnose(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.registry.diagnose()
            except Exception:  # never the end of the server
                busy = False
            self._stop.wait(0.01 if busy else POLL_SECONDS)

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown` (or Ctrl-C in the calling thread)."""
        if not self._poller.is_alive():
            self._poller.start()
            self._diagnoser.start()
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> Server:
        """Serve from a background thread (for a training script); returns self."""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True,
                                        name="cockpit-serve")  # fmt: skip
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop serving and release the port."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()
