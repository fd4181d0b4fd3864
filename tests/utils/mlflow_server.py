"""A real MLflow tracking server on localhost for the tests (SQLite, local artifacts).

``mlflow server`` is started on a free port with a SQLite backend store and a local
folder behind its artifact proxy, without MLflow's job execution (by default the
server starts a job runner and seven huey consumers, eight more interpreters that
import MLflow, for jobs these tests never submit); :func:`mlflow_server` waits
(bounded) until its ``/health`` answers and kills the server's process group at
the end (at once: its store is the test's folder; a graceful stop cost several
seconds).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

#: Longest wait for the server to answer, in seconds.
START_TIMEOUT = 240.0


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(folder: str):
    """Run ``mlflow server`` with its store in ``folder``; yield its URI."""
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    command = [
        os.path.join(os.path.dirname(sys.executable), "mlflow"), "server",
        "--backend-store-uri", f"sqlite:///{os.path.join(folder, 'mlflow.db')}",
        "--artifacts-destination", os.path.join(folder, "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    log = open(os.path.join(folder, "server.log"), "wb")
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if server.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with {server.returncode} at start-up; "
                    f"see {log.name}"
                )
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not answer within {START_TIMEOUT:.0f} s; "
                    f"see {log.name}"
                )
            time.sleep(0.25)
        yield uri
    finally:  # the store is the test's own folder: nothing to shut down cleanly
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()
