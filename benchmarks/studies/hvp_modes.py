"""Ways to compute many Hessian-vector products: the floor of HessTrace and HessMaxEV.

HessTrace on a model without BackPACK's exact diagonal (the tiny transformer)
spends 16 Hutchinson probes a step, HessMaxEV ~15 Lanczos products; each is one
Hessian-vector product ``H v`` of the mean mini-batch loss. This benchmark times
``probes`` products of one batch four ways, on the same random Rademacher probes:

* ``double backward`` (what cockpit does): the training step's backward pass runs
  with ``create_graph=True``; each product differentiates the gradients again,
  ``torch.autograd.grad(grads, params, v, retain_graph=True)``, one after another;
* ``double backward, batched``: one such call with all probes stacked
  (``is_grads_batched=True``, a ``vmap`` over the second backward pass);
* ``forward-over-reverse, vmap``: ``torch.func.jvp(grad(loss), (params,), (v,))``
  under ``vmap`` over the probes (its own forward and backward pass inside);
* ``forward-over-reverse, loop``: the same ``jvp`` one probe at a time.

The two double-backward modes reuse the graph of the ``create_graph`` backward
pass; its extra cost over a plain backward pass is shown on its own
(``create_graph`` forward+backward against a plain one). Before timing, every mode's
products are checked against the sequential ones (``torch.allclose`` with ``rtol``
1e-4 and ``atol`` 1e-5 times the largest entry; the run fails otherwise). Models:
the benchmark MLP (batch 128) and the tiny transformer of
``examples/char_transformer.py`` (batch 32, MATH attention kernel, which the second
derivative needs), not extended; one torch thread; medians of interleaved rounds.

Run from the repository root (about a minute)::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \\
        python -m benchmarks.studies.hvp_modes

Writes ``--out`` (default ``benchmarks/results/hvp_modes.md``; ``-`` for none)
and prints the same table.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch
from torch.func import functional_call, grad, jvp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import any_model
from benchmarks.driver import RESULTS
from benchmarks.problems import make

DEFAULT_OUT = RESULTS / "hvp_modes.md"
MODES = (
    "double backward",
    "double backward, batched",
    "forward-over-reverse, vmap",
    "forward-over-reverse, loop",
)


class Problem:
    """A plain model, one batch, its mean loss and Rademacher probes."""

    def __init__(self, name: str, probes: int, seed: int = 0):
        if name == "transformer":
            bench = any_model.make_bench(32, need_extended=False, seed=seed)
            self.context = lambda: sdpa_kernel(SDPBackend.MATH)
        else:
            bench = make(name, need_extended=False, seed=seed)
            self.context = contextlib.nullcontext
        self.name, self.model = name, bench.plain
        self.x, self.y = bench.batch(0)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.params = [p for _, p in self.model.named_parameters()]
        self.dim = sum(p.numel() for p in self.params)
        generator = torch.Generator().manual_seed(seed)
        self.probes = [
            [
                torch.randint(0, 2, p.shape, generator=generator).to(p.dtype) * 2 - 1
                for p in self.params
            ]
            for _ in range(probes)
        ]
        self.stacked = [torch.stack(parts) for parts in zip(*self.probes)]

    def loss(self, outputs: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (over the tokens for the transformer)."""
        return torch.nn.functional.cross_entropy(
            outputs.flatten(0, -2), self.y.flatten()
        )

    def functional_loss(self, params: dict) -> torch.Tensor:
        """The loss as a function of a name -> tensor mapping."""
        return self.loss(functional_call(self.model, params, (self.x,)))

    def graph_gradients(self) -> tuple:
        """Forward and ``create_graph`` backward: the gradients with their graph."""
        loss = self.loss(self.model(self.x))
        return torch.autograd.grad(loss, self.params, create_graph=True)

    def plain_pass(self) -> None:
        """Forward and a plain backward pass (no graph kept), for scale."""
        loss = self.loss(self.model(self.x))
        torch.autograd.grad(loss, self.params)

    # the four modes: each returns the products as [probes, dim] -----------------
    def double_backward(self, grads) -> torch.Tensor:
        rows = []
        for probe in self.probes:
            parts = torch.autograd.grad(grads, self.params, probe, retain_graph=True)
            rows.append(torch.cat([p.reshape(-1) for p in parts]))
        return torch.stack(rows)

    def double_backward_batched(self, grads) -> torch.Tensor:
        parts = torch.autograd.grad(
            grads, self.params, self.stacked, retain_graph=True, is_grads_batched=True
        )
        return torch.cat([p.flatten(1) for p in parts], dim=1)

    def _jvp(self, tangents: dict) -> dict:
        primals = {n: p.detach() for n, p in zip(self.names, self.params)}
        return jvp(grad(self.functional_loss), (primals,), (tangents,))[1]

    def forward_over_reverse_vmap(self) -> torch.Tensor:
        out = vmap(self._jvp)(dict(zip(self.names, self.stacked)))
        return torch.cat([out[n].flatten(1) for n in self.names], dim=1)

    def forward_over_reverse_loop(self) -> torch.Tensor:
        rows = []
        for probe in self.probes:
            out = self._jvp(dict(zip(self.names, probe)))
            rows.append(torch.cat([out[n].reshape(-1) for n in self.names]))
        return torch.stack(rows)


def measure(name: str, probes: int = 16, repeats: int = 7) -> dict:
    """Median seconds of each mode (and of the passes around them) on ``name``.

    Returns:
        ``{"problem", "parameters", "probes", "plain", "graph", "modes": {mode:
        seconds}, "max_deviation"}``; ``plain`` is a forward+backward pass,
        ``graph`` the forward+``create_graph`` backward the double-backward modes
        start from (not included in their times).

    Raises:
        AssertionError: If a mode's products disagree with the sequential ones.
    """
    problem = Problem(name, probes)
    with problem.context():
        grads = problem.graph_gradients()
        runs = {
            MODES[0]: lambda: problem.double_backward(grads),
            MODES[1]: lambda: problem.double_backward_batched(grads),
            MODES[2]: problem.forward_over_reverse_vmap,
            MODES[3]: problem.forward_over_reverse_loop,
        }
        reference = runs[MODES[0]]()
        scale = float(reference.abs().max())
        deviation = 0.0
        for mode, run in runs.items():
            products = run()
            deviation = max(deviation, float((products - reference).abs().max()))
            assert torch.allclose(products, reference, rtol=1e-4, atol=1e-5 * scale), (
                name,
                mode,
                float((products - reference).abs().max()),
            )
        extra = {"plain": problem.plain_pass, "graph": problem.graph_gradients}
        times = {key: [] for key in [*runs, *extra]}
        for _ in range(repeats + 1):  # the first round warms up
            for key, run in [*runs.items(), *extra.items()]:
                start = time.perf_counter()
                run()
                times[key].append(time.perf_counter() - start)
    medians = {key: statistics.median(t[1:]) for key, t in times.items()}
    return {
        "problem": name,
        "parameters": problem.dim,
        "probes": probes,
        "plain": medians["plain"],
        "graph": medians["graph"],
        "modes": {mode: medians[mode] for mode in runs},
        "max_deviation": deviation / scale,
    }


def markdown(results: list[dict]) -> str:
    """The table of :func:`measure`'s results."""
    lines = [
        "| problem | parameters | probes | fwd+bwd (ms) | fwd+create_graph bwd (ms) "
        "| mode | ms | ms per product | in fwd+bwd passes | / double backward |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        base = r["modes"][MODES[0]]
        for mode, seconds in r["modes"].items():
            lines.append(
                f"| {r['problem']} | {r['parameters']:,} | {r['probes']} | "
                f"{r['plain'] * 1e3:.2f} | {r['graph'] * 1e3:.2f} | {mode} | "
                f"{seconds * 1e3:.1f} | {seconds / r['probes'] * 1e3:.2f} | "
                f"{seconds / r['probes'] / r['plain']:.2f} | {seconds / base:.2f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", default="mlp,transformer")
    parser.add_argument("--probes", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = [
        measure(name, args.probes, args.repeats) for name in args.problems.split(",")
    ]
    table = markdown(results)
    print(table)
    if args.out != "-":
        header = (
            "# Many Hessian-vector products: four ways\n\n"
            "Made by `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 "
            "python -m benchmarks.studies.hvp_modes` (see its docstring) on "
            f"{date.today().isoformat()}: {platform.processor() or platform.machine()}"
            f", torch {torch.__version__}, one thread; products of every mode "
            "checked against the sequential double backward (largest deviation "
            + ", ".join(f"{r['problem']} {r['max_deviation']:.1e}" for r in results)
            + " of the largest entry).\n\n"
        )
        Path(args.out).write_text(header + table + "\n")


if __name__ == "__main__":
    main()
