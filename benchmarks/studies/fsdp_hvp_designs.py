"""Hessian-vector products on a ``fully_shard`` model: two designs, side by side.

FSDP2 frees a unit's full parameters after its forward pass and gathers them
again when a backward pass enters the unit through its output (its pre-backward
hook). A Hessian-vector product differentiates the gradient once more; this study
asks whether that second pass can also gather unit by unit, or needs every unit
unsharded at once (what cockpit does, :meth:`Sharding.unsharded`).

* ``unsharded`` (cockpit's design): every unit unsharded and FSDP's resharding
  after a backward pass off while the gradient (with its graph) and the product
  are formed.
* ``per-unit``: FSDP left to gather and reshard each unit as its hooks fire; the
  parameters the gradient's graph saves are packed as references
  (``torch.autograd.graph.saved_tensors_hooks``) and gathered again
  (``DTensor.full_tensor()``) when the product reads them.
* ``resharded``: the same without the packing (the control: the gradient's graph
  then reads parameters whose storage FSDP freed).

Each variant forms ``H v`` of each process's loss for one fixed ``v`` (float64),
on two models of two processes (gloo): ``mlp``, per-``Linear`` units (a backward
pass enters each unit only through its output), and ``blocks``, residual blocks
with a LayerNorm and two ``Linear`` layers each (the product's pass enters a
block at its inner activations too). Recorded per model and variant: the error,
or the largest relative difference from the product of a plain copy of the model
in one process on the same samples, and the peak resident memory above the
model while the gradient and the product are formed, and their seconds (one fresh
process pair per variant). The gradient with its graph, ``v`` and the product are
full-size on each process in every design (``D`` numbers each).

Run from the repository root::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \\
        python -m benchmarks.studies.fsdp_hvp_designs

Results: ``benchmarks/results/fsdp_hvp_designs.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import subprocess
import tempfile
import time

import torch
import torch.multiprocessing as mp


class _Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _model(kind: str, width: int):
    torch.manual_seed(0)
    if kind == "mlp":
        layers = [torch.nn.Linear(width, width), torch.nn.Tanh(),
                  torch.nn.Linear(width, width), torch.nn.Tanh(),
                  torch.nn.Linear(width, 10)]  # fmt: skip
        model = torch.nn.Sequential(*layers)
        units = [m for m in model if isinstance(m, torch.nn.Linear)]
    else:
        model = torch.nn.Sequential(
            _Block(width), _Block(width), torch.nn.Linear(width, 10)
        )
        units = [model[0], model[1]]
    return model.double(), units


def _batch(rank: int, n: int, width: int):
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, width, generator=generator, dtype=torch.float64)
    return x, torch.randint(0, 10, (n,), generator=generator)


def _vector(shapes):
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]


def _reference(kind: str, width: int, rank: int, n: int) -> list[torch.Tensor]:
    """``H v`` of this process's loss on a plain copy of the model."""
    model, _ = _model(kind, width)
    x, y = _batch(rank, n, width)
    params = list(model.parameters())
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    return list(torch.autograd.grad(grads, params, _vector(p.shape for p in params)))


def _worker(rank, world, rendezvous, kind, variant, width, n, out):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from cockpit.distributed.sharded import sharding

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world
    )
    model, units = _model(kind, width)
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    params = list(model.parameters())
    layout = sharding(params, [str(i) for i in range(len(params))], dist.group.WORLD)
    x, y = _batch(rank, n, width)
    wrt = layout.engine_params()
    v = _vector(p.shape for p in params)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {"rank": rank}
    try:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        start = time.perf_counter()
        if variant == "unsharded":
            with layout.unsharded():
                grads = torch.autograd.grad(loss, wrt, create_graph=True)
                product = torch.autograd.grad(grads, wrt, v)
        else:
            ids = {id(p): i for i, p in enumerate(wrt)}
            counts = {"packed": 0, "gathered": 0}

            def pack(tensor):
                base_tensor = tensor._base if tensor._base is not None else tensor
                index = ids.get(id(base_tensor))
                if index is None:
                    return tensor
                view = (tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
                counts["packed"] += 1
                return ("parameter", index, view)

            def unpack(packed):
                if not (isinstance(packed, tuple) and packed[:1] == ("parameter",)):
                    return packed
                _, index, (shape, stride, offset) = packed
                full = params[index].full_tensor()
                counts["gathered"] += 1
                return full.as_strided(shape, stride, offset)

            hooks = (
                torch.autograd.graph.saved_tensors_hooks(pack, unpack)
                if variant == "per-unit"
                else contextlib.nullcontext()
            )
            with hooks:
                grads = torch.autograd.grad(loss, wrt, create_graph=True)
            result["unsharded_before_product"] = sum(
                p.untyped_storage().size() > 0 for p in wrt
            )
            product = torch.autograd.grad(grads, wrt, v)
            result.update(counts)
        result["seconds"] = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result["peak_mb"] = (peak - base) / 1024
        want = _reference(kind, width, rank, n)
        worst = max(
            float((p - w).abs().max() / w.abs().max().clamp(min=1e-300))
            for p, w in zip(product, want, strict=True)
        )
        result["relative_difference"] = worst
    except Exception as error:  # noqa: BLE001 - the outcome of a design
        result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _run(kind, variant, width, n):
    out = tempfile.mkdtemp()
    rendezvous = os.path.join(out, "rendezvous")
    mp.spawn(_worker, args=(2, rendezvous, kind, variant, width, n, out), nprocs=2)
    rows = []
    for rank in range(2):
        with open(os.path.join(out, f"{rank}.json")) as f:
            rows.append(json.load(f))
    return rows


def main() -> None:
    """Both designs on both models; write the results file and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/fsdp_hvp_designs.json")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    results = {"commit": commit, "machine": f"{platform.machine()}, "
               f"{os.cpu_count()} cores", "width": args.width, "batch": args.batch,
               "models": {}}  # fmt: skip
    print("| model | design | outcome per rank | peak MB per rank | seconds |")
    print("|---|---|---|---|---|")
    for kind in ("mlp", "blocks"):
        model, _ = _model(kind, args.width)
        size = sum(p.numel() for p in model.parameters())
        results["models"][kind] = {"parameters": size, "full_mb": size * 8 / 2**20}
        print(f"| {kind}: {size:,} float64 parameters, {size * 8 / 2**20:.0f} MB |||||")
        for variant in ("unsharded", "per-unit", "resharded"):
            rows = _run(kind, variant, args.width, args.batch)
            results["models"][kind][variant] = rows
            outcome = "; ".join(
                r.get("error") or f"max rel. diff {r['relative_difference']:.1e}"
                for r in rows
            )
            peaks = ", ".join(f"{r['peak_mb']:.0f}" for r in rows if "peak_mb" in r)
            seconds = ", ".join(f"{r['seconds']:.2f}" for r in rows if "seconds" in r)
            print(f"| {kind} | {variant} | {outcome} | {peaks} | {seconds} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
