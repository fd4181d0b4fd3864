"""Rendering a run's record (:mod:`benchmarks.record`) as results/overhead.md.

Pure formatting: nothing here measures, and nothing imports torch or cockpit except
through :func:`benchmarks.internals.configuration_members` (the member quantities of
a configuration, for the breakdown of where its time goes).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks import blocks, internals

#: cockpit-for-pytorch 1.0.2 on a 2-core CPU (issue 6): step-time ratios and peak
#: RSS extra in MiB.
REFERENCE = {
    ("mlp", "economy"): (87, 155),
    ("mlp", "business"): (50, None),
    ("mlp", "full"): (147, 510),
    ("3c3d", "economy"): (6.5, 880),
    ("3c3d", "business"): (15, None),
    ("3c3d", "full"): (101, 3500),
}
#: Targets of issue 6 (ratios; memory: at most half the reference's extra RSS).
TARGET = {
    ("mlp", "economy"): 20,
    ("mlp", "business"): 25,
    ("mlp", "full"): 40,
    ("3c3d", "economy"): 2.5,
    ("3c3d", "business"): 9,
    ("3c3d", "full"): 15,
}
#: Single quantities on the CNN, reference ratios (issue 6).
REFERENCE_SINGLE_3C3D = {
    "HessMaxEV": "~50",
    "GradHist2d": "~50",
    "TICDiag": "12-17",
    "TICTrace": "12-17",
    "HessTrace": "9-13",
    "GradHist1d": "7-8",
    "NormTest": "3-4",
    "InnerTest": "3-4",
    "OrthoTest": "3-4",
}
#: Building blocks on the CNN, reference (plain forward+backward units).
REFERENCE_BLOCKS_3C3D = {
    "BatchGrad": "2.5",
    "BatchL2Grad": "2.3",
    "vmap_grad": "2.0",
    "DiagHessian": "6.9",
    "DiagGGNMC": "2.7",
    "HVP": "~1.5",
}
#: How the blocks table names some blocks.
BLOCK_LABELS = {
    "HVP": "fwd + create_graph bwd",
    "PerSampleGradients": "cockpit PerSampleGradients (Linear factored)",
}


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


def _ms(seconds_list) -> str:
    return f"{1000 * statistics.median(seconds_list):.1f}" if seconds_list else "–"


def _verdict(value, target) -> str:
    if value is None or target is None:
        return ""
    return "met" if value <= target else "**missed**"


def _ratio(res: dict, spec: str):
    return res.get(spec, {}).get("time", {}).get("ratio")


def _extra_mem(res: dict, spec: str):
    """Peak RSS of the spec's memory run minus that of the plain run (or None)."""
    plain_mem = res.get("plain", {}).get("memory", {}).get("peak_rss_mib")
    mem = res.get(spec, {}).get("memory", {})
    if "peak_rss_mib" not in mem or plain_mem is None:
        return None
    return mem["peak_rss_mib"] - plain_mem


def render(record: dict, analysis=None) -> str:
    """Render a record as Markdown; append the file ``analysis`` if it exists."""
    settings = record["settings"]
    lines = _header(record["machine"], settings, record["argv"])
    reference = record.get("reference")
    for problem in settings["problems"]:
        res = record["results"].get(problem, {})
        lines += [f"## {problem}", ""]
        plain_mem = res.get("plain", {}).get("memory", {}).get("peak_rss_mib")
        if plain_mem is not None:
            lines += [f"Plain-run peak RSS: {plain_mem:.0f} MiB.", ""]
        lines += _configurations(problem, res)
        lines += _singles(problem, res)
        lines += _blocks(problem, res)
        if reference is not None:
            lines += _same_run(res, reference, problem)
        lines += _failures(problem, res, "### Failures")
    notes = record["notes"]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    analysis = Path(analysis) if analysis else None
    if analysis is not None and analysis.exists():
        lines += [analysis.read_text().rstrip(), ""]
    return "\n".join(lines)


def _header(machine: dict, settings: dict, argv) -> list[str]:
    return [
        "# cockpit overhead benchmark",
        "",
        "Made by:",
        "",
        "```",
        "python -m benchmarks.run " + " ".join(argv),
        "```",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['platform']}; "
        f"Python {machine['python']}, torch {machine['torch']}, BackPACK "
        f"{machine['backpack']}; {settings['threads']} torch threads; "
        f"{settings['clock']} clock; commit {machine['commit']}; {machine['date']}; "
        f"load average at the end {machine['load']}.",
        "",
        f"Batch 128 of random float32 data, every step tracked, at least "
        f"{settings['repeats']} interleaved plain/tracked pairs (more until they took "
        f"{settings['min_time']:g} s) after {settings['warmup']} warm-up pair(s) per "
        "configuration, each configuration in a fresh process with "
        "`MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776`. Ratio = median "
        "tracked-step time / median plain-step time (plain: zero_grad, forward, "
        "backward, SGD step on a model that is not extended). Peak RSS extra = peak "
        f"RSS of a process running {settings['warmup'] + settings['memory_steps']} "
        "tracked steps minus that of a process running as many plain steps.",
        "",
    ]


def _configurations(problem: str, res: dict) -> list[str]:
    configs = [s for s in res if s in internals.CONFIGURATIONS]
    if not configs:
        return []
    lines = [
        "### Configurations",
        "",
        "| config | plain ms | tracked ms | ratio | target | reference "
        "| verdict | peak RSS extra MiB | target MiB | reference MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for spec in configs:
        t = res[spec].get("time", {})
        ratio = t.get("ratio")
        ref, ref_mem = REFERENCE.get((problem, spec), (None, None))
        target = TARGET.get((problem, spec))
        mem = _extra_mem(res, spec)
        target_mem = ref_mem / 2 if ref_mem else None
        verdict = _verdict(ratio, target)
        if mem is not None and target_mem is not None:
            verdict += " / " + _verdict(mem, target_mem)
        lines.append(
            f"| {spec} | {_ms(t.get('plain_s'))} | {_ms(t.get('tracked_s'))} "
            f"| {_fmt(ratio)} | {_fmt(target)} | {_fmt(ref)} | {verdict} "
            f"| {_fmt(mem)} | {_fmt(target_mem)} | {_fmt(ref_mem)} |"
        )
    return lines + [""] + _breakdown(res, configs)


def _breakdown(res: dict, configs: list[str]) -> list[str]:
    """Lines saying which member quantities cost most when tracked alone."""
    lines = []
    for label in configs:
        solo = []
        for name in internals.configuration_members(label):
            ratio = _ratio(res, name)
            if ratio is not None:
                solo.append((ratio - 1, name))
        if solo:
            parts = ", ".join(
                f"{name} +{extra:.2f}" for extra, name in sorted(solo)[::-1]
            )
            lines.append(f"- {label}: members alone, overhead (ratio - 1): {parts}")
    if not lines:
        return []
    intro = ["Where the time goes (each member quantity tracked alone):", ""]
    return intro + lines + [""]


def _singles(problem: str, res: dict) -> list[str]:
    singles = [
        s
        for s in res
        if s not in internals.CONFIGURATIONS and s != "plain" and not blocks.is_block(s)
    ]
    if not singles:
        return []
    lines = [
        "### Single quantities",
        "",
        "| quantity | plain ms | tracked ms | ratio | reference | peak RSS extra MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    refs = REFERENCE_SINGLE_3C3D if problem == "3c3d" else {}
    for spec in singles:
        t = res[spec].get("time", {})
        lines.append(
            f"| {spec} | {_ms(t.get('plain_s'))} | {_ms(t.get('tracked_s'))} "
            f"| {_fmt(t.get('ratio'))} | {refs.get(spec, '–')} "
            f"| {_fmt(_extra_mem(res, spec))} |"
        )
    return lines + [""]


def _blocks(problem: str, res: dict) -> list[str]:
    specs = [s for s in res if blocks.is_block(s)]
    if not specs:
        return []
    lines = [
        "### Building blocks (units of one plain forward+backward pass)",
        "",
        "| block | plain fwd+bwd ms | block ms | units | reference |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    refs = REFERENCE_BLOCKS_3C3D if problem == "3c3d" else {}
    for spec in specs:
        name = spec[len(blocks.PREFIX) :]
        t = res[spec].get("time", {})
        lines.append(
            f"| {BLOCK_LABELS.get(name, name)} | {_ms(t.get('plain_s'))} "
            f"| {_ms(t.get('tracked_s'))} | {_fmt(t.get('ratio'))} | "
            f"{refs.get(name, '–') if name != 'HVP' else '–'} |"
        )
        if "extra_ratio" in t:
            lines.append(
                f"| one HVP (after it) | {_ms(t.get('plain_s'))} "
                f"| {_ms(t.get('extra_s'))} | {_fmt(t['extra_ratio'])} "
                f"| {refs.get(name, '–')} |"
            )
    return lines + [""]


def _same_run(res: dict, reference: dict, problem: str) -> list[str]:
    """Table of our ratios and extra RSS next to the reference package's."""
    theirs = reference["results"].get(problem, {})
    specs = [s for s in res if s != "plain" and s in theirs]
    if not specs:
        return []
    name = reference["package"]
    lines = [
        f"### Same run: {name}",
        "",
        f"Each row measured by this checkout and by {name} (`pip install "
        f"{reference['requirement']}` in a throwaway environment with the same torch "
        "and BackPACK), one right after the other in alternating order, with the "
        "same settings; ratios of the reference use its own plain steps.",
        "",
        "| spec | ratio | reference ratio | reference / ours | peak RSS extra MiB "
        "| reference peak RSS extra MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for spec in specs:
        ours, ref = _ratio(res, spec), _ratio(theirs, spec)
        speedup = ref / ours if ours and ref else None
        lines.append(
            f"| {spec} | {_fmt(ours)} | {_fmt(ref)} | {_fmt(speedup)} "
            f"| {_fmt(_extra_mem(res, spec))} | {_fmt(_extra_mem(theirs, spec))} |"
        )
    lines.append("")
    return lines + _failures(problem, theirs, f"#### Failures of {name}")


def _failures(problem: str, res: dict, title: str) -> list[str]:
    errors = [
        f"- {problem} {spec} ({mode}): {out['error']}"
        for spec, modes in res.items()
        for mode, out in modes.items()
        if "error" in out
    ]
    return [title, ""] + errors + [""] if errors else []
