"""Renderings of a diagnosis (text, Markdown, JSON) and the ``cockpit report`` command.

All three renderings show the same :class:`~cockpit.diagnosis.Finding` records::

    cockpit report runs/log.json              # text
    cockpit report runs/log.json --markdown   # e.g. for a pull request or a wiki
    cockpit report runs/log.json --json       # one JSON object on stdout
    cockpit report runs/log.json --fail-on warning   # exit 2 if any is found

The JSON object is ``{"log": ..., "findings": [{"id", "severity", "steps", "message",
"evidence", "advice"}, ...], "counts": {"error": n, "warning": n, "info": n},
"not_checked": {check: what it needs}}``.

Several logs are compared (``cockpit report a.json b.json [--label A --label B]``):
a table of every check against every run (the most severe finding and its steps,
"ok", or "not checked"), then each run's findings. Its JSON object is ``{"runs":
[{"label", ...one log's object}], "comparison": {check: {label: {"severity",
"steps"} | "ok" | "not checked"}}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from cockpit.diagnosis import NOT_CHECKED, SEVERITIES, Finding, diagnose
from cockpit.errors import LogFileError, one_line_warnings
from cockpit.log.files import open_log

_RANK = {s: i for i, s in enumerate(SEVERITIES)}


def _counts(findings: Sequence[Finding]) -> dict[str, int]:
    counts = {s: 0 for s in reversed(SEVERITIES)}
    for f in findings:
        if f.id != NOT_CHECKED:
            counts[f.severity] += 1
    return counts


def _not_checked(findings: Sequence[Finding]) -> dict[str, str]:
    for f in findings:
        if f.id == NOT_CHECKED:
            return dict(f.evidence.get("checks", {}))
    return {}


def _steps(f: Finding) -> str:
    first, last = f.steps
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _summary(findings: Sequence[Finding]) -> str:
    counts = _counts(findings)
    parts = [
        f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n or s != "info"
    ]
    return ", ".join(parts)


def render_text(findings: Sequence[Finding], source: str | None = None) -> str:
    """Render findings as plain text for a terminal.

    Args:
        findings: The findings (as returned by :func:`cockpit.diagnosis.diagnose`).
        source: The log they come from (shown in the first line).

    Returns:
        The text, ending with a newline.
    """
    title = "cockpit report" + (f" for {source}" if source else "")
    lines = [f"{title}: {_summary(findings)}"]
    problems = [f for f in findings if f.severity != "info"]
    if not problems:
        lines.append("No problems found at warning or error level.")
    for f in findings:
        if f.id == NOT_CHECKED:
            continue
        lines += ["", f"{f.severity.upper()} {f.id} ({_steps(f)})", f"  {f.message}"]
        evidence = ", ".join(f"{k}={_value(v)}" for k, v in f.evidence.items())
        lines.append(f"  evidence: {evidence}")
        lines.append(f"  advice: {f.advice}")
    missing = _not_checked(findings)
    if missing:
        lines += ["", "Not checked (data missing):"]
        lines += [f"  {check}: needs {need}" for check, need in missing.items()]
    return "\n".join(lines) + "\n"


def render_markdown(findings: Sequence[Finding], source: str | None = None) -> str:
    """Render findings as Markdown: a summary table, then one section per finding.

    Args:
        findings: The findings.
        source: The log they come from (in the heading).

    Returns:
        The Markdown text, ending with a newline.
    """
    title = "# cockpit report" + (f": `{source}`" if source else "")
    lines = [title, "", f"**{_summary(findings)}**", ""]
    shown = [f for f in findings if f.id != NOT_CHECKED]
    if not any(f.severity != "info" for f in shown):
        lines += ["No problems found at warning or error level.", ""]
    if shown:
        lines += ["| severity | finding | steps |", "| --- | --- | --- |"]
        lines += [f"| {f.severity} | `{f.id}` | {_steps(f)} |" for f in shown]
        lines.append("")
    for f in shown:
        lines += [f"## {f.severity}: `{f.id}` ({_steps(f)})", "", f.message, ""]
        lines += ["Evidence:", ""]
        lines += [f"- `{k}`: {_value(v)}" for k, v in f.evidence.items()]
        lines += ["", f"**Advice:** {f.advice}", ""]
    missing = _not_checked(findings)
    if missing:
        lines += ["## Not checked", ""]
        lines += [f"- `{check}`: needs {need}" for check, need in missing.items()]
        lines.append("")
    return "\n".join(lines)


def to_json_object(
    findings: Sequence[Finding], source: str | None = None
) -> dict[str, Any]:
    """The JSON rendering as a dictionary (see the module docstring)."""
    return {
        "log": source,
        "findings": [f.to_dict() for f in findings],
        "counts": _counts(findings),
        "not_checked": _not_checked(findings),
    }


def render_json(findings: Sequence[Finding], source: str | None = None) -> str:
    """Render findings as exactly one JSON object (indented, newline at the end)."""
    payload = to_json_object(findings, source)
    return json.dumps(payload, indent=2, allow_nan=False) + "\n"


def exit_code(findings: Sequence[Finding], fail_on: str) -> int:
    """0, or 2 if a finding is at least as severe as ``fail_on`` (``"never"``: 0)."""
    if fail_on == "never":
        return 0
    threshold = _RANK[fail_on]
    return 2 if any(_RANK[f.severity] >= threshold for f in findings) else 0


# --- several runs -----------------------------------------------------------------
def compare(runs: Sequence[tuple[str, Sequence[Finding]]]) -> dict[str, dict[str, Any]]:
    """Every check against every run: its most severe finding, "ok" or "not checked".

    Args:
        runs: ``(label, findings)`` of each run.

    Returns:
        ``{check: {label: {"severity", "steps"} | "ok" | "not checked"}}``, the
        checks in :data:`cockpit.diagnosis.CHECK_IDS` order (then any other id
        found).
    """
    from cockpit.diagnosis import CHECK_IDS

    ids = list(CHECK_IDS)
    for _, findings in runs:
        ids += [f.id for f in findings if f.id not in ids and f.id != NOT_CHECKED]
    table: dict[str, dict[str, Any]] = {}
    for check in ids:
        row = {}
        for label, findings in runs:
            if check in _not_checked(findings):
                row[label] = "not checked"
                continue
            found = [f for f in findings if f.id == check]
            if not found:
                row[label] = "ok"
                continue
            worst = max(found, key=lambda f: _RANK[f.severity])
            row[label] = {"severity": worst.severity, "steps": list(worst.steps)}
        table[check] = row
    return table


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        first, last = value["steps"]
        steps = f"{first}" if first == last else f"{first}-{last}"
        return f"{value['severity']} ({steps})"
    return value


def render_comparison(
    runs: Sequence[tuple[str, Sequence[Finding]]], form: str = "text"
) -> str:
    """Render several runs' findings side by side.

    Args:
        runs: ``(label, findings)`` of each run.
        form: ``"text"``, ``"markdown"`` or ``"json"``.

    Returns:
        The rendering, ending with a newline (JSON: one object).
    """
    table = compare(runs)
    labels = [label for label, _ in runs]
    if form == "json":
        payload = {
            "runs": [
                {"label": label, **to_json_object(findings, label)}
                for label, findings in runs
            ],
            "comparison": table,
        }
        return json.dumps(payload, indent=2, allow_nan=False) + "\n"
    if form == "markdown":
        lines = [f"# cockpit report: {len(runs)} runs compared", ""]
        lines += ["| check | " + " | ".join(f"`{x}`" for x in labels) + " |"]
        lines += ["| --- |" + " --- |" * len(labels)]
        lines += [f"| `{check}` | " + " | ".join(_cell(row[x]) for x in labels) + " |"
                  for check, row in table.items()]  # fmt: skip
        lines.append("")
        for label, findings in runs:
            body = render_markdown(findings, label).split("\n", 1)[1]
            lines += [f"## run `{label}`", body]
        return "\n".join(lines)
    width = max(len(check) for check in table) + 2
    cells = {x: max(len(x), *(len(_cell(row[x])) for row in table.values())) + 2
             for x in labels}  # fmt: skip
    lines = [f"cockpit report: {len(runs)} runs compared", ""]
    lines.append("check".ljust(width) + "".join(x.ljust(cells[x]) for x in labels))
    for check, row in table.items():
        lines.append(
            check.ljust(width) + "".join(_cell(row[x]).ljust(cells[x]) for x in labels)
        )
    for label, findings in runs:
        lines += ["", "=" * 72, render_text(findings, label).rstrip("\n")]
    return "\n".join(line.rstrip() for line in lines) + "\n"


# --- command line -------------------------------------------------------------------
def report_command(args: argparse.Namespace) -> int:
    """Run ``cockpit report``: diagnose ``args.log`` and print the rendering.

    Several logs are compared (:func:`render_comparison`).

    Returns:
        0; 2 if ``--fail-on`` is met (by any run); 1 (with one line on stderr
        naming the file and the problem) if a log cannot be read, or the labels
        do not fit.
    """
    logs = args.log if isinstance(args.log, list) else [args.log]
    histories = []
    for log in logs:
        try:
            histories.append(open_log(log))  # a damaged line: one warning
        except LogFileError as error:
            print(f"cockpit report: error: {error}", file=sys.stderr)
            return 1
    if len(logs) == 1:
        findings = diagnose(histories[0])
        if args.format == "json":
            text = render_json(findings, logs[0])
        elif args.format == "markdown":
            text = render_markdown(findings, logs[0])
        else:
            text = render_text(findings, logs[0])
        sys.stdout.write(text)
        return exit_code(findings, args.fail_on)
    from cockpit.plotting.runs import check_labels, default_labels

    try:
        labels = check_labels(args.label, len(logs)) or default_labels(logs)
    except ValueError as error:
        print(f"cockpit report: error: --label: {error}", file=sys.stderr)
        return 1
    runs = [(label, diagnose(h)) for label, h in zip(labels, histories)]
    sys.stdout.write(render_comparison(runs, args.format))
    return max(exit_code(findings, args.fail_on) for _, findings in runs)


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``report`` sub-command to the ``cockpit`` command's sub-parsers.

    Args:
        subparsers: The object returned by ``parser.add_subparsers()``.

    Returns:
        The sub-parser (its ``func`` is :func:`report_command`).
    """
    report = subparsers.add_parser(
        "report",
        help="say what is wrong with a run: findings with evidence and advice",
        description="Diagnose a cockpit log: findings with evidence and advice.",
    )
    report.add_argument(
        "log",
        nargs="+",
        help="cockpit log(s) (.json, streamed, or 1.0.2 logs); several are compared",
    )
    report.add_argument(
        "--label",
        action="append",
        default=None,
        metavar="NAME",
        help="name of a run, once per log in order (default: the file names)",
    )
    form = report.add_mutually_exclusive_group()
    form.add_argument(
        "--markdown",
        dest="format",
        action="store_const",
        const="markdown",
        help="print Markdown",
    )
    form.add_argument(
        "--json",
        dest="format",
        action="store_const",
        const="json",
        help="print one JSON object",
    )
    report.add_argument(
        "--fail-on",
        choices=("never", "warning", "error"),
        default="never",
        help="exit with status 2 if a finding is at least this severe",
    )
    report.set_defaults(func=report_command, format="text")
    return report


def main(argv: list[str] | None = None) -> int:
    """Run ``cockpit report`` alone (``python -m cockpit.diagnosis.report LOG``)."""
    parser = argparse.ArgumentParser(prog="cockpit")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", *(sys.argv[1:] if argv is None else argv)])
    with one_line_warnings("report"):
        return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
