"""Command line: ``cockpit demo`` (also ``python -m cockpit demo``)."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from cockpit.demo import run_demo
    from cockpit.utils.configuration import configuration
    from cockpit.utils.schedules import linear

    quantities = configuration(args.config, track_schedule=linear(args.interval))
    result = run_demo(
        quantities,
        logpath=args.out.rstrip("/") + "/log",
        steps=args.steps,
        progress=not args.no_progress,
    )
    print(f"log written to {result.logpath}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``cockpit`` command."""
    parser = argparse.ArgumentParser(
        prog="cockpit", description="cockpit: a debugger for neural network training"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small network on digits with cockpit")
    demo.add_argument("--out", default="cockpit_demo", help="output folder")
    demo.add_argument("--steps", type=int, default=200, help="training steps")
    demo.add_argument("--config", default="full", help="economy | business | full")
    demo.add_argument("--interval", type=int, default=1, help="track every k steps")
    demo.add_argument("--no-progress", action="store_true", help="hide progress bar")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
