"""Command line ``cockpit`` (also ``python -m cockpit``).

* ``cockpit demo``: train a small network on scikit-learn's digits with cockpit and
  write ``<out>/log.json`` and ``<out>/dashboard.png``.
* ``cockpit plot LOG -o out.png``: draw the dashboard of a log (ours, streamed, or
  written by cockpit-for-pytorch 1.0.2).
* ``cockpit timelapse LOG -o run.gif``: an animated GIF of the dashboard over the run.
* ``cockpit report LOG [--markdown | --json]``: what is wrong with the run
  (:mod:`cockpit.report`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


class _UserError(Exception):
    """A problem with the command's input: reported in one line, no traceback."""


def _demo(args: argparse.Namespace) -> int:
    from cockpit.demo import run_demo
    from cockpit.utils.configuration import configuration
    from cockpit.utils.schedules import linear

    try:
        quantities = configuration(args.config, track_schedule=linear(args.interval))
    except KeyError as error:
        raise _UserError(error.args[0]) from error
    out = args.out.rstrip("/\\") or "."
    result = run_demo(
        quantities,
        logpath=os.path.join(out, "log"),
        steps=args.steps,
        progress=not args.no_progress,
        dashboard=os.path.join(out, "dashboard.png"),
        live_every=args.live,
    )
    print(f"log written to {result.logpath}")
    print(f"dashboard written to {result.dashboard}")
    return 0


def _default_output(log: str, suffix: str) -> str:
    stem = os.path.splitext(os.path.basename(log))[0] or "cockpit"
    return os.path.join(os.path.dirname(log), f"{stem}_dashboard{suffix}")


def _plot(args: argparse.Namespace) -> int:
    from cockpit.plotting import CockpitPlotter

    out = args.output or _default_output(args.log, ".png")
    plotter = CockpitPlotter(secondary_screen=args.secondary is not None)
    plotter.plot(
        args.log,
        show_plot=False,
        show_log_iter=args.log_iter,
        discard=args.discard,
        plot_title=args.title,
    )
    kwargs = {} if args.dpi is None else {"dpi": args.dpi}
    for path in plotter.save(out, args.secondary, **kwargs):
        print(f"dashboard written to {path}")
    return 0


def _timelapse(args: argparse.Namespace) -> int:
    from cockpit.plotting import make_timelapse

    out = args.output or _default_output(args.log, ".gif")
    if args.frames < 1:
        raise _UserError(f"--frames must be at least 1, got {args.frames}.")
    path = make_timelapse(
        args.log,
        out,
        frames=args.frames,
        fps=args.fps,
        secondary_screen=args.secondary_screen,
        show_log_iter=args.log_iter,
        plot_title=args.title,
    )
    print(f"timelapse written to {path}")
    return 0


def _add_view_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", help="cockpit log (.json, streamed, or 1.0.2 log)")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument(
        "--log-iter", action="store_true", help="logarithmic iteration axes"
    )


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``cockpit`` command."""
    parser = argparse.ArgumentParser(
        prog="cockpit", description="cockpit: a debugger for neural network training"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="train a small network on digits with cockpit; write log and dashboard",
    )
    demo.add_argument("--out", default="cockpit_demo", help="output folder")
    demo.add_argument("--steps", type=int, default=200, help="training steps")
    demo.add_argument("--config", default="full", help="economy | business | full")
    demo.add_argument("--interval", type=int, default=1, help="track every k steps")
    demo.add_argument("--no-progress", action="store_true", help="hide progress bar")
    demo.add_argument(
        "--live",
        type=int,
        default=0,
        metavar="K",
        help="update a live dashboard window every K steps (0: off)",
    )
    demo.set_defaults(func=_demo)

    plot = sub.add_parser("plot", help="draw the dashboard of a log to an image")
    _add_view_options(plot)
    plot.add_argument(
        "-o",
        "--output",
        default=None,
        help="image file (default: <log>_dashboard.png next to the log)",
    )
    plot.add_argument(
        "--secondary",
        default=None,
        metavar="PATH",
        help="also draw the secondary screen to this file",
    )
    plot.add_argument(
        "--discard", type=int, default=None, help="plot only steps up to this one"
    )
    plot.add_argument("--dpi", type=float, default=None, help="image resolution")
    plot.set_defaults(func=_plot)

    timelapse = sub.add_parser("timelapse", help="animated GIF of the dashboard")
    _add_view_options(timelapse)
    timelapse.add_argument(
        "-o", "--output", default=None, help="GIF file (default: next to the log)"
    )
    timelapse.add_argument("--frames", type=int, default=30, help="number of frames")
    timelapse.add_argument("--fps", type=float, default=4.0, help="frames per second")
    timelapse.add_argument(
        "--secondary-screen", action="store_true", help="animate the secondary screen"
    )
    timelapse.set_defaults(func=_timelapse)

    from cockpit.report import add_report_parser

    add_report_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (_UserError, OSError, json.JSONDecodeError) as error:
        print(f"cockpit {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
