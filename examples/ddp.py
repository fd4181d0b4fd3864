"""Data-parallel training (DDP) with cockpit: every number describes the joined batch.

Each process trains on its own shard of every batch (``DistributedSampler``), DDP
averages the gradients, and the cockpit on each process combines the processes'
partial sums, so the log holds the values one process would have computed on the
joined batch of all processes. The loop is the single-process loop; what differs:

1. ``backpack.extend`` the inner model, *then* wrap it in ``DistributedDataParallel``;
2. create the ``Cockpit`` after ``init_process_group``, from the inner model's
   parameters, with the same quantities on every process;
3. ``info`` describes the local shard (``batch_size`` is this process's count);
4. only rank 0 writes the log and draws the dashboard (``cockpit.write`` returns
   ``None`` elsewhere; every process holds the same values).

Run: ``torchrun --nproc_per_node=2 examples/ddp.py [--steps 30] [--out ddp_run]``
(gloo on CPU; with GPUs unchanged: NCCL, each process on ``cuda:LOCAL_RANK``).
``python examples/ddp.py`` runs it as one process. Rank 0 writes ``<out>/log.json``
and ``<out>/dashboard.png``. Data: scikit-learn's digits (no download). See
``docs/distributed.md``.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from backpack import extend
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from cockpit import Cockpit, CockpitPlotter
from cockpit.utils.configuration import configuration


def start_processes() -> tuple[int, int, torch.device]:
    """Join the process group when started by ``torchrun``; else one process.

    Returns:
        This process's rank, the number of processes and its device.
    """
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:  # plain ``python examples/ddp.py``
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)  # before the group: NCCL uses it
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def digits(seed: int = 0):
    """scikit-learn's 8x8 digits, normalised: 1500 for training, the rest held out."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, valid = order[:1500], order[1500:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[valid], y[valid])


@torch.no_grad()
def evaluate(model, data: TensorDataset, device) -> tuple[float, float]:
    """Loss and accuracy of the whole set (the same model on every process)."""
    x, y = (t.to(device) for t in data.tensors)
    outputs = model(x)
    loss = F.cross_entropy(outputs, y).item()
    accuracy = (outputs.argmax(1) == y).float().mean().item()
    return loss, accuracy


def main(
    steps: int = 30, out: str = "ddp_run", batch_size: int = 64, seed: int = 0
) -> dict[str, str] | None:
    """Train with DDP, track with cockpit, write the log and dashboard on rank 0.

    Args:
        steps: Optimizer steps (every one is tracked).
        out: Output folder (rank 0 writes ``log.json`` and ``dashboard.png``).
        batch_size: Samples per process and step (the joined batch is
            ``batch_size`` times the number of processes).
        seed: Random seed (the same on every process).

    Returns:
        Paths of the log and dashboard on rank 0; ``None`` on the other ranks.
    """
    rank, world, device = start_processes()
    try:
        return _train(rank, world, device, steps, out, batch_size, seed)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(rank, world, device, steps, out, batch_size, seed):
    torch.manual_seed(seed)  # the same initial model on every process
    train_set, valid_set = digits(seed)
    # each process draws its own shard; drop_last keeps the shards equal in size
    sampler = DistributedSampler(
        train_set, num_replicas=world, rank=rank, shuffle=True, seed=seed
    )
    loader = DataLoader(
        train_set, batch_size=batch_size, sampler=sampler, drop_last=True
    )

    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    ).to(device)
    model = extend(model)  # BackPACK on the inner model ...
    network = model
    if dist.is_initialized():  # ... and DDP around it (torchrun)
        device_ids = [device.index] if device.type == "cuda" else None
        network = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=device_ids
        )
    loss_fn = extend(torch.nn.CrossEntropyLoss())  # reduction="mean"
    lr = 0.1
    optimizer = torch.optim.SGD(network.parameters(), lr=lr, momentum=0.9)

    # created after init_process_group: process_group="auto" finds the group
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    if rank == 0:
        print(
            f"{world} process(es) on {device.type}; {batch_size} samples per process "
            f"and step, joined batch {batch_size * world}; "
            f"data-parallel cockpit: {cockpit.data_parallel}",
            flush=True,
        )

    # rank 0's progress bar, on a terminal only (disable=None)
    bar = tqdm(total=steps, desc="ddp", unit="step", disable=True if rank else None)
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)  # a new shuffle, the same on every process
        for x, y in loader:
            if step == steps:
                break
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            outputs = network(x)
            loss = loss_fn(outputs, y)
            losses = F.cross_entropy(outputs, y, reduction="none")
            info = {  # this process's shard
                "batch_size": x.shape[0],
                "individual_losses": losses,
                "loss": loss,
                "optimizer": optimizer,
            }
            with cockpit(step, info=info):
                # create_graph is always False in a data-parallel run
                loss.backward(create_graph=cockpit.create_graph(step))
            optimizer.step()

            if step % 10 == 0 or step == steps - 1:
                train_loss, train_acc = evaluate(model, train_set, device)
                valid_loss, valid_acc = evaluate(model, valid_set, device)
                cockpit.log(
                    step, epoch, train_loss, valid_loss, None, train_acc, valid_acc,
                    None, lr,
                )  # fmt: skip
            step += 1
            bar.update()
        epoch += 1
    bar.close()

    logpath = cockpit.write(os.path.join(out, "log"))  # None except on rank 0
    if logpath is None:
        return None
    plotter = CockpitPlotter()
    plotter.plot(
        logpath,
        show_plot=False,
        plot_title=f"DDP on digits: {world} process(es), joined batch "
        f"{batch_size * world}",
    )
    (dashboard,) = plotter.save(os.path.join(out, "dashboard.png"))
    return {"log": logpath, "dashboard": dashboard}


if __name__ == "__main__":
    # PyTorch warns when BackPACK's hook fires on the first layer, whose input needs
    # no gradient; that is expected and harmless.
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="ddp_run")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    paths = main(args.steps, args.out, args.batch_size)
    for name, path in (paths or {}).items():
        print(f"{name}: {path}")
