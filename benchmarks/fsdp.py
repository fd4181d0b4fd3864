"""FSDP2 (``fully_shard``): a tracked step against a plain FSDP step, per rank.

Run from the repository root::

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 python -m benchmarks.fsdp
    python -m benchmarks.fsdp --quick            # smaller, for a busy machine

For 2 and 4 processes (gloo, one torch thread each) an MLP of a few million
float32 parameters (``--width``; per-``Linear`` units and the root wrapped with
``fully_shard``) trains on ``--batch`` samples per process.

* **Time**: each process holds both variants of a step and times them in
  interleaved rounds (the order alternates): ``plain`` (zero_grad, forward,
  backward, SGD step of the FSDP model, no cockpit) and ``tracked`` (the same
  inside ``with cockpit(step, ...)`` with a configuration tracked every step:
  ``--configurations``, default ``economy``, ``business`` and ``full``; their
  HessTrace and ``full``'s HessMaxEV differentiate with every unit unsharded).
  Medians per rank and their ratio, per configuration; for ``full`` also
  HessMaxEV's Hessian-vector products per step.
* **Memory**: peak resident memory per rank (``ru_maxrss``) of a fresh set of
  processes running only one variant, after building the model, minus what the
  model and one plain warm-up step took (malloc keeps freed memory with the
  settings above, so the peak is the high-water mark); with ``--memory-runs k``
  the median per rank of ``k`` such sets (the peak moves by up to a few hundred
  MB between sets on a model of tens of millions of parameters).
  ``--depth``: the hidden layers (each its own unit).

Results go to ``benchmarks/results/fsdp.json`` (``--out``) with the commit and the
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _model(width: int, depth: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _worker(rank, world, rendezvous, args, mode, label, out):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    from benchmarks import internals

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world
    )
    model = _model(args.width, args.depth)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)

    def step(cockpit=None, index=0):
        optimizer.zero_grad()
        outputs = model(x)
        loss = F.cross_entropy(outputs, y)
        if cockpit is None:
            loss.backward()
        else:
            losses = F.cross_entropy(outputs, y, reduction="none")
            info = {"batch_size": args.batch, "loss": loss, "optimizer": optimizer,
                    "individual_losses": losses}  # fmt: skip
            with cockpit(index, info=info):
                loss.backward(create_graph=cockpit.create_graph(index))
        optimizer.step()

    step()  # warm-up
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cockpit = None
    if mode in ("time", "tracked"):
        chosen = internals.make_quantities(label)
        cockpit = internals.make_cockpit(model.parameters(), chosen, diagnose=False)
    result = {"rank": rank}
    if mode == "time":
        times = {"plain": [], "tracked": []}
        for r in range(args.rounds):
            order = ["plain", "tracked"] if r % 2 == 0 else ["tracked", "plain"]
            for variant in order:
                start = time.perf_counter()
                step(cockpit if variant == "tracked" else None, r)
                times[variant].append(time.perf_counter() - start)
        result.update({k: statistics.median(v[1:]) for k, v in times.items()})
        products = [q.last_num_hvps for q in chosen if hasattr(q, "last_num_hvps")]
        if products:
            result["hvps_last_step"] = products[0]
    else:
        for r in range(args.memory_steps):
            step(cockpit, r)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result["peak_mb"] = (peak - base) / 1024
    with open(os.path.join(out, f"{mode}{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _run(world, args, mode, label=None):
    out = tempfile.mkdtemp()
    rendezvous = os.path.join(out, "rendezvous")
    mp.spawn(_worker, args=(world, rendezvous, args, mode, label, out), nprocs=world)
    rows = []
    for rank in range(world):
        with open(os.path.join(out, f"{mode}{rank}.json")) as f:
            rows.append(json.load(f))
    return rows


def _peaks(world, args, mode, label=None) -> dict:
    """Per rank, the peak of ``--memory-runs`` fresh process sets and its median."""
    runs = [
        [r["peak_mb"] for r in _run(world, args, mode, label)]
        for _ in range(args.memory_runs)
    ]
    return {"runs": runs, "median": [statistics.median(r) for r in zip(*runs)]}


def main() -> None:
    """Measure at 2 and 4 processes; write the results file and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1200)
    parser.add_argument("--depth", type=int, default=2, help="hidden layers")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument(
        "--memory-runs", type=int, default=1,
        help="fresh process sets per variant for the peak (median per rank)",
    )  # fmt: skip
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--configurations", default="economy,business,full")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/fsdp.json")
    args = parser.parse_args()
    if args.quick:
        args.width, args.rounds, args.memory_steps = 600, 5, 2
    params = sum(p.numel() for p in _model(args.width, args.depth).parameters())
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    results = {"commit": commit, "machine": f"{platform.machine()}, "
               f"{os.cpu_count()} cores", "parameters": params,
               "settings": vars(args), "worlds": {}}  # fmt: skip
    print(f"{params:,} parameters, {args.batch} samples per process")
    print("| processes | configuration | plain step (ms) | tracked step (ms) | ratio "
          "| peak MB plain | peak MB tracked |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for world in [int(w) for w in args.worlds.split(",")]:
        plain_mem = _peaks(world, args, "plain")
        row = {"peak_mb_plain": plain_mem["median"], "peak_mb_plain_runs":
               plain_mem["runs"], "configurations": {}}  # fmt: skip
        for label in args.configurations.split(","):
            timed = _run(world, args, "time", label)
            tracked_mem = _peaks(world, args, "tracked", label)
            plain = statistics.median(r["plain"] for r in timed)
            tracked = statistics.median(r["tracked"] for r in timed)
            row["configurations"][label] = cell = {
                "per_rank": timed,
                "plain_ms": 1e3 * plain,
                "tracked_ms": 1e3 * tracked,
                "ratio": tracked / plain,
                "peak_mb_tracked": tracked_mem["median"],
                "peak_mb_tracked_runs": tracked_mem["runs"],
            }
            print(f"| {world} | {label} | {cell['plain_ms']:.1f} | "
                  f"{cell['tracked_ms']:.1f} | {cell['ratio']:.2f} | "
                  f"{max(row['peak_mb_plain']):.1f} | "
                  f"{max(cell['peak_mb_tracked']):.1f} |")  # fmt: skip
        results["worlds"][str(world)] = row
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
