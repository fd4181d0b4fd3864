"""Sharded training (FSDP2, ``fully_shard``) with cockpit: the joined batch's numbers.

Two processes (``mp.spawn``, gloo on CPU) train an MLP whose parameters are sharded
with ``torch.distributed.fsdp.fully_shard`` (each ``Linear`` a unit, then the
root). Each process trains on its own half of every batch; the cockpit on each
process computes on its rows of the parameters and of the joined gradient and sums
with the others, so every process holds the values one process would have
computed on the joined batch (and none forms the model's full gradient). The loop
is the single-process loop; what differs:

1. ``fully_shard`` the model (``backpack.extend`` is not needed: cockpit serves
   sharded models with its ghost and autograd engines);
2. create the ``Cockpit`` after ``init_process_group`` and ``fully_shard``, from
   ``model.named_parameters()`` (the sharded ``DTensor`` s), on every process;
3. ``info`` describes the local shard (``batch_size`` is this process's count);
4. rank 0 writes the log.

Second-order quantities work too: HessMaxEV here, every fifth step. Cockpit
differentiates each process's loss twice itself, before the backward pass, with
every unit unsharded meanwhile (``cockpit.create_graph(step)`` is ``False`` in a
distributed run, so the loop is the usual one).

Run: ``python examples/fsdp.py [--steps 10] [--out fsdp_run]``. Rank 0 writes
``<out>/log.json`` and prints the last step's values. See ``docs/distributed.md``.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD = 2


def make_model() -> torch.nn.Module:
    """The MLP, the same on every process (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


def joined_batches(steps: int):
    """The joined batches ``(x, y)`` of every step, the same on every process."""
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 4, generator=generator)
    for _ in range(steps):
        x = torch.randn(WORLD * 32, 16, generator=generator)
        yield x, (x @ teacher).argmax(1)


def worker(rank: int, rendezvous: str, steps: int, out: str) -> None:
    """One process: shard the model, train on this process's samples, track."""
    from torch.distributed.fsdp import fully_shard

    from cockpit import Cockpit, quantities
    from cockpit.utils.configuration import configuration
    from cockpit.utils.schedules import linear

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD
    )
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)  # one unit per layer ...
    fully_shard(model)  # ... and the root
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(
        model.named_parameters(),
        quantities=configuration("economy")
        + [quantities.Variance(linear(1)), quantities.HessMaxEV(linear(5))],
    )
    for step, (x, y) in enumerate(joined_batches(steps)):
        x, y = x[rank * 32 : (rank + 1) * 32], y[rank * 32 : (rank + 1) * 32]
        optimizer.zero_grad()
        outputs = model(x)
        loss = F.cross_entropy(outputs, y)
        info = {
            "batch_size": x.shape[0],
            "individual_losses": F.cross_entropy(outputs, y, reduction="none"),
            "loss": loss,
            "optimizer": optimizer,
        }
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    path = cockpit.write(os.path.join(out, "log"))
    if path is not None:
        last = cockpit.history.view(steps - 1)
        shown = {k: last[k] for k in ("Loss", "GradNorm", "Variance") if k in last}
        sharpness = cockpit.history.view(0).get("HessMaxEV")
        print(
            f"rank {rank} wrote {path}; step {steps - 1}: {shown}; "
            f"HessMaxEV at step 0: {sharpness}"
        )
    dist.destroy_process_group()


def main() -> None:
    """Start two processes (``mp.spawn``) that meet at a file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="fsdp_run")
    args = parser.parse_args()
    with socket.socket() as s:  # unused port (for code reading MASTER_PORT)
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")
    mp.spawn(worker, args=(rendezvous, args.steps, args.out), nprocs=WORLD)


if __name__ == "__main__":
    main()
