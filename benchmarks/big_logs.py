"""Synthetic cockpit logs of any size, shaped like a long ``full`` run's.

Used by :mod:`benchmarks.cli_memory` (and the tests, at small sizes) to measure how
reading scales with the log. A log is written by cockpit's own writers
(:func:`cockpit.log.stream.record_line` for a streamed log,
:meth:`cockpit.history.History.write_json` for a written one, ``legacy=True`` for
cockpit-for-pytorch 1.0.2's format), so only the values are synthetic, and they
have the keys and shapes a ``full`` configuration tracking every step writes for a
model with :data:`PARAMS` parameter tensors (the 3c3d layout: three convolutions and
three linear layers, weight and bias each):

* scalars ``Loss``, ``Alpha``, ``NormTest``, ``InnerTest``, ``OrthoTest``,
  ``HessMaxEV``, ``TICDiag``, and ``learning_rates`` (a one-element list);
* per-parameter lists ``GradNorm``, ``Distance``, ``UpdateSize``, ``HessTrace``;
* ``GradHist1d``: 100 bins (counts of ~250,000 gradient elements) and 101 edges,
  the range adapted now and then; ``GradHist2d``: 40 x 50 counts (mostly zero,
  written sparse) and the edges of both axes;
* a few steps with non-finite values (``NaN`` losses, a ``nonfinite`` entry) and
  ``missing`` entries with reasons, as cockpit records them.

In a streamed log each step is two records, as a run writes them: the step's
values, and ``Alpha`` / ``UpdateSize`` (two-step quantities) one step later. The
values follow a plausible training run (a decaying loss with noise and spikes, norms
that shrink, a distance that grows), drawn from a seeded generator: the same
arguments give the same file.

Generate one from the shell::

    python -m benchmarks.big_logs --mb 200 --kind stream --out /tmp/big.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any, Iterator

import numpy as np

from cockpit.history import History
from cockpit.log.format import encode_legacy, pack
from cockpit.log.stream import _HEADER, record_line

#: Parameter tensors of the synthetic model (3c3d: 3 conv + 3 linear, weight + bias).
PARAMS = 12
#: Bins of the 1-D histogram and of the 2-D histogram's two axes (cockpit's default).
BINS_1D, BINS_2D = 100, (40, 50)
#: Gradient elements counted in each histogram (batch 128 x ~2,000 elements).
ELEMENTS = 250_000
#: Steps (every this many) with non-finite values, and with a missing value.
NONFINITE_EVERY, MISSING_EVERY = 9973, 1009


class Run:
    """The synthetic values of a run, step by step (seeded)."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        rng = self.rng
        self.scale = np.exp(rng.normal(0.0, 1.0, PARAMS))
        x = np.linspace(-12, 12, BINS_1D)  # a wide range: the tails stay empty
        self.shape_1d = np.exp(-0.5 * x**2)
        gx, gy = np.meshgrid(
            np.linspace(-3, 3, BINS_2D[1]), np.linspace(-3, 3, BINS_2D[0])
        )
        self.shape_2d = np.exp(-4 * gx**2 - 16 * gy**2)
        self.shape_2d[self.shape_2d < 1e-4] = 0.0
        self.range_1d = 2.0
        self.distance = np.zeros(PARAMS)

    def values(self, step: int) -> dict[str, Any]:
        """The values recorded at ``step`` (except the two-step ones)."""
        rng = self.rng
        decay = 1.0 / math.sqrt(1.0 + step / 500.0)
        loss = 2.3 * decay + 0.05 * abs(rng.normal())
        if rng.random() < 1e-3:
            loss *= 5.0  # a spike
        grad = self.scale * decay * np.exp(rng.normal(0.0, 0.1, PARAMS))
        self.distance += 0.01 * grad * np.abs(rng.normal(1.0, 0.2, PARAMS))
        if step % 2000 == 0:  # bin adaptation: the range follows the gradients
            self.range_1d = float(np.round(2.0 * decay + 0.1, 3))
        hist_1d = rng.poisson(self.shape_1d * ELEMENTS / self.shape_1d.sum())
        hist_2d = rng.poisson(self.shape_2d * ELEMENTS / self.shape_2d.sum())
        values: dict[str, Any] = {
            "Loss": float(loss),
            "learning_rates": [0.01],
            "GradNorm": grad.tolist(),
            "Distance": self.distance.tolist(),
            "NormTest": float(abs(rng.normal(1.0, 0.3))),
            "InnerTest": float(abs(rng.normal(0.1, 0.05))),
            "OrthoTest": float(abs(rng.normal(1.0, 0.2))),
            "HessMaxEV": float(abs(rng.normal(5.0, 1.0)) * decay),
            "HessTrace": (
                self.scale * 10 * decay * rng.uniform(0.8, 1.2, PARAMS)
            ).tolist(),
            "TICDiag": float(abs(rng.normal(2500.0, 300.0))),
            "GradHist1d": {
                "hist": hist_1d,
                "edges": np.linspace(-self.range_1d, self.range_1d, BINS_1D + 1),
            },
            "GradHist2d": {
                "hist": hist_2d,
                "edges": [
                    np.linspace(-1.0, 1.0, BINS_2D[0] + 1),
                    np.linspace(-2.0, 2.0, BINS_2D[1] + 1),
                ],  # fmt: skip
            },
        }
        if step % NONFINITE_EVERY == NONFINITE_EVERY - 1:
            values["Loss"] = math.nan
            values["GradNorm"] = [math.inf] * PARAMS
            values["nonfinite"] = ["loss", "gradients"]
        if step % MISSING_EVERY == MISSING_EVERY - 1:
            del values["HessMaxEV"]
            values["missing"] = {
                "HessMaxEV": "the power iteration did not converge in 20 steps"
            }
        return values

    def late(self) -> dict[str, Any]:
        """The two-step values of the previous step (``Alpha``, ``UpdateSize``)."""
        rng = self.rng
        return {
            "Alpha": float(rng.normal(0.0, 0.5)),
            "UpdateSize": (0.01 * self.scale * rng.uniform(0.5, 1.5, PARAMS)).tolist(),
        }


def records(steps: int, seed: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(step, values)`` as a streamed log holds them: a step's values, then the
    previous step's two-step values."""
    run = Run(seed)
    for step in range(steps):
        yield step, run.values(step)
        if step > 0:
            yield step - 1, run.late()


def write_stream(path: str, steps: int, seed: int = 0) -> int:
    """Write a streamed log of ``steps`` steps; return its size in bytes."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(_HEADER + "\n")
        for step, values in records(steps, seed):
            handle.write(record_line(step, values))
    return os.path.getsize(path)


def _steps(steps: int, seed: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each step's values merged (as a written log holds them), in step order."""
    pending: dict[int, dict[str, Any]] = {}
    for step, values in records(steps, seed):
        pending.setdefault(step, {}).update(values)
        done = [s for s in pending if s < step - 1]
        for s in sorted(done):
            yield s, pending.pop(s)
    for s in sorted(pending):
        yield s, pending.pop(s)


def write_json(path: str, steps: int, seed: int = 0, legacy: bool = False) -> int:
    """Write a log as ``Cockpit.write`` does (``legacy``: as 1.0.2 did); its size.

    Step by step, with the encoding of :meth:`History.write_json`: packed, one line
    per step (ours), or json_tricks' ``__ndarray__`` objects with indent 4 (1.0.2).
    """
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("{\n")
        for index, (step, values) in enumerate(_steps(steps, seed)):
            stored = History({step: values})
            if legacy:
                entries = encode_legacy(stored.to_output()[step])
                text = json.dumps({str(step): entries}, indent=4, sort_keys=True)
                text = text[1:-1].strip("\n")  # without the outer braces
            else:
                packed = pack(stored._data[step])
                text = f"{json.dumps(str(step))}: " + json.dumps(
                    packed, separators=(",", ":"), sort_keys=True, allow_nan=False
                )
            handle.write(("" if index == 0 else ",\n") + text)
        handle.write("\n}\n")
    return os.path.getsize(path)


def bytes_per_step(kind: str, seed: int = 0, sample: int = 200) -> float:
    """The mean size of a step in a log of this kind (from a sample of steps)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "sample")
        size = write_log(path, kind, sample, seed)
    return size / sample


def write_log(path: str, kind: str, steps: int, seed: int = 0) -> int:
    """Write a log of ``kind`` (``stream``, ``json`` or ``legacy``); its size."""
    if kind == "stream":
        return write_stream(path, steps, seed)
    if kind in ("json", "legacy"):
        return write_json(path, steps, seed, legacy=kind == "legacy")
    raise ValueError(f"kind must be stream, json or legacy, got {kind!r}")


def steps_for(megabytes: float, kind: str, seed: int = 0) -> int:
    """How many steps make a log of about ``megabytes`` MB (10^6 bytes)."""
    return max(1, round(megabytes * 1e6 / bytes_per_step(kind, seed)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the log file to write")
    parser.add_argument(
        "--kind", default="stream", choices=["stream", "json", "legacy"]
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--mb", type=float, help="about this many MB")
    size.add_argument("--steps", type=int, help="this many steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps = args.steps or steps_for(args.mb, args.kind, args.seed)
    written = write_log(args.out, args.kind, steps, args.seed)
    print(f"{args.out}: {steps} steps, {written / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
