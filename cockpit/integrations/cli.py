"""The ``cockpit export`` sub-command (registered by :mod:`cockpit.cli`).

``cockpit export LOG --tensorboard DIR`` writes the log's quantities as TensorBoard
scalars and histograms to ``DIR`` (see :mod:`cockpit.integrations.tensorboard`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from cockpit.errors import LogFileError
from cockpit.log.files import open_log


def add_export_command(sub) -> argparse.ArgumentParser:
    """Add ``export`` to the sub-commands ``sub`` of the ``cockpit`` parser.

    Args:
        sub: The object returned by ``parser.add_subparsers()``.

    Returns:
        The ``export`` parser.
    """
    export = sub.add_parser(
        "export", help="write a log as TensorBoard scalars and histograms"
    )
    export.add_argument("log", help="cockpit log (.json, streamed, or 1.0.2 log)")
    export.add_argument(
        "--tensorboard",
        required=True,
        metavar="DIR",
        help="TensorBoard run directory (e.g. next to your other runs)",
    )
    export.add_argument(
        "--prefix", default="cockpit", help="first part of every tag (default: cockpit)"
    )
    export.add_argument(
        "--param-names",
        default=None,
        metavar="A,B,...",
        help="comma-separated parameter names for per-parameter values "
        "(default: param_0, param_1, ...)",
    )
    export.set_defaults(func=run_export)
    return export


def run_export(args: argparse.Namespace) -> int:
    """Run ``cockpit export``; return the exit code."""
    history = open_log(args.log)  # a bad log: one line from cockpit.cli.main
    from cockpit.integrations.tensorboard import export_tensorboard

    names = args.param_names.split(",") if args.param_names else None
    existed = os.path.exists(args.tensorboard)
    try:
        summary = export_tensorboard(
            history, args.tensorboard, param_names=names, prefix=args.prefix
        )
    except (ImportError, ValueError) as error:
        print(f"cockpit export: error: {error}", file=sys.stderr)
        return 1
    if summary.scalars + summary.histograms == 0:
        if not existed:  # leave nothing behind that looks like an export
            shutil.rmtree(args.tensorboard, ignore_errors=True)
        raise LogFileError(
            args.log,
            "holds no values in a form cockpit exports (unexpected values under "
            f"{', '.join(summary.skipped) or 'no key'}). Fix: export a log written "
            "by cockpit",
        )
    print(
        f"{summary.scalars} scalars and {summary.histograms} histograms of "
        f"{summary.steps} steps written to {summary.logdir}"
    )
    if summary.skipped:
        print(f"skipped (no TensorBoard form): {', '.join(summary.skipped)}")
    return 0
