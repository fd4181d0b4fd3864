"""Any model: cockpit's overhead on the tiny transformer, and its per-sample engine.

Run from the repository root (about five minutes on two quiet CPU cores, most of it
the single quantities and the memory children at batch 256, whose engine steps take
seconds each)::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \
        python -m benchmarks.any_model
    python -m benchmarks.any_model --quick --out /tmp/any_model.json   # tests
    python -m benchmarks.any_model --table benchmarks/results/any_model.json

The model is the character-level transformer of ``examples/char_transformer.py``
(imported from there: width 32, two heads, one pre-LayerNorm block with
``nn.MultiheadAttention``, an embedding tied to the output layer, a learned positional
parameter, residuals; 16,696 parameters in 17 tensors with the 88 characters of Python
3.11's ``textwrap`` source) on windows of 32 characters of that source, ``--batch`` 32
windows a step (four fixed batches, cycled), float32, ``--threads`` 1 torch thread.
Every figure comes from a fresh child process (``python -m benchmarks.any_model --child
...``, started by :func:`benchmarks.measure.spawn` with ``MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=1099511627776``: freed memory is never handed back, so the peak
RSS is the peak heap). Times are wall-clock medians of interleaved pairs
(:func:`benchmarks.measure.interleaved`: at least ``--repeats`` timed pairs after
``--warmup`` untimed ones, more until they took ``--min-time`` seconds; the order within
a pair alternates).

Forward context: every step below (plain and tracked, engine and ``vmap``) runs
inside ``sdpa_kernel(SDPBackend.MATH)``, as in the example: ``full``'s ``HessMaxEV``
needs the double backward that the fused CPU attention kernel lacks, and ``vmap``
has no batching rule for the fused kernel (it falls back to a loop). The case
``economy (default kernel)`` runs plain and tracked steps without it, and its child
also times the plain step both ways (``plain MATH / default``).

1. **Overhead** (``steps``). Plain step: zero_grad, forward, the mean cross-entropy
   over all tokens, backward, SGD step (lr 0.01) of the model, not extended. Tracked
   step: the same on an ``extend``-ed twin with the same weights, inside ``with
   cockpit(step, info=...)`` of a cockpit holding ``economy``, ``business`` or
   ``full`` (every step tracked; ``individual_losses`` is each window's mean token
   loss, with its graph, as in the example; :func:`benchmarks.measure.tracked_step`).
   Ratio = median tracked / median plain. The configuration's child then records which
   engine computed each parameter (``cockpit.coverage()``) and times, against the plain
   step, a forward pass plus cockpit's autograd engine on just the parameters the
   cockpit routed to it (``engine share``: what the per-sample gradients BackPACK
   cannot compute cost inside the tracked step).
2. **Where the time goes** (``members``): each member quantity of the configurations
   tracked alone by a cockpit of its own, against the plain step, in a child of its
   own (a quantity's cost alone includes the per-sample work it shares with others).
3. **Engine against vmap** (``engine``): the per-sample gradients of all 17 parameter
   tensors, by cockpit's autograd engine (the function a cockpit calls for parameters
   BackPACK has no rule for, ``cockpit.engines.autograd.per_sample_gradients``,
   called directly with ``Cockpit.PER_SAMPLE_CHUNK`` and
   ``Cockpit.PER_SAMPLE_MAX_ELEMENTS``; timed with the forward pass it needs) and by
   a plain ``torch.func`` baseline, ``vmap(grad(loss of functional_call(model,
   params, window)))`` over the windows. Before timing, both run on the same batch
   and must agree to rounding (``torch.allclose``, ``rtol`` 1e-4, ``atol`` 1e-5 times
   the largest gradient entry; the child fails otherwise). Timed in interleaved pairs
   (vmap, engine), with a forward+backward pass of the batch (``torch.autograd.grad``
   of the mean loss) after each engine run: the engine does one batched
   vector-Jacobian product through the whole batch's graph per sample, so its floor is
   about ``N`` such backward passes, which ``engine / (fwd+bwd)`` shows. ``--chunks``
   repeats the pair with other chunk sizes.
4. **Memory** (``memory``): at each of ``--memory-batches`` (32 and 256), the peak
   RSS of a child running ``--warmup`` + ``--memory-steps`` steps of one kind only
   (tracked ``economy`` steps, the engine on all parameters, the ``vmap`` baseline)
   minus that of a child running as many plain steps at the same batch, beside the
   size of the per-sample gradients themselves (``N x 16,696 x 4`` bytes). These
   children run ``--jobs`` (2) at a time, after all timing children (a process's
   peak RSS is its own).

Goals (issue 11): economy at most 4x a plain step, full at most 25x, the engine no
slower than the ``vmap`` baseline; each gets a verdict.

Writes the JSON record ``--out`` (default ``benchmarks/results/any_model.json``) and
prints Markdown tables (``--table JSON`` prints them again from a record).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor

from benchmarks import driver, measure, record
from benchmarks.driver import RESULTS

DEFAULT_OUT = RESULTS / "any_model.json"
#: Characters per window (the example's default block).
BLOCK = 32
#: Goals of issue 11: tracked / plain step time.
GOALS = {"economy": 4.0, "full": 25.0}
#: Goal of issue 11: engine / vmap time.
ENGINE_GOAL = 1.0
#: Agreement of the engine with the vmap baseline.
RTOL, ATOL = 1e-4, 1e-5
#: Memory children: tracked economy, the engine, the vmap baseline (and plain).
MEMORY_KINDS = ("economy", "engine", "vmap")
MEMORY_ALL = ("plain", *MEMORY_KINDS)
#: The overhead case without the MATH kernel.
DEFAULT_KERNEL_CASE = "economy (default kernel)"


# ======================================================================================
# child side
# ======================================================================================
def make_bench(batch: int, need_plain=True, need_extended=True, seed=0, batches=4):
    """The example's transformer, a plain copy and an extended twin, fixed batches.

    Returns a :class:`benchmarks.problems.Bench`; ``loss_fn`` is the extended
    ``CrossEntropyLoss`` (applied to the flattened tokens).
    """
    import copy

    import torch
    from backpack import extend

    from benchmarks import internals
    from benchmarks.problems import Bench

    example = internals.load_example("char_transformer")
    text = example.load_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    torch.manual_seed(seed)
    model = example.CharTransformer(len(chars), block=BLOCK)
    generator = torch.Generator().manual_seed(seed + 1)
    windows = []
    for _ in range(batches):
        starts = torch.randint(0, len(data) - BLOCK - 1, (batch,), generator=generator)
        windows.append(
            (
                torch.stack([data[s : s + BLOCK] for s in starts]),
                torch.stack([data[s + 1 : s + BLOCK + 1] for s in starts]),
            )
        )
    return Bench(
        name="char_transformer",
        plain=copy.deepcopy(model) if need_plain else None,
        extended=extend(model) if need_extended else None,
        loss_fn=extend(torch.nn.CrossEntropyLoss()),
        batches=windows,
    )


def window_losses(outputs, y):
    """One loss per window: the mean over its tokens (as in the example)."""
    import torch

    return torch.nn.functional.cross_entropy(
        outputs.transpose(1, 2), y, reduction="none"
    ).mean(1)


class Case:
    """Steps of one kind on the transformer at one batch size and forward context."""

    def __init__(self, config: dict, need_plain=True, need_extended=True):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.torch = torch
        self.config = config
        self.bench = make_bench(config["batch"], need_plain, need_extended)
        self.math = config["context"] == "math"
        self._sdpa = lambda: sdpa_kernel(SDPBackend.MATH)
        self.counts = {"plain": 0, "tracked": 0, "other": 0}
        if need_plain:
            self.params = list(self.bench.plain.parameters())
            self.names = [n for n, _ in self.bench.plain.named_parameters()]
            self.plain_opt = torch.optim.SGD(self.params, lr=0.01)

    def context(self, math=None):
        """The forward context: the MATH attention kernel, or PyTorch's default."""
        math = self.math if math is None else math
        return self._sdpa() if math else contextlib.nullcontext()

    def batch(self, kind: str):
        """The next batch for steps of ``kind`` (each kind cycles on its own)."""
        step = self.counts[kind]
        self.counts[kind] += 1
        return self.bench.batch(step)

    def mean_loss(self, outputs, y):
        """The training loss: mean cross-entropy over all tokens (extended module)."""
        return self.bench.loss_fn(outputs.flatten(0, 1), y.flatten())

    def plain_step(self, math=None) -> None:
        """Zero grads, forward, backward, SGD step on the plain model."""
        x, y = self.batch("plain")
        with self.context(math):
            self.plain_opt.zero_grad()
            self.mean_loss(self.bench.plain(x), y).backward()
            self.plain_opt.step()

    def tracker(self, spec: str):
        """A cockpit tracking ``spec`` on the extended twin, and its step function."""
        from benchmarks import internals

        params = list(self.bench.extended.parameters())
        optimizer = self.torch.optim.SGD(params, lr=0.01)
        cockpit = internals.make_cockpit(params, internals.make_quantities(spec))

        def step() -> None:
            index = self.counts["tracked"]
            with self.context():
                measure.tracked_step(
                    cockpit,
                    self.bench.extended,
                    self.mean_loss,
                    optimizer,
                    self.batch("tracked"),
                    index,
                    window_losses,
                )

        return cockpit, step

    def engine(self, params=None, chunk=None, replay=True):
        """Forward pass and cockpit's per-sample engines (``replay=False``: only
        the fallback, one batched backward pass per sample)."""
        from benchmarks import internals

        settings = internals.engine_settings()
        chunk = chunk or settings["chunk"]
        params = self.params if params is None else params
        if replay and not hasattr(self, "replayer"):
            self.replayer = internals.make_replayer(self.params)
        replayer = self.replayer if replay else None

        def run(batch=None):
            x, y = batch or self.batch("other")
            with self.context():
                if replayer is None and hasattr(self, "replayer"):
                    self.replayer.forget()  # its hooks still record this forward
                losses = window_losses(self.bench.plain(x), y)
                return internals.engine_per_sample_gradients(
                    losses, params, chunk, settings["max_elements"], replayer
                )

        return run

    def vmap(self):
        """The baseline: ``vmap(grad(...))`` of one window's loss over the windows."""
        from torch.func import functional_call, grad, vmap

        F = self.torch.nn.functional
        model, names = self.bench.plain, self.names

        def window_loss(params, x, y):
            outputs = functional_call(model, dict(zip(names, params)), (x[None],))
            return F.cross_entropy(outputs[0], y)

        per_sample = vmap(grad(window_loss), in_dims=(None, 0, 0))

        def run(batch=None):
            x, y = batch or self.batch("other")
            with self.context():
                return per_sample(tuple(p.detach() for p in self.params), x, y)

        return run

    def forward(self):
        """The forward pass and per-sample losses the engine's timing includes."""

        def run():
            x, y = self.batch("other")
            with self.context():
                window_losses(self.bench.plain(x), y)
            if hasattr(self, "replayer"):
                self.replayer.forget()

        return run

    def forward_backward(self):
        """A forward pass and one backward pass of the batch's mean loss."""

        def run():
            x, y = self.batch("other")
            with self.context():
                loss = self.mean_loss(self.bench.plain(x), y)
                self.torch.autograd.grad(loss, self.params)

        return run


def _timing(result: dict, baseline: str, candidate: str, after=None) -> dict:
    """Medians and ratio of an :func:`measure.interleaved` result, named."""
    out = {
        f"{baseline}_s": result["plain_s"],
        f"{candidate}_s": result["tracked_s"],
        "ratio": result["ratio"],
    }
    if after is not None:
        out[f"{after}_s"] = result["extra_s"]
        out[f"{after}_ratio"] = result["extra_ratio"]
    return out


def child_steps(config: dict, args) -> dict:
    """Plain against tracked steps of one configuration or quantity; engine share."""
    from benchmarks import internals

    case = Case(config)
    cockpit, tracked = case.tracker(config["spec"])
    result = _timing(
        measure.interleaved(args, case.plain_step, tracked), "plain", "tracked"
    )
    result["keys"] = internals.recorded_keys(cockpit)
    if config.get("share"):
        routes = internals.engine_routes(cockpit)
        result["routes"] = dict(zip(case.names, routes, strict=True))
        routed = [
            p for p, r in zip(case.params, routes, strict=True) if r == "autograd"
        ]
        if routed:
            share = measure.interleaved(args, case.plain_step, case.engine(routed))
            result["engine_share"] = _timing(share, "plain", "engine")
    if config["context"] != "math":  # what the MATH kernel costs the plain step
        math = measure.interleaved(
            args, case.plain_step, lambda: case.plain_step(math=True)
        )
        result["plain_math"] = _timing(math, "default", "math")
    return result


def child_engine(config: dict, args) -> dict:
    """The engine against the vmap baseline: agreement, then interleaved times."""
    import torch

    from benchmarks import internals

    case = Case(config, need_extended=False)
    engine, vmap = case.engine(), case.vmap()
    batch = case.bench.batch(0)
    ours, theirs = engine(batch), vmap(batch)
    scale = max(float(g.abs().max()) for g in theirs)
    worst = max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))
    close = all(
        a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL * scale)
        for a, b in zip(ours, theirs, strict=True)
    )
    agreement = {
        "checked": True,
        "tensors": len(ours),
        "max_abs_diff": worst,
        "max_abs_value": scale,
        "rtol": RTOL,
        "atol": ATOL * scale,
        "close": close,
    }
    if not close:
        raise AssertionError(f"engine and vmap disagree: {agreement}")
    del ours, theirs
    settings = internals.engine_settings()
    timed = measure.interleaved(args, vmap, engine, case.forward_backward())
    result = {
        "agreement": agreement,
        "settings": settings,
        "num_params": sum(p.numel() for p in case.params),
        "num_tensors": len(case.params),
        "default": _timing(timed, "vmap", "engine", "fwd_bwd"),
        "chunks": {},
    }
    # the training step's own forward pass, which the engine's time includes
    beyond = measure.interleaved(args, case.forward(), engine)
    result["forward"] = _timing(beyond, "forward", "engine")
    fallback = measure.interleaved(args, vmap, case.engine(replay=False))
    result["backward"] = _timing(fallback, "vmap", "engine")
    for chunk in config["chunks"]:
        if chunk != settings["chunk"]:
            other = measure.interleaved(
                args, vmap, case.engine(chunk=chunk, replay=False)
            )
            result["chunks"][str(chunk)] = _timing(other, "vmap", "engine")
    return result


def child_memory(config: dict, args) -> dict:
    """Peak RSS of a process that runs steps of one kind only."""
    kind = config["kind"]
    tracked = kind not in ("plain", "engine", "vmap")
    case = Case(config, need_plain=not tracked, need_extended=tracked)
    if kind == "plain":
        step = case.plain_step
    elif kind == "engine":
        step = case.engine()
    elif kind == "vmap":
        step = case.vmap()
    else:
        step = case.tracker(kind)[1]
    gc.collect()
    before = measure.peak_rss_mib()
    for _ in range(args.warmup + args.memory_steps):
        step()
    return {"peak_rss_mib": measure.peak_rss_mib(), "setup_rss_mib": before}


CHILDREN = {"steps": child_steps, "engine": child_engine, "memory": child_memory}


def child_main(config: dict) -> None:
    """Measure what ``config`` says in this fresh process; print one result line."""
    import warnings

    import torch

    # BackPACK's hooks on modules whose inputs need no gradient, every step
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    args = Namespace(**config["args"])
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result = CHILDREN[config["mode"]](config, args)
    result["threads"] = torch.get_num_threads()
    measure.emit(result)


# ======================================================================================
# parent side
# ======================================================================================
def _args_for_child(args) -> dict:
    """The harness's settings (:data:`benchmarks.record.SETTINGS` but problems)."""
    return {name: getattr(args, name) for name in record.SETTINGS if name != "problems"}


def spawn(config: dict, args) -> dict:
    """Run one child; its result or ``{"error": ...}``."""
    config = dict(config, args=_args_for_child(args))
    return measure.spawn(
        "benchmarks.any_model",
        ["--child", json.dumps(config)],
        args.threads,
        args.timeout,
    )


def _progress(label: str, result: dict, key="ratio") -> None:
    if "error" in result:
        said = "error: " + result["error"]
    elif key in result:
        said = f"{key} {result[key]:.3g}"
    else:
        said = "done"
    print(f"[any_model] {label}: {said}", file=sys.stderr, flush=True)


def members(args) -> dict[str, list[str]]:
    """The quantities to time alone, each with the configurations that hold it."""
    from benchmarks import internals

    found: dict[str, list[str]] = {}
    for label in args.configs:
        for name in internals.configuration_members(label):
            found.setdefault(name, []).append(label)
    if args.members == "all":
        return found
    wanted = [m.strip() for m in args.members.split(",") if m.strip()]
    return {name: found.get(name, []) for name in wanted}


def measure_all(args) -> dict:
    """Every child of the run, in order: steps, engine, members, memory."""
    base = {"batch": args.batch, "context": "math"}
    steps = {}
    for label in args.configs:
        steps[label] = spawn(dict(base, mode="steps", spec=label, share=True), args)
        _progress(label, steps[label])
    if args.default_kernel:
        config = dict(base, mode="steps", spec="economy", context="default", share=True)
        steps[DEFAULT_KERNEL_CASE] = spawn(config, args)
        _progress(DEFAULT_KERNEL_CASE, steps[DEFAULT_KERNEL_CASE])
    engine = spawn(dict(base, mode="engine", chunks=args.chunks), args)
    _progress("engine / vmap", engine.get("default", engine))
    alone = {}
    for name, configs in members(args).items():
        alone[name] = spawn(dict(base, mode="steps", spec=name), args)
        alone[name]["in"] = configs
        _progress(f"{name} alone", alone[name])
    return {
        "steps": steps,
        "members": alone,
        "engine": engine,
        "memory": measure_memory(base, args),
    }


def measure_memory(base: dict, args) -> dict[str, dict]:
    """The memory children, ``--jobs`` at a time (a process's peak is its own)."""
    wanted = [
        (str(batch), kind)
        for batch in args.memory_batches
        for kind in ("plain", *args.memory_kinds)
    ]

    def run(item):
        batch, kind = item
        config = dict(base, mode="memory", kind=kind, batch=int(batch))
        result = spawn(config, args)
        _progress(f"memory N={batch} {kind}", result, "peak_rss_mib")
        return result

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(run, wanted))
    memory: dict[str, dict] = {}
    for (batch, kind), result in zip(wanted, results, strict=True):
        memory.setdefault(batch, {})[kind] = result
    return memory


def verdicts(saved: dict) -> list[dict]:
    """Each goal of issue 11: what was measured, the limit, met or not."""
    found = []
    for label, limit in GOALS.items():
        ratio = saved["steps"].get(label, {}).get("ratio")
        found.append(
            {
                "goal": f"{label} <= {limit:g}x a plain step",
                "measured": ratio,
                "limit": limit,
                "met": None if ratio is None else ratio <= limit,
            }
        )
    ratio = saved["engine"].get("default", {}).get("ratio")
    found.append(
        {
            "goal": "engine no slower than vmap(grad)",
            "measured": ratio,
            "limit": ENGINE_GOAL,
            "met": None if ratio is None else ratio <= ENGINE_GOAL,
        }
    )
    timed = saved["engine"].get("forward")
    if timed is not None and "default" in saved["engine"]:
        marginal = statistics.median(timed["engine_s"]) - statistics.median(
            timed["forward_s"]
        )
        ratio = marginal / statistics.median(saved["engine"]["default"]["vmap_s"])
        found.append(
            {
                "goal": "engine beyond the training step's forward pass no slower "
                "than vmap(grad)",
                "measured": ratio,
                "limit": ENGINE_GOAL,
                "met": ratio <= ENGINE_GOAL,
            }
        )
    return found


# --------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------
def _ms(seconds) -> str:
    if seconds is None:
        return "–"
    if isinstance(seconds, list):
        seconds = statistics.median(seconds)
    return f"{1000 * seconds:.2f}" if seconds < 0.01 else f"{1000 * seconds:.1f}"


def _x(value) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _mib(value) -> str:
    return "–" if value is None else f"{value:.1f}"


def _share(part, whole) -> str:
    if not part or not whole:
        return "–"
    return f"{statistics.median(part) / statistics.median(whole):.0%}"


def _verdict(met) -> str:
    return "–" if met is None else ("met" if met else "**missed**")


def _error(result: dict) -> str:
    return f"error: {result['error']}" if "error" in result else ""


def _memory_extra(saved: dict, batch: str, kind: str):
    row = saved["memory"].get(batch, {})
    plain = row.get("plain", {}).get("peak_rss_mib")
    peak = row.get(kind, {}).get("peak_rss_mib")
    return None if plain is None or peak is None else peak - plain


def table(saved: dict) -> str:
    """The Markdown tables of a record."""
    settings = saved["settings"]
    batch = settings["batch"]
    goals = {v["goal"]: v for v in saved["goals"]}
    lines = [
        f"Tiny transformer (examples/char_transformer.py), batch {batch}, float32, "
        f"{settings['threads']} torch thread(s), every step tracked, MATH attention "
        "kernel unless said otherwise; medians of interleaved pairs.",
        "",
        "| goal | measured | verdict |",
        "| --- | ---: | --- |",
    ]
    for v in saved["goals"]:
        lines.append(f"| {v['goal']} | {_x(v['measured'])} | {_verdict(v['met'])} |")
    first = str(settings["memory_batches"][0])
    lines += [
        "",
        "| configuration | plain ms | tracked ms | tracked / plain | goal | verdict "
        "| per-sample engines (autograd / backpack) | engine share ms "
        f"| engine share / plain | of tracked | peak RSS extra MiB (N={first}) |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for label, r in saved["steps"].items():
        if "error" in r:
            lines.append(f"| {label} | {_error(r)} | | | | | | | | | |")
            continue
        limit = GOALS.get(label)
        goal = goals.get(f"{label} <= {limit:g}x a plain step") if limit else None
        routes = list(r.get("routes", {}).values())
        engines = f"{routes.count('autograd')} / {routes.count('backpack')}"
        share = r.get("engine_share", {})
        memory = _memory_extra(saved, first, label) if label in MEMORY_KINDS else None
        lines.append(
            f"| {label} | {_ms(r['plain_s'])} | {_ms(r['tracked_s'])} "
            f"| {_x(r['ratio'])} | {f'{limit:g}x' if limit else '–'} "
            f"| {_verdict(goal['met']) if goal else '–'} | {engines} "
            f"| {_ms(share.get('engine_s'))} | {_x(share.get('ratio'))} "
            f"| {_share(share.get('engine_s'), r['tracked_s'])} | {_mib(memory)} |"
        )
    default = saved["steps"].get(DEFAULT_KERNEL_CASE, {}).get("plain_math")
    if default:
        lines += [
            "",
            f"Plain step, MATH kernel / default kernel: {_x(default['ratio'])} "
            f"({_ms(default['math_s'])} / {_ms(default['default_s'])} ms).",
        ]
    if saved["members"]:
        lines += [
            "",
            "| quantity alone | in | plain ms | tracked ms | tracked / plain |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        ordered = sorted(
            saved["members"].items(), key=lambda item: -item[1].get("ratio", 0)
        )
        for name, r in ordered:
            where = ", ".join(r.get("in", []))
            if "error" in r:
                lines.append(f"| {name} | {where} | {_error(r)} | | |")
                continue
            lines.append(
                f"| {name} | {where} | {_ms(r['plain_s'])} | {_ms(r['tracked_s'])} "
                f"| {_x(r['ratio'])} |"
            )
    lines += _engine_table(saved, goals)
    lines += _memory_table(saved)
    return "\n".join(lines)


def _engine_table(saved: dict, goals: dict) -> list[str]:
    e = saved["engine"]
    batch = saved["settings"]["batch"]
    if "error" in e:
        return ["", f"Engine against vmap: {_error(e)}"]
    d, a = e["default"], e["agreement"]
    goal = goals["engine no slower than vmap(grad)"]
    fwd_bwd = statistics.median(d["fwd_bwd_s"])
    lines = [
        "",
        f"Per-sample gradients of all {e['num_tensors']} tensors ({e['num_params']:,} "
        f"numbers), N={batch}. Agreement checked before timing: max |engine - vmap| "
        f"= {a['max_abs_diff']:.2g} (largest entry {a['max_abs_value']:.2g}; "
        f"allclose rtol {a['rtol']:g}, atol {a['atol']:.2g}): "
        f"{'agree' if a['close'] else 'DISAGREE'}. Forward+backward of the batch: "
        f"{_ms(fwd_bwd)} ms.",
        "",
        f"| method | chunk | ms | / vmap | / (fwd+bwd of the batch; N = {batch}) "
        "| goal | verdict |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- |",
        f"| vmap(grad(functional_call)) | – | {_ms(d['vmap_s'])} | 1 "
        f"| {_x(statistics.median(d['vmap_s']) / fwd_bwd)} | – | – |",
        f"| cockpit's engines as a cockpit runs them (replay, then fallback) | – "
        f"| {_ms(d['engine_s'])} "
        f"| {_x(d['ratio'])} | {_x(statistics.median(d['engine_s']) / fwd_bwd)} "
        f"| <= vmap | {_verdict(goal['met'])} |",
    ]
    if "forward" in e:
        f = e["forward"]
        marginal = statistics.median(f["engine_s"]) - statistics.median(f["forward_s"])
        vmap = statistics.median(d["vmap_s"])
        lines.append(
            "| the same beyond the training step's forward pass (engine - forward "
            f"{_ms(f['forward_s'])} ms, timed in pairs) | – | {marginal * 1e3:.3g} "
            f"| {_x(marginal / vmap)} | {_x(marginal / fwd_bwd)} | <= vmap "
            f"| {_verdict(marginal <= vmap)} |"
        )
    rows = []
    if "backward" in e:  # older records timed the fallback alone as the engine
        rows.append((e["settings"]["chunk"], e["backward"]))
    rows += list(e["chunks"].items())
    for chunk, c in rows:
        lines.append(
            "| fallback alone: one batched backward pass per sample "
            f"| {chunk} | {_ms(c['engine_s'])} "
            f"| {_x(c['ratio'])} | {_x(statistics.median(c['engine_s']) / fwd_bwd)} "
            "| – | – |"
        )
    return lines


def _memory_table(saved: dict) -> list[str]:
    batches = [str(b) for b in saved["settings"]["memory_batches"]]
    numbers = saved["engine"].get("num_params")
    heads = " | ".join(f"N={b}" for b in batches)
    lines = [
        "",
        "Peak RSS extra over a child running as many plain steps at the same batch, "
        f"MiB, after {saved['settings']['warmup'] + saved['settings']['memory_steps']} "
        "steps.",
        "",
        f"| steps | {heads} | last / first | batch last / first |",
        "| --- |" + " ---: |" * (len(batches) + 2),
    ]
    factor = int(batches[-1]) / int(batches[0])
    measured = {kind for row in saved["memory"].values() for kind in row}
    for kind in (k for k in MEMORY_ALL if k in measured):
        if kind == "plain":
            values = [
                saved["memory"][b].get("plain", {}).get("peak_rss_mib") for b in batches
            ]
        else:
            values = [_memory_extra(saved, b, kind) for b in batches]
        growth = (
            values[-1] / values[0]
            if None not in (values[0], values[-1]) and values[0] > 0
            else None
        )
        cells = " | ".join(_mib(v) for v in values)
        name = "plain (its own peak)" if kind == "plain" else kind
        lines.append(f"| {name} | {cells} | {_x(growth)} | {factor:g} |")
    if numbers:
        cells = " | ".join(_mib(int(b) * numbers * 4 / 2**20) for b in batches)
        lines.append(
            f"| (per-sample gradients, N x {numbers:,} x 4 B) | {cells} "
            f"| {factor:g} | {factor:g} |"
        )
    errors = [
        f"N={b} {kind}: {_error(r)}"
        for b in batches
        for kind, r in saved["memory"][b].items()
        if "error" in r
    ]
    return lines + ([""] + errors if errors else [])


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = sorted(set(names) - set(MEMORY_KINDS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown memory kind(s) {', '.join(unknown)}; choose from "
            + ", ".join(MEMORY_KINDS)
        )
    return names


def parse(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.any_model",
        description="cockpit on the tiny transformer: overhead, engine, memory.",
    )
    parser.add_argument("--batch", type=int, default=None, help="windows per step")
    parser.add_argument("--memory-batches", type=_ints, default=None, metavar="N,M")
    parser.add_argument(
        "--memory-kinds",
        type=_names,
        default=list(MEMORY_KINDS),
        metavar="KIND,KIND",
        help=f"memory children beside 'plain' (default: {','.join(MEMORY_KINDS)})",
    )
    parser.add_argument("--configs", default="economy,business,full")
    parser.add_argument(
        "--members",
        default=None,
        help="quantities timed alone: 'all' (the configurations' members), a comma "
        "list, or '' for none",
    )
    parser.add_argument(
        "--chunks", type=_ints, default=None, help="other engine chunk sizes to time"
    )
    parser.add_argument(
        "--no-default-kernel",
        dest="default_kernel",
        action="store_false",
        help="skip the economy case without the MATH attention kernel",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed pairs")
    parser.add_argument("--warmup", type=int, default=None, help="untimed pairs")
    parser.add_argument("--min-time", type=float, default=None, help="timed seconds")
    parser.add_argument("--memory-steps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--jobs", type=int, default=2, help="memory children run at the same time"
    )
    parser.add_argument("--clock", choices=sorted(measure.CLOCKS), default="wall")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds/child")
    parser.add_argument("--quick", action="store_true", help="tiny settings (tests)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON record")
    parser.add_argument("--table", metavar="JSON", help="print a record's tables")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = {
        "batch": (8, 32),
        "memory_batches": ([8, 16], [32, 256]),
        "members": ("HessTrace", "all"),
        "chunks": ([1], [1, 32]),
        "repeats": (2, 9),
        "warmup": (1, 2),
        "min_time": (0.0, 4.0),
        "memory_steps": (1, 3),
    }
    driver.fill_defaults(args, args.quick, defaults)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    return args


def _settings(args) -> dict:
    return _args_for_child(args) | {
        "batch": args.batch,
        "memory_batches": args.memory_batches,
        "memory_kinds": args.memory_kinds,
        "jobs": args.jobs,
        "configs": args.configs,
        "block": BLOCK,
        "context": "math",
        "timeout": args.timeout,
    }


def _add_goals(saved: dict) -> None:
    saved["goals"] = verdicts(saved)


def main(argv=None) -> int:
    """Measure (or print a record's tables, or run one child); see the module."""
    return driver.main(
        argv,
        parse,
        child_main=child_main,
        render=table,
        measure_all=measure_all,
        settings=_settings,
        sections=("steps", "engine", "members", "memory"),
        complete=_add_goals,
    )


if __name__ == "__main__":
    sys.exit(main())
