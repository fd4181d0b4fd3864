"""business and full per tracked step, against commit 6fc3e24 in the same run.

Each measurement is a child process that imports cockpit from one checkout (this
one, or the reference worktree) and ``benchmarks`` from this one, trains a model
with the 1.0.2 loop tracking every step with ``configuration(label)``, and times each
tracked step (zero_grad to ``optimizer.step()``) and, interleaved, a plain step of an
unextended copy. Children of the two checkouts alternate (and swap order every
round), so the machine's drift hits both alike; ratios are of medians over the
tracked steps after the first (the first one starts Lanczos cold and builds caches;
it is reported apart).

Accuracy, at every tracked step: HessMaxEV against a converged reference (Lanczos on
the same step's Hessian to a relative residual of ``1e-9``, computed untimed in this
checkout's child; both checkouts follow the same trajectory, so the reference
serves both), and the standard error of HessTrace's summed trace where it is
estimated.

Set up the reference once, then run (one torch thread, allocator settings as in
``benchmarks/measure.py``)::

    git worktree add /tmp/ref6fc 6fc3e24
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \\
        python -m benchmarks.studies.curvature_cost --reference /tmp/ref6fc \\
        --models gpt2-small,3c3d --steps 4 --rounds 2 \\
        --out benchmarks/results/curvature_cost.md

``--models gpt2`` is the speed issue's GPT-2 (11.5M parameters, sequence 128, a full
step takes minutes on one thread: use ``--steps 2 --rounds 1``). Models:
``gpt2`` / ``gpt2-small`` (2 layers, sequence 32, 4.3M parameters) with the math
attention kernel (``eager``; 6fc3e24 has no curvature under the fused one),
``gpt2-sdpa-small`` (the default fused attention, this checkout only) and ``3c3d``
(the CNN of ``benchmarks/problems.py``, which BackPACK covers exactly, batch 32);
``gpt2-tiny`` (one layer of width 64) is for trying the script out.

``--zoo gpt2,vit,llama,t5,bert,resnet,tiny-gpt`` instead tabulates, per model of
``tests/utils/hf_models.py`` (and the hand-written GPT of
``tests/utils/hand_written.py``) and configuration, which curvature quantity is exact,
estimated or missing, which curvature HessTrace read (the GGN in place of the
Hessian, exact or Monte-Carlo, see ``cockpit/curvature/source.py``), the estimates'
relative standard errors and the tracked / plain CPU time (this checkout only; model
seed ``--seed``, default 1, not the seed 0 the GGN's count rule was chosen on)::

    python -m benchmarks.studies.curvature_cost \\
        --zoo gpt2,vit,llama,t5,bert,resnet,tiny-gpt \\
        --steps 3 --out benchmarks/results/curvature_zoo.md
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULT = "CURVATURE-COST "
CHILD_ENV = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": "1099511627776",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
MODELS = {
    "gpt2": {"kind": "gpt2", "batch": 8, "options": {}},
    "gpt2-small": {"kind": "gpt2", "batch": 8,
                   "options": {"layers": 2, "length": 32}},
    "gpt2-sdpa-small": {"kind": "gpt2", "batch": 8,
                        "options": {"layers": 2, "length": 32, "attention": "sdpa"}},
    "gpt2-tiny": {"kind": "gpt2", "batch": 8,
                  "options": {"layers": 1, "width": 64, "heads": 2, "vocab": 256,
                              "length": 16}},
    "3c3d": {"kind": "3c3d", "batch": 32, "options": {}},
}  # fmt: skip


# --- child ---------------------------------------------------------------------------
def _workload(name: str):
    """``(model, batch(step), logits, loss_fn, individual_loss_fn)`` of a model."""
    import torch

    spec = MODELS[name]
    if spec["kind"] == "gpt2":
        from benchmarks import real_models

        work = real_models.gpt2(**spec["options"])
        n = spec["batch"]
        return (work.model, lambda step: work.batch(n, step), work.logits,
                work.loss_fn, work.individual_loss_fn)  # fmt: skip
    from benchmarks import problems

    bench = problems.make("3c3d", batch_size=spec["batch"], need_extended=False)
    return (bench.plain, bench.batch, lambda out: out,
            torch.nn.CrossEntropyLoss(),
            torch.nn.CrossEntropyLoss(reduction="none"))  # fmt: skip


def _reference_eigenvalue(model, loss_fn, logits, batch, params) -> float:
    """HessMaxEV's eigenvalue to a relative residual of 1e-9 (untimed)."""
    import torch

    from cockpit.quantities.hess_max_ev import _make_hvp, lanczos_max_ev

    x, y = batch
    loss = loss_fn(logits(model(x)), y)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    dim = sum(p.numel() for p in params)
    hvp = _make_hvp(params, grads, torch.float64, params[0].device)
    gen = torch.Generator().manual_seed(7)
    v0 = torch.randn(dim, generator=gen, dtype=torch.float64)
    result = lanczos_max_ev(hvp, v0, rtol=1e-9, atol=0.0, max_iter=300)
    return result.eigenvalue if result.converged else float("nan")


def child(spec: dict) -> dict:
    """Train ``spec["steps"]`` tracked steps; time them and plain steps."""
    sys.path.insert(0, spec["root"])
    import torch
    from backpack import extend

    import cockpit
    from cockpit.utils.configuration import configuration

    assert Path(cockpit.__file__).resolve().is_relative_to(Path(spec["root"]))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model, batch, logits, loss_fn, individual_loss_fn = _workload(spec["model"])
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=spec["lr"])
    model, loss_fn = extend(model), extend(loss_fn)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=spec["lr"])
    quantities = configuration(spec["config"])
    tracker = cockpit.Cockpit(params, quantities=quantities)
    hess = next((q for q in quantities if type(q).__name__ == "HessMaxEV"), None)
    rows = []

    def plain_step(step):
        x, y = batch(step)
        plain_opt.zero_grad()
        plain_loss = torch.nn.functional.cross_entropy(
            logits(plain(x)).flatten(0, -2), y.flatten()
        )
        plain_loss.backward()
        plain_opt.step()

    for step in range(spec["steps"]):
        x, y = batch(step)
        clocks = time.process_time(), time.perf_counter()
        opt.zero_grad()
        out = logits(model(x))
        loss = loss_fn(out, y)
        losses = individual_loss_fn(out, y)
        info = {"batch_size": x.shape[0], "individual_losses": losses, "loss": loss,
                "optimizer": opt}  # fmt: skip
        with tracker(step, info=info):
            loss.backward(create_graph=tracker.create_graph(step))
        reference = None
        if spec["reference_ev"] and hess is not None:
            state = [p.detach().clone() for p in params]
            pause = time.process_time(), time.perf_counter()
            reference = _reference_eigenvalue(model, loss_fn, logits, (x, y), params)
            resumed = time.process_time(), time.perf_counter()
            clocks = tuple(c + (r - p) for c, p, r in zip(clocks, pause, resumed))
            assert all(torch.equal(p, s) for p, s in zip(params, state))
        opt.step()
        tracked = time.process_time() - clocks[0], time.perf_counter() - clocks[1]
        clocks = time.process_time(), time.perf_counter()
        plain_step(step)
        plain_times = time.process_time() - clocks[0], time.perf_counter() - clocks[1]
        entry = tracker.history.to_dict().get(step, {})
        estimate = entry.get("HessTrace_estimate") or {}
        rows.append({
            "step": step,
            "tracked_cpu": tracked[0], "tracked_wall": tracked[1],
            "plain_cpu": plain_times[0], "plain_wall": plain_times[1],
            "hess_max_ev": entry.get("HessMaxEV"),
            "largest": entry.get("HessMaxEV_largest"),
            "lanczos_products": getattr(hess, "last_num_hvps", None),
            "reference_ev": reference,
            "trace": sum(entry["HessTrace"]) if "HessTrace" in entry else None,
            "trace_stderr": estimate.get("stderr_sum"),
            "trace_method": estimate.get("method", "exact" if "HessTrace" in entry
                                         else None),
            "trace_probes": estimate.get("probes"),
            "missing": sorted(entry.get("missing", {})),
        })  # fmt: skip
    return {"spec": spec, "cockpit": cockpit.__file__, "rows": rows}


# --- the real-architecture zoo (issue 26's table) -------------------------------------
#: The models of ``tests/utils/hf_models.py`` and the hand-written GPT.
ZOO = ("gpt2", "vit", "llama", "t5", "bert", "resnet", "tiny-gpt")
CURVATURE_KEYS = ("HessMaxEV", "HessTrace", "TICDiag", "TICTrace")


def _status(entry: dict, key: str) -> str:
    if key in entry.get("missing", {}):
        return "missing"
    if key not in entry:
        return "–"
    estimate = entry.get(f"{key}_estimate")
    if estimate is None:
        return "exact"
    return "exact GGN" if estimate.get("method") == "ggn_exact" else "estimated"


def _curvature(estimate: dict | None) -> str:
    """Which curvature and how, from an estimate record (``None``: BackPACK's)."""
    if estimate is None:
        return "Hessian (BackPACK)"
    method = estimate.get("method", "")
    if method == "ggn_exact":
        return "GGN, exact"
    if method == "ggn_monte_carlo":
        return "GGN, Monte-Carlo"
    return "Hessian, Hutchinson"


def zoo_child(spec: dict) -> dict:
    """One zoo model, every configuration, the 1.0.2 loop with default attention."""
    sys.path.insert(0, spec["root"])
    import torch
    from backpack import extend

    import cockpit
    from cockpit import quantities as Q
    from cockpit.utils.configuration import configuration
    from cockpit.utils.schedules import linear
    from tests.utils import hf_models
    from tests.utils.hand_written import tiny_gpt

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    out = {"spec": spec, "configs": {}}
    seed = spec.get("seed", 0)
    for config in spec["configs"]:
        torch.manual_seed(seed)
        if spec["model"] == "tiny-gpt":
            case = tiny_gpt()
        else:
            case = hf_models.ZOO[spec["model"]]()
        plain_model = copy.deepcopy(case.model).train()
        model, loss_fn = extend(case.model.train()), extend(case.loss_fn)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.01)
        quantities = configuration(config)
        if config != "economy":
            quantities.append(Q.TICTrace(linear(1)))
        tracker = cockpit.Cockpit(params, quantities=quantities)
        rows, error = [], None
        for step in range(spec["steps"]):
            kwargs, targets = case.inputs(hf_models.BATCH, 100 * seed + step)
            clock = time.process_time()
            try:
                opt.zero_grad()
                logits = case.logits(model(**kwargs))
                loss = loss_fn(logits, targets)
                losses = case.individual_loss_fn(logits, targets)
                info = {"batch_size": hf_models.BATCH, "individual_losses": losses,
                        "loss": loss, "optimizer": opt}  # fmt: skip
                with tracker(step, info=info):
                    loss.backward(create_graph=tracker.create_graph(step))
                opt.step()
            except Exception as failure:  # e.g. BackPACK's hooks on BERT
                error = f"{type(failure).__name__}: {str(failure)[:160]}"
                break
            tracked = time.process_time() - clock
            clock = time.process_time()
            plain_model.zero_grad()
            plain_logits = case.logits(plain_model(**kwargs))
            case.loss_fn(plain_logits, targets).backward()
            plain = time.process_time() - clock
            entry = tracker.history.to_dict().get(step, {})
            status = {k: _status(entry, k) for k in CURVATURE_KEYS}
            row = {"step": step, "tracked": tracked, "plain": plain, "status": status}
            estimate = entry.get("HessTrace_estimate")
            if estimate:
                traces = entry["HessTrace"]
                row["trace_rel_se"] = estimate["stderr_sum"] / abs(sum(traces))
                row["tensor_rel_se"] = statistics.median(
                    e / abs(t) for e, t in zip(estimate["stderr"], traces) if t
                )
                row["probes"] = estimate["probes"]
            if "HessTrace" in entry:
                row["curvature"] = _curvature(estimate)
            tic = entry.get("TICTrace_estimate")
            if tic and "TICTrace" in entry:
                row["tic_rel_se"] = tic["stderr_sum"] / abs(entry["TICTrace"])
            if "HessMaxEV" in entry:
                row["max_ev"] = entry["HessMaxEV"]
                row["largest"] = entry.get("HessMaxEV_largest")
            row["missing"] = {k: v[:120] for k, v in entry.get("missing", {}).items()}
            rows.append(row)
        out["configs"][config] = {"rows": rows, "error": error}
    return out


def zoo_report(results: list[dict], args) -> str:
    """The zoo table (markdown)."""
    lines = [
        "# Curvature on real architectures, the 1.0.2 loop, default attention",
        "",
        "Made by `python -m benchmarks.studies.curvature_cost "
        f"{' '.join(args.argv)}` at "
        f"commit {_commit()} on {_cpu()}, one torch thread; "
        f"{args.steps} tracked steps per model and configuration (batch 4, float32, "
        f"model seed {args.seed}, batches {100 * args.seed}-"
        f"{100 * args.seed + args.steps - 1}), each followed by a plain step of an "
        "unextended copy; TICTrace added to business and full. Status per quantity "
        "(e = exact from BackPACK, x = exact GGN, E = estimated, m = missing, – = "
        "not tracked); 'curvature' is what HessTrace read; relative standard errors "
        "are medians over the steps: of the summed trace, and the median over "
        "tensors of each tensor's; 'products' are Hessian-vector products "
        "(Hutchinson) or backward passes (GGN) of the estimate, median over the "
        "steps.",
        "",
        "| model | config | tracked / plain (CPU) | HessMaxEV | HessTrace | TICDiag | "
        "TICTrace | curvature | trace rel. SE (sum), median (max) | "
        "per-tensor rel. SE | products | TICTrace rel. SE | error |",
        "| --- | --- | ---: | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: "
        "| --- |",
    ]
    short = {"exact": "e", "exact GGN": "x", "estimated": "E", "missing": "m",
             "–": "–"}  # fmt: skip
    for result in results:
        for config, data in result["configs"].items():
            rows = data["rows"]
            if not rows:
                name = result["spec"]["model"]
                dashes = " | ".join(["–"] * 10)
                lines.append(f"| {name} | {config} | {dashes} | {data['error']} |")
                continue
            ratio = statistics.median(r["tracked"] for r in rows) / statistics.median(
                r["plain"] for r in rows
            )
            status = [
                "/".join(short[r["status"][k]] for r in rows) for k in CURVATURE_KEYS
            ]

            def median(key, rows=rows):
                values = [r[key] for r in rows if r.get(key) is not None]
                return statistics.median(values) if values else None

            def largest(key, rows=rows):
                values = [r[key] for r in rows if r.get(key) is not None]
                return max(values) if values else None

            curvatures = sorted({r["curvature"] for r in rows if "curvature" in r})
            lines.append(
                f"| {result['spec']['model']} | {config} | {ratio:.1f} | "
                + " | ".join(status)
                + f" | {', '.join(curvatures) or '–'} | "
                f"{_fmt(median('trace_rel_se'), '.1%')} "
                f"({_fmt(largest('trace_rel_se'), '.1%')}) | "
                f"{_fmt(median('tensor_rel_se'), '.0%')} | {_fmt(median('probes'))} | "
                f"{_fmt(median('tic_rel_se'), '.1%')} | {data['error'] or '–'} |"
            )
    reasons = {}
    for result in results:
        for data in result["configs"].values():
            for row in data["rows"]:
                for key, reason in row["missing"].items():
                    reasons.setdefault((result["spec"]["model"], key), reason)
    lines += ["", "Why missing (first reason per model and quantity):", ""]
    lines += [f"* {model}, {key}: {reason}…" for (model, key), reason in
              sorted(reasons.items())]  # fmt: skip
    return "\n".join(lines) + "\n"


# --- parent --------------------------------------------------------------------------
def run_child(spec: dict, timeout: float, flag: str = "--child") -> dict:
    """Run one child and return its result."""
    env = {**os.environ, **CHILD_ENV}
    env.pop("PYTHONPATH", None)
    command = [sys.executable, "-m", "benchmarks.studies.curvature_cost", flag,
               json.dumps(spec)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise RuntimeError(f"child failed ({spec}):\n{done.stderr[-3000:]}")


def _median(rows, key):
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def summarise(results: list[dict]) -> list[dict]:
    """Per model, configuration and checkout: medians over the warm steps."""
    table = {}
    for result in results:
        spec = result["spec"]
        key = (spec["model"], spec["config"], spec["variant"])
        table.setdefault(key, []).extend(r for r in result["rows"] if r["step"] > 0)
    references = {}  # (model, step) -> converged eigenvalue
    for result in results:
        for row in result["rows"]:
            if row["reference_ev"] is not None:
                references[(result["spec"]["model"], row["step"])] = row["reference_ev"]
    summary = []
    for (model, config, variant), rows in sorted(table.items()):
        errors = [
            abs(r["hess_max_ev"] - references[(model, r["step"])])
            / abs(references[(model, r["step"])])
            for r in rows
            if r["hess_max_ev"] is not None and (model, r["step"]) in references
        ]
        summary.append({
            "model": model, "config": config, "variant": variant,
            "steps": len(rows),
            "tracked_cpu": _median(rows, "tracked_cpu"),
            "tracked_wall": _median(rows, "tracked_wall"),
            "plain_cpu": _median(rows, "plain_cpu"),
            "lanczos": _median(rows, "lanczos_products"),
            "trace_probes": _median(rows, "trace_probes"),
            "trace_stderr": _median(rows, "trace_stderr"),
            "trace_method": rows[-1]["trace_method"] if rows else None,
            "max_ev_error": max(errors) if errors else None,
            "missing": sorted({m for r in rows for m in r["missing"]}),
        })  # fmt: skip
    return summary


def _fmt(value, spec=".3g"):
    return "–" if value is None else format(value, spec)


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip


def _cpu() -> str:
    return next((line.split(":", 1)[1].strip()
                 for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor())  # fmt: skip


def report(summary: list[dict], results: list[dict], args) -> str:
    """The results file (markdown)."""
    commit, cpu = _commit(), _cpu()
    lines = [
        "# business and full per tracked step against 6fc3e24",
        "",
        "Made by `python -m benchmarks.studies.curvature_cost "
        f"{' '.join(args.argv)}` at "
        f"commit {commit} on {cpu}, one torch thread, "
        f"{time.strftime('%Y-%m-%d')}; reference: {args.reference}. Medians over "
        "the tracked steps after the first; CPU seconds (`time.process_time`).",
        "",
        "| model | config | checkout | tracked s | plain s | tracked / plain | "
        "ours / 6fc3e24 | Lanczos products | trace | trace probes | trace stderr | "
        "HessMaxEV rel. error | missing |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | "
        "---: | --- |",
    ]
    by_key = {(s["model"], s["config"], s["variant"]): s for s in summary}
    for s in summary:
        ref = by_key.get((s["model"], s["config"], "6fc3e24"))
        ratio = (s["tracked_cpu"] / ref["tracked_cpu"]
                 if ref and s["variant"] == "ours" else None)  # fmt: skip
        lines.append(
            f"| {s['model']} | {s['config']} | {s['variant']} | "
            f"{_fmt(s['tracked_cpu'])} | {_fmt(s['plain_cpu'])} | "
            f"{_fmt(s['tracked_cpu'] / s['plain_cpu'])} | {_fmt(ratio)} | "
            f"{_fmt(s['lanczos'])} | {s['trace_method'] or '–'} | "
            f"{_fmt(s['trace_probes'])} | {_fmt(s['trace_stderr'])} | "
            f"{_fmt(s['max_ev_error'], '.1e')} | {', '.join(s['missing']) or '–'} |"
        )
    lines += ["", "Every step (CPU seconds; the first step included):", "",
              "| model | config | checkout | step | tracked s | plain s | HessMaxEV | "
              "reference | Lanczos | trace | trace stderr | probes |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
              "---: | ---: |"]  # fmt: skip
    for result in results:
        spec = result["spec"]
        for r in result["rows"]:
            lines.append(
                f"| {spec['model']} | {spec['config']} | {spec['variant']} | "
                f"{r['step']} | {_fmt(r['tracked_cpu'])} | {_fmt(r['plain_cpu'])} | "
                f"{_fmt(r['hess_max_ev'], '.6g')} | {_fmt(r['reference_ev'], '.6g')} "
                f"| {_fmt(r['lanczos_products'])} | {_fmt(r['trace'], '.4g')} | "
                f"{_fmt(r['trace_stderr'])} | {_fmt(r['trace_probes'])} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """Parse the arguments, run the children interleaved, write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--zoo-child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--zoo",
        default=None,
        help="comma-separated zoo models (tests/utils/hf_models.py, "
        "tiny-gpt): the curvature table of issue 26 instead",
    )
    parser.add_argument(
        "--reference",
        default="/tmp/ref6fc",
        help="worktree of commit 6fc3e24 (default /tmp/ref6fc)",
    )
    parser.add_argument("--models", default="gpt2-small,3c3d")
    parser.add_argument("--configs", default="business,full")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--timeout", type=float, default=7200)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--seed",
        type=int,
        default=1,
        help="zoo: model seed; batches 100 * seed + step (the GGN "
        "count rule was chosen on seed 0)",
    )
    args = parser.parse_args(argv)  # fmt: skip
    if args.child or args.zoo_child:
        work = child if args.child else zoo_child
        result = work(json.loads(args.child or args.zoo_child))
        print(RESULT + json.dumps(result), flush=True)
        return
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.zoo:
        configs = ["economy", "business", "full"]
        results = [
            run_child({"model": model, "root": str(REPO), "steps": args.steps,
                       "configs": configs, "seed": args.seed}, args.timeout,
                      "--zoo-child")
            for model in args.zoo.split(",")
        ]  # fmt: skip
        text = zoo_report(results, args)
        print(text)
        if args.out:
            Path(args.out).write_text(text)
            Path(args.out).with_suffix(".json").write_text(
                json.dumps(results, indent=1)
            )
        return
    roots = {"ours": str(REPO), "6fc3e24": str(Path(args.reference).resolve())}
    results = []
    for model in args.models.split(","):
        for round_ in range(args.rounds):
            variants = ["ours", "6fc3e24"] if round_ % 2 == 0 else ["6fc3e24", "ours"]
            if "sdpa" in model:
                variants = ["ours"]
            for config in args.configs.split(","):
                for variant in variants:
                    spec = {"model": model, "config": config, "variant": variant,
                            "root": roots[variant], "steps": args.steps,
                            "lr": args.lr,
                            "reference_ev": variant == "ours" and round_ == 0
                            and config == "full"}  # fmt: skip
                    print(f"[curvature_cost] {model} {config} {variant} round "
                          f"{round_}", file=sys.stderr, flush=True)  # fmt: skip
                    results.append(run_child(spec, args.timeout))
    text = report(summarise(results), results, args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
