"""Command line ``cockpit`` (also ``python -m cockpit``).

* ``cockpit demo``: train a small network on scikit-learn's digits with cockpit and
  write ``<out>/log.json`` and ``<out>/dashboard.png``.
* ``cockpit plot LOG -o out.png``: draw the dashboard of a log (ours, streamed, or
  written by cockpit-for-pytorch 1.0.2).
* ``cockpit timelapse LOG -o run.gif``: an animated GIF of the dashboard over the run.
* ``cockpit export LOG --tensorboard DIR | --wandb PROJECT | --mlflow URI``: the log
  in TensorBoard, W&B or MLflow (:mod:`cockpit.integrations.cli`).
* ``cockpit report LOG [--markdown | --json]``: what is wrong with the run
  (:mod:`cockpit.diagnosis.report`).
* ``cockpit serve DIR_OR_LOG... [--port N]``: the live dashboard of runs in
  progress, in a browser (:mod:`cockpit.serve`).

Exit codes: 0 success; 1 a problem with the input (a log that is missing, empty,
truncated or not a cockpit log, an unwritable output, a bad option value), reported
as one line ``cockpit <command>: error: <file>: <problem>. Fix: ...`` on stderr,
without a traceback; 2 a command line that does not parse (argparse). Any other
error is reported in one line too (set ``COCKPIT_TRACEBACK=1`` to see its
traceback). Warnings are printed as one line each, ``cockpit <command>: warning:
...``.

A command that reads a log calls :func:`cockpit.log.files.open_log` (also
importable here as ``load_log``); :func:`main` turns its
:class:`~cockpit.errors.LogFileError` (and any ``OSError``) into that line.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from cockpit.errors import LogFileError, one_line_warnings
from cockpit.log.files import open_log

#: The reader of every command's log (the name it had before it moved).
load_log = open_log

#: Exit code of a command that failed on its input (argparse exits with 2).
EXIT_ERROR = 1

#: Where ``cockpit demo`` writes by default (the README names it; the
#: repository's ``.gitignore`` lists it).
DEMO_FOLDER = "cockpit_demo"

#: The configurations ``cockpit demo --config`` takes.
CONFIGURATIONS = ("economy", "business", "full")


class _UserError(Exception):
    """A problem with the command's input: reported in one line, no traceback."""


def _number(kind, least: float, strict: bool):
    """An argparse ``type``: ``kind`` of at least (``strict``: above) ``least``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < least or (strict and value == least):
            bound = "above" if strict else "at least"
            raise argparse.ArgumentTypeError(f"must be {bound} {least:g}, got {text}")
        return value

    return parse


_POSITIVE_INT = _number(int, 1, strict=False)
_NON_NEGATIVE_INT = _number(int, 0, strict=False)
_POSITIVE = _number(float, 0, strict=True)


def _image_path(path: str, option: str, formats=None, default: str = "png") -> str:
    """``path`` with ``.<default>`` added if it has no suffix, in a known format.

    Args:
        path: The output path given.
        option: The option's name, for the message.
        formats: The suffixes allowed (default: what matplotlib writes).
        default: The suffix added to a bare name.

    Raises:
        _UserError: For a folder, or a suffix that cannot be written.
    """
    if not os.path.basename(path) or os.path.isdir(path):
        raise _UserError(
            f"{path}: is a folder. Fix: give {option} a file name, e.g. "
            f"{os.path.join(path, 'dashboard.' + default)}."
        )
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if not suffix:
        return path.rstrip(".") + "." + default
    if formats is None:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise _UserError(
            f"{path}: matplotlib cannot write .{suffix} images. Fix: give {option} "
            f"a file ending in one of {', '.join('.' + f for f in sorted(formats))}."
        )
    return path


def _demo(args: argparse.Namespace) -> int:
    from cockpit.demo import run_demo
    from cockpit.utils.configuration import configuration
    from cockpit.utils.schedules import linear

    quantities = configuration(args.config, track_schedule=linear(args.interval))
    _live_notice(args.live)
    out = args.out.rstrip("/\\") or "."
    result = run_demo(
        quantities,
        logpath=os.path.join(out, "log"),
        steps=args.steps,
        lr=args.lr,
        progress=not args.no_progress,
        dashboard=os.path.join(out, "dashboard.png"),
        live_every=args.live,
    )
    print(f"log written to {result.logpath}")
    print(f"dashboard written to {result.dashboard}")
    return 0


def _log_title(args: argparse.Namespace) -> str:
    log = args.log[0] if isinstance(args.log, list) else args.log
    return args.title or f"Cockpit: {os.path.basename(os.fspath(log))}"


def _default_output(logs: str | list[str], suffix: str) -> str:
    """``<stem>_dashboard<suffix>`` next to the (first) log; ``a_vs_b_...`` for two."""
    logs = [logs] if isinstance(logs, str) else logs
    stems = [os.path.splitext(os.path.basename(log))[0] or "cockpit" for log in logs]
    stem = stems[0]
    if len(stems) == 2:
        stem = f"{stems[0]}_vs_{stems[1]}"
    elif len(stems) > 2:
        stem = f"{stems[0]}_and_{len(stems) - 1}_more"
    return os.path.join(os.path.dirname(logs[0]), f"{stem}_dashboard{suffix}")


def _run_labels(logs: list[str], labels: list[str] | None) -> list[str]:
    """The names of the runs of ``logs``: ``--label`` or the file names."""
    from cockpit.plotting.runs import check_labels, default_labels

    try:
        return check_labels(labels, len(logs)) or default_labels(logs)
    except ValueError as error:
        raise _UserError(f"--label: {error}") from None


def _html_path(path: str) -> str:
    if not os.path.basename(path) or os.path.isdir(path):
        raise _UserError(
            f"{path}: is a folder. Fix: give --html a file name, e.g. "
            f"{os.path.join(path, 'dashboard.html')}."
        )
    return path if os.path.splitext(path)[1] else path + ".html"


def _plot(args: argparse.Namespace) -> int:
    logs = list(args.log)
    # step by step, keeping only what is drawn; before importing matplotlib: bad
    # files fail fast
    # the HTML file shows histograms over the run: every step's can be read back
    latest = args.html is None or args.discard is not None
    upto = args.discard if latest else None
    histories = [open_log(log, latest=latest, upto=upto) for log in logs]
    labels = _run_labels(logs, args.label)
    from cockpit.plotting import CockpitPlotter

    several = len(logs) > 1
    html = _html_path(args.html) if args.html is not None else None
    out = None
    if args.output is not None or html is None:
        out = _image_path(args.output or _default_output(logs, ".png"), "-o")
    secondary = args.secondary
    if secondary is not None:
        secondary = _image_path(secondary, "--secondary")
    plotter = CockpitPlotter(secondary_screen=secondary is not None)
    source = histories if several else histories[0]
    options = {
        "discard": args.discard,
        "plot_title": args.title or (None if several else _log_title(args)),
        "labels": labels if several else None,
    }
    plotter.load(source, **options)
    if secondary is not None and not _secondary_has_data(plotter, secondary):
        secondary = None
    if out is not None or secondary is not None:
        plotter.plot(source, show_plot=False, show_log_iter=args.log_iter, **options)
        kwargs = {} if args.dpi is None else {"dpi": args.dpi}
        for path in plotter.save(out, secondary, **kwargs):
            print(f"dashboard written to {path}")
    if html is not None:
        print(f"HTML dashboard written to {plotter.write_html(html)}")
    return 0


def _secondary_has_data(plotter, path: str) -> bool:
    """Whether the secondary screen has a gauge to show; warns (one line) if not."""
    import warnings

    from cockpit.errors import CockpitWarning

    _, _, aux, layers = plotter.layout()
    if aux or layers:
        return True
    needs = ", ".join(hint.removeprefix("track ") for _, hint in
                      plotter.left_out("secondary"))  # fmt: skip
    warnings.warn(
        f"{path} not written: the log has none of the secondary screen's quantities. "
        f"Fix: track {needs} (e.g. add them to the configuration) and plot again.",
        CockpitWarning,
        stacklevel=2,
    )
    return False


def _timelapse(args: argparse.Namespace) -> int:
    out = _timelapse_path(args)
    history = open_log(args.log)  # before importing matplotlib: bad files fail fast
    from cockpit.plotting import make_timelapse

    path = make_timelapse(
        history,
        out,
        frames=args.frames,
        fps=args.fps,
        secondary_screen=args.secondary_screen,
        show_log_iter=args.log_iter,
        plot_title=_log_title(args),
        progress=False if args.no_progress else None,
    )
    print(f"timelapse written to {path}")
    return 0


def _timelapse_path(args: argparse.Namespace) -> str:
    """The GIF to write; a still image asked for gets one line naming ``plot``."""
    path = args.output or _default_output(args.log, ".gif")
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    from matplotlib.backend_bases import FigureCanvasBase

    if suffix != "gif" and suffix in FigureCanvasBase.get_supported_filetypes():
        raise _UserError(  # a still image: say what to run for one
            f"{path}: cockpit timelapse writes an animated GIF only, not .{suffix}. "
            f"Fix: give -o a file ending in .gif, or draw one still image with "
            f"cockpit plot {args.log} -o {path}."
        )
    return _image_path(path, "-o", ("gif",), "gif")


def _live_notice(live: int) -> None:
    """Say in one line that ``--live`` opens no window where there is no display."""
    if not live:
        return
    from cockpit.plotting.dashboard import _display_kind

    if _display_kind() == "gui":
        return
    import warnings

    import matplotlib

    from cockpit.errors import CockpitWarning

    warnings.warn(
        f"--live {live}: no window can open here (matplotlib backend "
        f"{matplotlib.get_backend()!r}, no display), so the live dashboard is not "
        "shown; the log and the final dashboard image are written as usual. Fix: "
        "run where a display is available (or set MPLBACKEND to a GUI backend such "
        "as TkAgg), or open the image afterwards.",
        CockpitWarning,
        stacklevel=2,
    )


def _add_view_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", help="cockpit log (.json, streamed, or 1.0.2 log)")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument(
        "--log-iter", action="store_true", help="logarithmic iteration axes"
    )


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``cockpit`` command."""
    from cockpit import __version__

    defaults = _DefaultsHelp
    parser = argparse.ArgumentParser(
        prog="cockpit",
        description="cockpit: a debugger for neural network training",
        formatter_class=defaults,
    )
    parser.add_argument("--version", action="version", version=f"cockpit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="train a small network on digits with cockpit; write log and dashboard",
        formatter_class=defaults,
    )
    demo.add_argument(
        "--out",
        default=DEMO_FOLDER,
        help="output folder (git-ignored in a clone of cockpit)",
    )
    demo.add_argument("--steps", type=_POSITIVE_INT, default=200, help="training steps")
    demo.add_argument("--lr", type=_POSITIVE, default=0.1, help="SGD learning rate")
    demo.add_argument(
        "--config",
        default="full",
        choices=CONFIGURATIONS,
        help="which quantities to track",
    )
    demo.add_argument(
        "--interval", type=_POSITIVE_INT, default=1, help="track every k steps"
    )
    demo.add_argument("--no-progress", action="store_true", help="hide progress bar")
    demo.add_argument(
        "--live",
        type=_NON_NEGATIVE_INT,
        default=0,
        metavar="K",
        help="update a live dashboard window every K steps (0: off)",
    )
    demo.set_defaults(func=_demo)

    plot = sub.add_parser(
        "plot",
        help="draw the dashboard of a log (or of several, side by side) to an image "
        "or an interactive HTML file",
        formatter_class=defaults,
    )
    plot.add_argument(
        "log",
        nargs="+",
        help="cockpit log(s) (.json, streamed, or 1.0.2 logs); several: one colour "
        "per run, aligned by step",
    )
    plot.add_argument("--title", default=None, help="figure title")
    plot.add_argument(
        "--log-iter", action="store_true", help="logarithmic iteration axes"
    )
    plot.add_argument(
        "--label",
        action="append",
        default=None,
        metavar="NAME",
        help="name of a run in the legends, once per log in order (default: the "
        "file names)",
    )
    plot.add_argument(
        "-o",
        "--output",
        default=None,
        help="image file (default: <log>_dashboard.png next to the (first) log; "
        "none with --html alone)",
    )
    plot.add_argument(
        "--html",
        default=None,
        metavar="PATH",
        help="also (or, without -o, only) write the interactive HTML dashboard: "
        "one file, no server or network needed",
    )
    plot.add_argument(
        "--secondary",
        default=None,
        metavar="PATH",
        help="also draw the secondary screen to this file",
    )
    plot.add_argument(
        "--discard",
        type=_NON_NEGATIVE_INT,
        default=None,
        help="plot only steps up to this one",
    )
    plot.add_argument("--dpi", type=_POSITIVE, default=None, help="image resolution")
    plot.set_defaults(func=_plot)

    timelapse = sub.add_parser(
        "timelapse", help="animated GIF of the dashboard", formatter_class=defaults
    )
    _add_view_options(timelapse)
    timelapse.add_argument(
        "-o", "--output", default=None, help="GIF file (default: next to the log)"
    )
    timelapse.add_argument(
        "--frames", type=_POSITIVE_INT, default=30, help="number of frames"
    )
    timelapse.add_argument(
        "--fps", type=_POSITIVE, default=4.0, help="frames per second"
    )
    timelapse.add_argument(
        "--secondary-screen", action="store_true", help="animate the secondary screen"
    )
    timelapse.add_argument(
        "--no-progress", action="store_true", help="hide the progress bar of frames"
    )
    timelapse.set_defaults(func=_timelapse)

    from cockpit.diagnosis.report import add_report_parser
    from cockpit.integrations.cli import add_export_command
    from cockpit.serve.cli import add_serve_parser

    add_report_parser(sub)
    add_export_command(sub)
    add_serve_parser(sub)
    _show_defaults(sub)
    return parser


class _DefaultsHelp(argparse.HelpFormatter):
    """``--help`` that ends each option's line with its default.

    Unlike :class:`argparse.ArgumentDefaultsHelpFormatter` it leaves out defaults
    that say nothing (``None``, flags) and help that names its default already.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            default is None  # 0 is a default worth showing: no `in (None, False)`
            or default == argparse.SUPPRESS
            or "default" in text
            or action.nargs == 0  # a flag: its default is "not given"
            or not (action.option_strings or action.nargs in ("?", "*"))
        ):
            return text
        return text + " (default: %(default)s)"


def _show_defaults(sub) -> None:
    """Every sub-command's ``--help`` shows its defaults (also those added later)."""
    for command in sub.choices.values():
        command.formatter_class = _DefaultsHelp


def _one_line(error: BaseException) -> str:
    """The message of an error as one line (an OSError without its ``[Errno N]``)."""
    if isinstance(error, OSError) and error.strerror:
        message = error.strerror
        if error.filename is not None and os.fsdecode(error.filename) not in message:
            message = f"{os.fsdecode(error.filename)}: {message}"
        if isinstance(error, (FileExistsError, NotADirectoryError)):
            message += (
                " (a file where the output needs a folder). Fix: choose an output "
                "path whose folders are not files"
            )
        elif isinstance(error, PermissionError):
            message += ". Fix: choose an output path you can write to"
    else:
        message = str(error)
    return " ".join(message.split())


def _unexpected_message(error: Exception, log: str | os.PathLike | None) -> str:
    """The one line for an error no command expects (``log``: the command's log)."""
    where = "" if log is None else f"{os.fspath(log)}: "
    return (
        f"{where}unexpected {type(error).__name__}: {_one_line(error)} (a log with "
        "values of a shape cockpit does not write, or a bug in cockpit). Fix: check "
        "the log; to report a bug, run again with COCKPIT_TRACEBACK=1 and include "
        "the traceback."
    )


def main(argv: list[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 on success, :data:`EXIT_ERROR` if the command failed on
        its input (the reason is printed as one line on stderr).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    with one_line_warnings(args.command):
        try:
            return args.func(args)
        except (_UserError, LogFileError, OSError) as error:
            print(f"cockpit {args.command}: error: {_one_line(error)}", file=sys.stderr)
            return EXIT_ERROR
        except Exception as error:  # a bug, or a log with values of an odd shape
            if os.environ.get("COCKPIT_TRACEBACK"):
                raise
            log = getattr(args, "log", None)
            log = ", ".join(log) if isinstance(log, list) else log
            message = _unexpected_message(error, log)
            print(f"cockpit {args.command}: error: {message}", file=sys.stderr)
            return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
