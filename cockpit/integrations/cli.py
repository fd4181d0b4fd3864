"""The ``cockpit export`` sub-command (registered by :mod:`cockpit.cli`).

* ``cockpit export LOG --tensorboard DIR`` writes the log's quantities as
  TensorBoard scalars and histograms to ``DIR``
  (:mod:`cockpit.integrations.tensorboard`);
* ``cockpit export LOG --wandb PROJECT`` sends it as a new W&B run of ``PROJECT``
  (``WANDB_MODE=offline`` without a server; :mod:`cockpit.integrations.wandb`);
* ``cockpit export LOG --mlflow URI`` sends it as a new MLflow run to the tracking
  server or store ``URI`` (experiment ``--experiment``, default ``cockpit``;
  :mod:`cockpit.integrations.mlflow`).

The W&B and MLflow runs also get the dashboard, the HTML dashboard and the
diagnosis. The log is read with :func:`cockpit.log.files.open_log`.
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
    export = sub.add_parser("export", help="send a log to TensorBoard, W&B or MLflow")
    export.add_argument("log", help="cockpit log (.json, streamed, or 1.0.2 log)")
    where = export.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="TensorBoard run directory (e.g. next to your other runs)",
    )
    where.add_argument("--wandb", metavar="PROJECT", help="W&B project of the new run")
    where.add_argument(
        "--mlflow", metavar="URI", help="MLflow tracking URI (server or store)"
    )
    export.add_argument(
        "--run-name",
        default=None,
        help="name of the W&B/MLflow run (default: the log's file name)",
    )
    export.add_argument(
        "--experiment", default="cockpit", help="MLflow experiment (default: cockpit)"
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
    names = args.param_names.split(",") if args.param_names else None
    if args.tensorboard is None:
        return _export_tracker(args, history, names)
    from cockpit.integrations.tensorboard import export_tensorboard

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


def _export_tracker(args: argparse.Namespace, history, names) -> int:
    """``--wandb`` or ``--mlflow``: a new run with the log's values and outputs."""
    name = args.run_name or os.path.splitext(os.path.basename(args.log))[0]
    try:
        if args.wandb is not None:
            from cockpit.integrations.wandb import export_wandb

            sent = export_wandb(history, args.wandb, name=name, param_names=names,
                                prefix=args.prefix)  # fmt: skip
            where = f"W&B run {sent.sink.run.id} of project {args.wandb}"
        else:
            from cockpit.integrations.mlflow import export_mlflow

            sent = export_mlflow(history, args.mlflow, experiment=args.experiment,
                                 run_name=name, param_names=names,
                                 prefix=args.prefix)  # fmt: skip
            where = f"MLflow run {sent.sink.run_id} at {args.mlflow}"
    except ImportError as error:
        print(f"cockpit export: error: {error}", file=sys.stderr)
        return 1
    if sent.steps == 0:
        raise LogFileError(
            args.log,
            "holds no values in a form cockpit exports (unexpected values under "
            f"{', '.join(sorted(sent.series.skipped)) or 'no key'}). Fix: export a "
            "log written by cockpit",
        )
    print(f"{sent.steps} steps sent to {where}")
    for problem in sent.outputs.problems if sent.outputs else ():
        print(f"left out: {problem}")
    if sent.series.skipped:
        print(f"skipped (no tracker form): {', '.join(sorted(sent.series.skipped))}")
    return 0
