"""The ``cockpit serve`` subcommand (wired into :mod:`cockpit.cli`)."""

from __future__ import annotations

import argparse
import errno
import os
import sys

from cockpit.errors import LogFileError


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 0 and 65535, got {text}")
    return value


def _serve(args: argparse.Namespace) -> int:
    from cockpit.serve.server import Server

    for path in args.path:
        if not os.path.exists(path):
            raise LogFileError(
                path,
                "no such file or folder. Fix: pass the folder your runs write "
                "their logs to (Cockpit(..., logpath=...)), or a log file.",
            )
    try:
        server = Server(args.path, port=args.port, host=args.host, title=args.title)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise OSError(
                f"port {args.port} on {args.host} is in use (another cockpit serve "
                f"or TensorBoard?). Fix: pass another port, e.g. --port "
                f"{args.port + 1}, or --port 0 for any free one"
            ) from None
        raise
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"cockpit serve: warning: listening on {args.host}: anyone who can "
              f"reach this machine on port {server.port} can read these logs",
              file=sys.stderr)  # fmt: skip
    count = len(server.registry.runs)
    print(f"cockpit serve: {count} log{'s' * (count != 1)} under "
          f"{', '.join(args.path)}; the dashboard is at {server.url} "
          "(Ctrl-C to stop)", flush=True)  # fmt: skip
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("cockpit serve: stopped", flush=True)
    finally:
        server.shutdown()
    return 0


def add_serve_parser(sub) -> None:
    """Add ``cockpit serve`` to the subcommands of :mod:`cockpit.cli`."""
    serve = sub.add_parser(
        "serve",
        help="serve the live dashboard of the runs under folders or logs (like "
        "tensorboard --logdir), updated while they write",
    )
    serve.add_argument(
        "path", nargs="+",
        help="folders (searched at any depth for .jsonl/.json logs) or log files",
    )  # fmt: skip
    serve.add_argument("--port", type=_port, default=6007,
                       help="TCP port (default 6007; 0: any free one)")  # fmt: skip
    serve.add_argument(
        "--host", default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; forward "
        "the port with ssh -L to watch from yours)",
    )  # fmt: skip
    serve.add_argument("--title", default=None, help="page title")
    serve.set_defaults(func=_serve)
