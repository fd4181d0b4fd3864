"""A small driver of headless Chromium over the DevTools protocol (stdlib only).

Chromium is started with ``--remote-debugging-pipe``: commands go to its file
descriptor 3 and answers come from 4, as JSON messages ended by a NUL byte, so no
port is opened and no websocket library is needed. Used by the tests of the HTML
dashboard (``tests/plotting/test_html_dashboard.py``).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

#: The flags of a quiet, offline, throw-away browser.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-extensions",
    "--remote-debugging-pipe",
)


def find_chromium() -> str | None:
    """The Chromium executable (Debian's ``chromium`` package), if installed."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol.

    Args:
        width: Window width in pixels.
        height: Window height in pixels.
        timeout: Seconds to wait for any answer or event.
    """

    def __init__(self, width: int = 1600, height: int = 1200, timeout: float = 30.0):
        executable = find_chromium()
        if executable is None:
            raise FileNotFoundError("chromium is not installed")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="cockpit-chromium-")
        to_child, self._write = os.pipe()
        self._read, from_child = os.pipe()
        # the child's ends as fds 3 and 4 (copied above 10 first, so they cannot
        # be overwritten by each other)
        child_in = fcntl.fcntl(to_child, fcntl.F_DUPFD_CLOEXEC, 10)
        child_out = fcntl.fcntl(from_child, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_child)
        os.close(from_child)

        def wire() -> None:  # in the child, before exec
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        self.process = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, close_fds=False, preexec_fn=wire,
        )  # fmt: skip
        os.close(child_in)
        os.close(child_out)
        self._buffer = b""
        self._next = 0
        self.events: list[dict] = []
        self.session = None
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        attached = self.call(
            "Target.attachToTarget", targetId=page["targetId"], flatten=True
        )
        self.session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)  # fmt: skip

    # --- the protocol ---------------------------------------------------------------
    def _message(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from chromium")
            chunk = os.read(self._read, 1 << 16)
            if not chunk:
                raise ConnectionError("chromium closed the pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, **params: Any) -> dict:
        """Send one command and return its result (events are kept in ``events``)."""
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._message()
            if answer.get("id") == self._next:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self.events.append(answer)

    def wait_for(self, method: str) -> dict:
        """Wait for an event (also one that came already)."""
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            event = self._message()
            self.events.append(event)
            if event.get("method") == method:
                return event

    # --- what the tests use ----------------------------------------------------------
    def open(self, url: str) -> None:
        """Load a page and wait until it has loaded."""
        self.events = [
            e for e in self.events if e.get("method") != "Page.loadEventFired"
        ]
        self.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", expression=expression,
                           returnByValue=True, awaitPromise=True)  # fmt: skip
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def move_mouse(self, x: float, y: float) -> None:
        """Move the pointer to a page position."""
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def screenshot(self, path: str | os.PathLike | None = None) -> bytes:
        """A PNG of the whole page (also written to ``path``)."""
        layout = self.call("Page.getLayoutMetrics")
        metrics, view = layout["cssContentSize"], layout["cssLayoutViewport"]
        clip = {"x": 0, "y": 0, "width": metrics["width"],
                "height": metrics["height"], "scale": 1}  # fmt: skip
        # beyond the viewport only when needed: that resizes the page, which
        # ends a hover (what a screenshot of hover values must keep)
        beyond = metrics["height"] > view["clientHeight"] + 1
        data = self.call("Page.captureScreenshot", format="png", clip=clip,
                         captureBeyondViewport=beyond)["data"]  # fmt: skip
        png = base64.b64decode(data)
        if path is not None:
            with open(path, "wb") as handle:
                handle.write(png)
        return png

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries so far."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                found.append(details.get("exception", {}).get("description")
                             or details.get("text", "exception"))  # fmt: skip
            elif method == "Runtime.consoleAPICalled" and params["type"] == "error":
                found.append(" ".join(str(a.get("value", a.get("description")))
                                      for a in params["args"]))  # fmt: skip
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                found.append(params["entry"]["text"])
        return found

    def close(self) -> None:
        """End the browser and remove its profile."""
        try:
            self.call("Browser.close")
        except (OSError, RuntimeError, ConnectionError, TimeoutError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
