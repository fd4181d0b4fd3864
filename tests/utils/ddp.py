"""Data-parallel test runs: real ``torch.distributed`` processes (gloo, CPU, float64).

:func:`launch` starts one process per rank; each trains with DDP on its shard of the
joined batches and writes its cockpit history to a file. :func:`train` runs the same
training in one process on the joined batches (the reference). A worker that raises
writes the error instead, so tests can check what every rank said.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import traceback
import uuid
from typing import Any

import torch
from backpack import extend

from cockpit import Cockpit, quantities
from cockpit.quantities.bin_adaptation import GradAbsMax
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.utils.any_model import Gate

DTYPE = torch.float64


class _GatedGRU(torch.nn.Module):
    """A GRU classifier with a gate: no BackPACK rules for either.

    The autograd engine computes both: the gate by a replay of the gate alone, the
    GRU (which ``vmap`` cannot batch) by one batched backward pass per sample.
    """

    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(3, 4, batch_first=True)
        self.gate = Gate(4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.gate(self.gru(x)[0][:, -1]))


def make_model(kind: str) -> torch.nn.Module:
    """The model of a case, the same on every process (seeded)."""
    torch.manual_seed(0)
    if kind == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)
        )
    elif kind == "cnn":
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 2, 3),
            torch.nn.Sigmoid(),
            torch.nn.Flatten(),
            torch.nn.Linear(2 * 3 * 3, 3),
        )
    elif kind == "gru":
        model = _GatedGRU()
    else:
        raise ValueError(kind)
    return extend(model.to(DTYPE))


def make_inputs(kind: str, generator, n: int) -> torch.Tensor:
    if kind == "mlp":
        return torch.randn(n, 5, generator=generator, dtype=DTYPE)
    if kind == "cnn":
        return torch.randn(n, 1, 5, 5, generator=generator, dtype=DTYPE)
    return torch.randn(n, 4, 3, generator=generator, dtype=DTYPE)


def joined_batches(kind: str, sizes: list[int]):
    """The joined batch of every step (the same data on every process)."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for n in sizes:
        x = make_inputs(kind, generator, n)
        y = torch.randint(0, 3, (n,), generator=generator)
        batches.append((x, y))
    return batches


def shard_counts(n: int, world: int) -> list[int]:
    """Split ``n`` samples over ``world`` processes, the larger shards first."""
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


def make_quantities(case: dict[str, Any]):
    """The quantities of a case: full (or economy) plus Variance, MeanGSNR, ..."""
    every = linear(1)
    label = case.get("configuration", "full")
    chosen = configuration(label, every)
    chosen += [
        quantities.Variance(every),
        quantities.MeanGSNR(every),
        quantities.GradHist1d(
            every, bins=7, adapt=GradAbsMax(linear(2)), key="GradHist1dAdaptive"
        ),
    ]
    if label == "full":
        chosen += [
            quantities.TICTrace(every),
            quantities.TICDiag(every, curvature="diag_ggn_exact", key="TICDiagGGN"),
            quantities.GradHist2d(every, bins=(5, 4), keep_individual=True, key="H2"),
        ]
    if case["optimizer"] == "sgd":
        chosen += [quantities.CABS(every), quantities.EarlyStopping(every)]
    if label == "economy" and case.get("curvature"):  # both from the same probes
        chosen += [quantities.HessTrace(every), quantities.TICTrace(every)]
    if case.get("hutchinson"):  # the Hessian's estimate beside the GGN's
        chosen += [
            quantities.HessTrace(every, curvature="hutchinson", key="HessTraceH")
        ]
    if case.get("tic_diag"):  # takes only an exact curvature diagonal
        chosen += [
            quantities.TICDiag(every, curvature="diag_ggn_exact", key="TICDiagGGN")
        ]
    return chosen


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.3)
    return torch.optim.Adam(params, lr=0.05)


def train(
    case: dict[str, Any],
    rank: int | None = None,
    world: int | None = None,
    ddp_group=None,
    **cockpit_kwargs,
) -> Cockpit:
    """Train a case: on the joined batches (``rank=None``) or on one shard (DDP).

    ``rank`` and ``world`` place the shard within the data-parallel group, which is
    ``ddp_group`` (default: every process).
    """
    model = make_model(case["model"])
    network = model
    if rank is not None:
        network = torch.nn.parallel.DistributedDataParallel(
            model, process_group=ddp_group
        )
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(case["optimizer"], params)
    cockpit = Cockpit(
        params, quantities=make_quantities(case), diagnose=False, **cockpit_kwargs
    )
    batches = case.get("batches") or joined_batches(case["model"], case["sizes"])
    _steps(network, loss_fn, optimizer, cockpit, batches, rank, world)
    return cockpit


def _steps(network, loss_fn, optimizer, cockpit, batches, rank, world) -> None:
    for step, (x, y) in enumerate(batches):
        if rank is not None:
            counts = shard_counts(x.shape[0], world)
            start = sum(counts[:rank])
            x, y = x[start : start + counts[rank]], y[start : start + counts[rank]]
        optimizer.zero_grad()
        outputs = network(x)
        loss = loss_fn(outputs, y)
        losses = torch.nn.functional.cross_entropy(outputs, y, reduction="none")
        info = {
            "batch_size": x.shape[0],
            "individual_losses": losses,
            "loss": loss,
            "optimizer": optimizer,
        }
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()


def train_on(case: dict[str, Any], batches, **cockpit_kwargs) -> Cockpit:
    """Train a case in one process on the given ``(x, y)`` batches."""
    return train({**case, "batches": batches}, **cockpit_kwargs)


def train_accumulating(
    case: dict[str, Any], rank: int | None = None, world: int | None = None
) -> Cockpit:
    """Two micro-batches per optimizer step: the first tracked, the second not.

    With DDP the tracked micro-batch runs inside ``no_sync()`` (``.grad`` stays
    each process's own) and the cockpit is told so (``no_sync=True``); the second
    synchronises the accumulated gradients. One process (``rank=None``) gets the
    same flag, which it ignores.
    """
    import contextlib

    model = make_model(case["model"])
    network = model
    if rank is not None:
        network = torch.nn.parallel.DistributedDataParallel(model)
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    optimizer = make_optimizer(case["optimizer"], model.parameters())
    cockpit = Cockpit(
        model.parameters(), quantities=make_quantities(case), diagnose=False
    )
    batches = joined_batches(case["model"], case["sizes"])
    for step in range(len(batches) // 2):
        optimizer.zero_grad()
        for micro, (x, y) in enumerate(batches[2 * step : 2 * step + 2]):
            if rank is not None:
                counts = shard_counts(x.shape[0], world)
                start = sum(counts[:rank])
                x, y = x[start : start + counts[rank]], y[start : start + counts[rank]]
            tracked = micro == 0
            quiet = rank is not None and tracked
            with network.no_sync() if quiet else contextlib.nullcontext():
                outputs = network(x)
                loss = loss_fn(outputs, y)
                if not tracked:
                    loss.backward()
                    continue
                losses = torch.nn.functional.cross_entropy(outputs, y, reduction="none")
                info = {
                    "batch_size": x.shape[0],
                    "individual_losses": losses,
                    "loss": loss,
                    "optimizer": optimizer,
                }
                with cockpit(step, info=info, no_sync=True):
                    loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return cockpit


def ddp_accumulating_history(rank: int, world: int, case: dict[str, Any]):
    """Worker: :func:`train_accumulating` with DDP; return the history."""
    return {"history": train_accumulating(case, rank, world).history.to_dict()}


# --- processes -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, rendezvous, outdir, target, args, pg_timeout=120.0):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    import torch.distributed as dist

    result: dict[str, Any] = {"rank": rank}
    started = time.perf_counter()
    try:
        dist.init_process_group(  # a file to meet at: no port to race for
            "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=world,
            timeout=_timedelta(pg_timeout),
        )
        result.update(target(rank, world, **args) or {})
    except BaseException as error:  # reported to the test, which decides
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()
    result["seconds"] = time.perf_counter() - started
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _timedelta(seconds):
    import datetime

    return datetime.timedelta(seconds=seconds)


def _start_method():
    """A fork server that has imported this module (and with it torch, BackPACK and
    cockpit) once, and the part of torch that DDP imports when first built.

    Every rank is still a new process, forked from that clean server (it never ran
    a test or trained), so nothing but imported modules is shared between launches;
    a spawned process would import torch again (seconds on a small machine). Where
    there is no fork server, processes are spawned.
    """
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([__name__, "torch._dynamo"])  # read at its start
    return context


def launch(
    target, world: int, outdir, limit: float = 240.0, pg_timeout: float = 120.0, **args
) -> list[dict]:
    """Run ``target(rank, world, **args)`` on ``world`` processes; their results.

    ``target`` must be importable (a module-level function). Processes still alive
    after ``limit`` seconds are killed and reported as ``{"error": "hung"}``.
    ``pg_timeout`` is the process group's own timeout (its collectives, DDP's).
    """
    context = _start_method()
    port = free_port()  # only for code that reads MASTER_PORT (Lightning)
    rendezvous = os.path.join(  # outside outdir: tests list what ranks wrote there
        tempfile.gettempdir(), f"cockpit-ddp-rendezvous-{uuid.uuid4().hex}"
    )
    processes = [
        context.Process(
            target=_worker,
            args=(rank, world, port, rendezvous, str(outdir), target, args, pg_timeout),
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + limit
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = {rank for rank, process in enumerate(processes) if process.is_alive()}
    for rank in hung:
        processes[rank].kill()
        processes[rank].join()
    if os.path.exists(rendezvous):
        os.unlink(rendezvous)
    results = []
    for rank, process in enumerate(processes):
        if rank in hung:
            results.append({"rank": rank, "error": "hung"})
            continue
        path = os.path.join(str(outdir), f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append({"rank": rank, "error": f"exit code {process.exitcode}"})
    return results


def ddp_history(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Worker: train a case with DDP; return the history."""
    cockpit = train(case, rank, world, timeout=60)
    return {
        "history": cockpit.history.to_dict(),
        "data_parallel": cockpit.data_parallel,
        "methods": [row.route.method for row in cockpit.coverage().params],
    }


# --- misuse ------------------------------------------------------------------------
def _one_step(cockpit, network, optimizer, step, x, y, no_sync=False):
    optimizer.zero_grad()
    outputs = network(x)
    loss = torch.nn.functional.cross_entropy(outputs, y)
    losses = torch.nn.functional.cross_entropy(outputs, y, reduction="none")
    info = {
        "batch_size": x.shape[0],
        "individual_losses": losses,
        "loss": loss,
        "optimizer": optimizer,
    }
    with cockpit(step, info=info, no_sync=no_sync):
        loss.backward()
    optimizer.step()


def _wait_for(path: str, seconds: float) -> None:
    """Sleep until ``path`` exists, at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def misuse(
    rank: int,
    world: int,
    how: str,
    timeout: float = 30.0,
    wait_dir: str | None = None,
) -> dict[str, Any]:
    """Worker: a run where the processes disagree; what each process raised.

    With ``how="raise-and-wait"`` rank 1 stays alive and silent until rank 0 has
    written its result into ``wait_dir`` (at most ``timeout`` + 10 s).
    """
    model = make_model("mlp")
    if how == "shapes" and rank == 1:  # a wider hidden layer (DDP would refuse it)
        torch.manual_seed(0)
        model = extend(
            torch.nn.Sequential(
                torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
            ).to(DTYPE)
        )
    wrap = how not in ("no-ddp", "shapes")
    network = torch.nn.parallel.DistributedDataParallel(model) if wrap else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    every = linear(1)
    chosen = [quantities.GradNorm(every), quantities.NormTest(every)]
    if how == "quantities" and rank == 1:
        chosen.append(quantities.Variance(every))
    if how == "schedules" and rank == 1:
        chosen[1] = quantities.NormTest(linear(2))
    cockpit = Cockpit(
        model.parameters(), quantities=chosen, diagnose=False, timeout=timeout
    )
    x, y = joined_batches("mlp", [8])[0]
    if how == "no-ddp":  # each process its own data and model: not data-parallel
        x = x + rank
    x, y = x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]
    step = 1 if (how == "steps" and rank == 1) else 0
    if how.startswith("raise") and rank == 1:
        try:
            optimizer.zero_grad()
            outputs = network(x)
            loss = torch.nn.functional.cross_entropy(outputs, y)
            with cockpit(0, info={"batch_size": 4, "loss": loss}):
                loss.backward()
                raise ValueError("the user's code failed on rank 1")
        except ValueError as error:
            if how == "raise-and-wait":  # alive, but never joins the step
                _wait_for(os.path.join(str(wait_dir), "rank0.json"), timeout + 10)
            return {"raised": f"{type(error).__name__}: {error}"}
    if how == "inside-no-sync":  # DDP's no_sync(), but the cockpit is not told
        with network.no_sync():
            _one_step(cockpit, network, optimizer, step, x, y)
        return {"raised": None}
    no_sync = how == "no-sync-one-rank" and rank == 1
    _one_step(cockpit, network, optimizer, step, x, y, no_sync=no_sync)
    return {"raised": None}


def collectives_per_step(rank: int, world: int) -> dict[str, Any]:
    """Worker: how many ``torch.distributed`` collectives each step made.

    Quantities of one step each (two-step ones such as Alpha also work at the step
    after), tracked at even steps; DDP's own all-reduce runs inside its C++ reducer
    and is not counted, so the counts are cockpit's.
    """
    import torch.distributed as dist

    counts: list[int] = []
    names = [
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "broadcast",
        "reduce_scatter",
        "barrier",
    ]
    originals = {name: getattr(dist, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            counts[-1] += 1
            return originals[name](*args, **kwargs)

        return call

    model = make_model("mlp")
    network = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(
        model.parameters(),
        quantities=[
            quantities.GradNorm(linear(2)),
            quantities.NormTest(linear(2)),
            quantities.GradHist1d(linear(2)),
        ],
        diagnose=False,
        timeout=30,
    )
    batches = joined_batches("mlp", [8] * 5)
    try:
        for name in names:
            setattr(dist, name, counting(name))
        for step, (x, y) in enumerate(batches):
            x, y = x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]
            optimizer.zero_grad()
            outputs = network(x)
            loss = torch.nn.functional.cross_entropy(outputs, y)
            losses = torch.nn.functional.cross_entropy(outputs, y, reduction="none")
            info = {
                "batch_size": 4,
                "individual_losses": losses,
                "loss": loss,
                "optimizer": optimizer,
            }
            counts.append(0)
            with cockpit(step, info=info):
                loss.backward()
            optimizer.step()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {"counts": counts, "tracked": sorted(cockpit.history.to_dict())}


def local_and_logged(rank: int, world: int, logdir: str) -> dict[str, Any]:
    """Worker: a rank-local cockpit and a data-parallel one that streams a log."""
    case = {
        "model": "mlp",
        "optimizer": "sgd",
        "sizes": [8, 8],
        "configuration": "economy",
    }
    local = train(case, rank, world, process_group=None)
    logged = train(case, rank, world, logpath=os.path.join(logdir, "run"))
    written = logged.write(os.path.join(logdir, "written"))
    return {
        "local": local.history.to_dict(),
        "local_data_parallel": local.data_parallel,
        "logged": logged.history.to_dict(),
        "logpath": logged.logpath,
        "written": written,
    }


def logged_by(rank: int, world: int, logdir: str, log_rank: Any) -> dict[str, Any]:
    """Worker: a data-parallel cockpit that streams its log from ``log_rank``."""
    case = {
        "model": "mlp",
        "optimizer": "sgd",
        "sizes": [8, 8],
        "configuration": "economy",
    }
    logpath = os.path.join(logdir, "run")
    try:
        cockpit = train(case, rank, world, logpath=logpath, log_rank=log_rank)
    except (TypeError, ValueError) as error:
        return {"raised": f"{type(error).__name__}: {error}"}
    return {
        "logged": cockpit.history.to_dict(),
        "logpath": cockpit.logpath,
        "written": cockpit.write(os.path.join(logdir, "written")),
        "is_writer": cockpit.is_writer,
    }


def group_batches(group: int):
    """The joined batches of data-parallel group ``group`` (each its own data)."""
    return joined_batches("mlp", [8, 8, 8, 8])[group : group + 3]


def two_groups(rank: int, world: int) -> dict[str, Any]:
    """Worker, 4 processes: two data-parallel groups {0, 1} and {2, 3}, each with its
    own DDP and cockpit; first a cockpit on the other group, which must be refused."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine, other = groups[rank // 2], groups[1 - rank // 2]
    params = list(make_model("mlp").parameters())
    try:
        Cockpit(params, [quantities.GradNorm(linear(1))], process_group=other)
    except ValueError as error:
        refused = str(error)
    else:
        refused = None
    case = {
        "model": "mlp",
        "optimizer": "sgd",
        "configuration": "economy",
        "batches": group_batches(rank // 2),
    }
    group_rank = dist.get_rank(mine)
    cockpit = train(case, group_rank, 2, ddp_group=mine, process_group=mine)
    return {
        "refused": refused,
        "history": cockpit.history.to_dict(),
        "group_rank": cockpit.rank,
        "is_writer": cockpit.is_writer,
    }


# --- ranks that disagree in the middle of a run ------------------------------------
#: The step at which the ranks of :func:`disagree` part ways.
PARTING = 2


def disagree(
    rank: int,
    world: int,
    how: str,
    timeout: float,
    steps: int = 6,
    every: int = 1,
    odd: tuple[int, ...] = (1,),
    wait_dir: str | None = None,
) -> dict[str, Any]:
    """Worker: a DDP run whose ranks ``odd`` part ways with the others at step 2.

    Every step is wrapped in ``with cockpit(step, ...)`` (tracked every ``every``
    steps) except where ``how`` says otherwise for the odd ranks:

    * ``untracked``: their schedule skips step 2, which the others track (a
      schedule that reads local state, agreed at the set-up check);
    * ``plain``: they run step 2's ``loss.backward()`` outside cockpit;
    * ``ahead``: from step 2 on they pass ``step + 1`` (a counter bug);
    * ``caught``: they raise inside step 2 after the backward pass, catch the
      error and go on training;
    * ``left``: they raise inside step 2 and leave the loop (the process lives on,
      silent, until the others wrote their results into ``wait_dir``, at most
      ``timeout`` + 20 s);
    * ``died``: they exit at once inside step 2 (``os._exit``);
    * ``stuck``: they stay inside step 2 after the backward pass until rank 0 wrote
      its result into ``wait_dir``, then go on.

    Returns what the rank raised, the seconds from the start of step 2 until then,
    and the steps it finished.
    """
    me = rank in odd
    model = make_model("mlp")
    network = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    skipped: set[int] = set()  # filled after the set-up check, from local state

    def schedule(step: int) -> bool:
        return step % every == 0 and step not in skipped

    chosen = [quantities.GradNorm(schedule), quantities.NormTest(schedule)]
    cockpit = Cockpit(
        model.parameters(), quantities=chosen, diagnose=False, timeout=timeout
    )
    batches = joined_batches("mlp", [2 * world] * steps)
    finished: list[int] = []
    parted = None
    try:
        for step, (x, y) in enumerate(batches):
            if step == PARTING:
                parted = time.monotonic()
            _disagreeing_step(
                cockpit, network, optimizer, step, x[2 * rank : 2 * rank + 2],
                y[2 * rank : 2 * rank + 2], how if me else "", rank, wait_dir,
                timeout,
            )  # fmt: skip
            if how == "untracked" and me:
                skipped.add(PARTING)  # (after the set-up check at step 0)
            finished.append(step)
    except Exception as error:
        if how == "left" and me:  # alive and silent until the others are done
            others = [r for r in range(world) if r not in odd]
            _linger(wait_dir, others, timeout + 20)
        return {
            "raised": f"{type(error).__name__}: {error}",
            "since_parting": None if parted is None else time.monotonic() - parted,
            "finished": finished,
            "traceback": traceback.format_exc(),
        }
    return {"raised": None, "finished": finished}


def _disagreeing_step(
    cockpit, network, optimizer, step, x, y, how, rank, wait_dir=None, timeout=0.0
) -> None:
    """One step of :func:`disagree` (``how``: this rank's way to part, or "")."""
    optimizer.zero_grad()
    outputs = network(x)
    loss = torch.nn.functional.cross_entropy(outputs, y)
    losses = torch.nn.functional.cross_entropy(outputs, y, reduction="none")
    info = {"batch_size": 2, "individual_losses": losses, "loss": loss}
    parting = step == PARTING
    if parting and how == "plain":
        loss.backward()
        optimizer.step()
        return
    given = step + 1 if (how == "ahead" and step >= PARTING) else step
    try:
        with cockpit(given, info=info):
            loss.backward()
            if parting and how == "died":
                os._exit(3)
            if parting and how == "stuck":  # busy inside the step, then goes on
                _linger(wait_dir, [0], timeout + 20)
            if parting and how in ("caught", "left"):
                raise ValueError(f"the user's code failed on rank {rank}")
    except ValueError:
        if how != "caught":
            raise
    optimizer.step()


def _linger(wait_dir, ranks, seconds: float) -> None:
    """Stay alive and silent until ``ranks`` wrote their results (a rank that left)."""
    for other in ranks:
        _wait_for(os.path.join(str(wait_dir), f"rank{other}.json"), seconds)
