"""FSDP2 test runs: real ``torch.distributed`` processes with ``fully_shard`` models.

Each rank wraps the model with ``torch.distributed.fsdp.fully_shard`` (per unit and
on the root, or on the root only; ``reshard_after_forward`` as the case says) and
trains on its shard of the joined batches; :func:`train` without a rank trains the
plain model in one process on the joined batches (the reference). The processes
come from :func:`tests.utils.ddp.launch`; one launch runs several cases.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from typing import Any

import torch
from backpack import extend

from cockpit import Cockpit, quantities
from cockpit.cockpit_args import SHARDED_ENGINES
from cockpit.engines import base as engine_base
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.utils import ddp, hf_models

DTYPE = torch.float64


class Block(torch.nn.Module):
    """A pre-norm transformer block: causal attention of Linear projections, an MLP."""

    def __init__(self, width: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        n, t, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (z.view(n, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(n, t, width))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class Transformer(torch.nn.Module):
    """Token embedding, two :class:`Block` s, a mean-pooled classifier head."""

    def __init__(self, width: int = 8, classes: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(hf_models.VOCAB, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(2))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


def make(kind: str):
    """``(model, units, batch(step, n) -> (kwargs, targets), logits)`` of a kind.

    ``units`` are the modules wrapped one by one before the root (per-unit
    wrapping).
    """
    torch.manual_seed(0)
    if kind == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
        ).to(DTYPE)

        def batch(step, n):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(n, 5, generator=g, dtype=DTYPE)
            return {"input": x}, torch.randint(0, 3, (n,), generator=g)

        return model, [model[0], model[2]], batch, lambda out: out
    if kind == "transformer":
        model = Transformer().to(DTYPE)
        return (
            model,
            list(model.blocks),
            lambda step, n: hf_models._tokens(n, step, classes=3),
            lambda out: out,
        )
    if kind == "bert":
        case = hf_models.build("bert")
        model = case.model
        return (
            model,
            list(model.bert.encoder.layer),
            lambda step, n: case.inputs(n, step),
            case.logits,
        )
    raise ValueError(kind)


class Needy(torch.optim.SGD):
    """SGD whose constructor wants an argument its ``defaults`` do not hold."""

    def __init__(self, params, token: str, lr: float = 0.1):
        super().__init__(params, lr=lr)
        self.token = token


class OwnSGD(torch.optim.SGD):
    """A subclass of SGD: its update is replayed on the full tensors, not on rows."""


#: What every case tracks beyond its configuration (``case["extras"]``).
EXTRAS = ("Variance", "MeanGSNR")


def make_quantities(
    label: str,
    curvature: str | None = None,
    power: bool = False,
    extras=(quantities.Variance, quantities.MeanGSNR),
    every=None,
):
    """A configuration's quantities, tracked every step (or on the schedule
    ``every``), plus ``extras`` (Variance and MeanGSNR).

    ``curvature``: HessTrace's (e.g. ``"hutchinson"``, the Hessian's estimate);
    ``power``: HessMaxEV by power iteration (else Lanczos).
    """
    every = linear(1) if every is None else every
    chosen = configuration(label, every) if label is not None else []
    if curvature is not None:
        chosen = [q for q in chosen if q.key != "HessTrace"]
        chosen.append(quantities.HessTrace(every, curvature=curvature))
    if power and any(q.key == "HessMaxEV" for q in chosen):
        chosen = [q for q in chosen if q.key != "HessMaxEV"]
        chosen.append(quantities.HessMaxEV(every, use_power=True))
    keys = {q.key for q in chosen}
    for extra in extras:
        if extra.__name__ not in keys:
            chosen.append(extra(every))
    return chosen


@contextlib.contextmanager
def sharded_engines():
    """Cockpits made inside use only the engines that serve FSDP2 models.

    The reference process computes with the same engines as the sharded run, so
    that a comparison tests the joining of the shards (the engines are checked
    against brute force elsewhere: a per-sample gradient element that is 0 in one
    engine can be 1e-18 in another and move a histogram count across the edge at
    zero).
    """
    saved = list(engine_base._REGISTRY)
    engine_base._REGISTRY[:] = [e for e in saved if e[1].__name__ in SHARDED_ENGINES]
    try:
        yield
    finally:
        engine_base._REGISTRY[:] = saved


def train(
    case: dict[str, Any], rank: int | None = None, world: int = 2, counter=None
) -> Cockpit:
    """Train a case: one FSDP2 rank of ``world``, or (``rank=None``) one process on
    the joined batches of ``world`` processes. A ``counter`` (a torch function mode,
    e.g. :class:`tests.utils.syncs.FactoryCounter`) is active during the last step's
    ``with cockpit(...)`` block.

    ``case["sizes"]``: each process's samples (default ``case["batch"]`` each);
    ``case["frozen"]``: a submodule's name whose parameters do not train;
    ``case["mixed"]``: FSDP2's mixed precision (bfloat16 compute);
    ``case["switch"]``: from step 1 on, the optimizer is an :class:`OwnSGD`;
    ``case["apart"]`` (``[step, rank]``): that rank tracks that step with
    ``no_sync=True``, a plan the others do not have;
    ``case["configuration"]``: ``None`` for the ``extras`` alone;
    ``case["skip"]`` (``[step, rank, slow]``): that rank's schedule skips that
    step (local state, after the set-up check), which the others track; rank
    ``slow`` enters the step 1 s after the others;
    ``case["spare"]``: the model has a Linear layer its forward pass never uses
    (its parameters are shown zero results after the backward pass);
    ``case["late"]``: on rank 0, the elementwise sums of parameter 0 reach
    :class:`~cockpit.distributed.unit_sums.UnitSums` only after the backward pass
    (after their unit was sent), :func:`_late_sums`.
    ``case["resume"]`` (``{"path": folder, "source": "own" or a rank}``): after
    step 0 every process saves its cockpit's state there, and a new Cockpit goes on
    from the state of this process (``"own"``) or of the rank given."""
    from torch.distributed.fsdp import fully_shard

    model, units, batch, logits_of = make(case["model"])
    if case.get("spare"):  # (in the root's unit)
        model.spare = torch.nn.Linear(2, 3).to(DTYPE)
    if case.get("frozen"):  # a module left out of training (and of the cockpit)
        model.get_submodule(case["frozen"]).requires_grad_(False)
    if rank is not None:
        model = extend(model)  # as the user's loop does (cockpit takes it off)
        options = {"reshard_after_forward": case.get("reshard", True)}
        if case.get("mixed"):  # bfloat16 compute, float32 gradient reduction
            from torch.distributed.fsdp import MixedPrecisionPolicy

            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        if case.get("wrap", "units") == "units":
            for unit in units:
                fully_shard(unit, **options)
        fully_shard(model, **options)
    if case.get("optimizer") == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    elif case.get("optimizer") == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    elif case.get("optimizer") == "needy":
        optimizer = Needy(model.parameters(), "a token")
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    skipped: set[int] = set()  # (filled after the set-up check at step 0)
    skip_step, skip_rank, slow = case.get("skip", (None, None, None))

    def schedule(step: int) -> bool:
        return step not in skipped

    def new_cockpit():
        with contextlib.nullcontext() if rank is not None else sharded_engines():
            return Cockpit(
                model.named_parameters(),
                quantities=make_quantities(
                    case.get("configuration", "economy"),
                    case.get("curvature"),
                    case.get("solver") == "power",
                    [getattr(quantities, name) for name in case.get("extras", EXTRAS)],
                    every=schedule,
                ),
                diagnose=False,
                timeout=60,
            )

    cockpit = new_cockpit()
    if case.get("late") and rank == 0:
        _late_sums()
    n = case.get("batch", 4)  # samples per process; one process: all of them
    sizes = case.get("sizes", [n] * world)  # (shards of different sizes)
    steps = case.get("steps", 2)
    for step in range(steps):
        kwargs, y = batch(step, sum(sizes))
        if rank is not None:
            start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
            kwargs = {k: v[start:stop] for k, v in kwargs.items()}
            y = y[start:stop]
        optimizer.zero_grad()
        out = logits_of(model(**kwargs))
        loss = torch.nn.functional.cross_entropy(out, y)
        losses = torch.nn.functional.cross_entropy(out, y, reduction="none")
        info = {"batch_size": y.shape[0], "loss": loss, "individual_losses": losses,
                "optimizer": optimizer}  # fmt: skip
        counted = counter is not None and step == steps - 1
        with counter if counted else contextlib.nullcontext():
            apart = case.get("apart") == [step, rank]  # (a plan of its own)
            if step == skip_step and rank == slow:
                time.sleep(1.0)
            with cockpit(step, info=info, no_sync=apart):
                loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
        if step == 0 and rank == skip_rank:
            skipped.add(skip_step)
        if step == 0 and case.get("switch"):
            optimizer = OwnSGD(model.parameters(), lr=0.1)
        if step == 0 and case.get("resume"):
            cockpit = _resumed(cockpit, new_cockpit, rank, case["resume"])
    return cockpit


def _late_sums() -> None:
    """Hold back parameter 0's sums from :meth:`UnitSums.put` until
    :meth:`UnitSums.finish` (after the backward pass): as a hook that ran after
    FSDP's post-backward of the unit would give them (for this process only)."""
    from cockpit.distributed.unit_sums import UnitSums

    put, finish = UnitSums.put, UnitSums.finish

    def held(self, channel, index, tensor):
        if index == 0:
            self.__dict__.setdefault("held", []).append((channel, index, tensor))
            return
        put(self, channel, index, tensor)

    def released(self):
        for args in self.__dict__.pop("held", []):
            put(self, *args)
        finish(self)

    UnitSums.put, UnitSums.finish = held, released


def _resumed(cockpit, new_cockpit, rank, resume) -> Cockpit:
    """Save every process's state; a new Cockpit loads the one ``resume`` names."""
    import os

    import torch.distributed as dist

    def path(who):
        return os.path.join(resume["path"], f"state-{who}.pt")

    torch.save(cockpit.state_dict(), path("one" if rank is None else rank))
    if rank is not None:
        dist.barrier()
    source = rank if resume.get("source", "own") == "own" else resume["source"]
    cockpit.close()
    fresh = new_cockpit()
    fresh.load_state_dict(torch.load(path("one" if rank is None else source),
                                     weights_only=False))  # fmt: skip
    return fresh


def histories(rank: int, world: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Worker: train every case with FSDP2; each case's history (or its error)."""
    out = []
    for case in cases:
        try:
            cockpit = train(case, rank, world)
            out.append({"history": cockpit.history.to_dict()})
        except Exception as error:  # reported per case
            out.append({"error": f"{type(error).__name__}: {error}",
                        "traceback": traceback.format_exc()})  # fmt: skip
    return {"cases": out}


def collectives(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Worker: train a case, watching cockpit's collectives; the history, each
    all-reduce's ``(what, numbers)``, each reduce-scatter's ``(numbers sent,
    numbers received, step, what, whether inside a backward pass)``, the joins of the
    full parameters (:meth:`Sharding.gather`), at each unit's sending of its
    elementwise sums the parameters sent, those whose sums were held and their
    numbers (``"held"``), the parameters' sizes and the number of FSDP units
    holding them. ``case["scatter_elements"]`` replaces
    :data:`cockpit.distributed.step.SCATTER_ELEMENTS`."""
    from cockpit.distributed import process_group
    from cockpit.distributed import step as distributed_step
    from cockpit.distributed.sharded import Sharding

    if "scatter_elements" in case:
        distributed_step.SCATTER_ELEMENTS = case["scatter_elements"]

    from cockpit.distributed.unit_sums import UnitSums

    seen: dict[str, list] = {"reduced": [], "joined": [], "scattered": [],
                             "held": []}  # fmt: skip
    reduce, gather = process_group.Communicator.all_reduce, Sharding.gather
    scatter, send = process_group.Communicator.reduce_scatter, UnitSums.send

    def sending(self, indices):  # the sums held when a unit is sent
        todo = sorted(set(indices) - self._sent)
        held = sorted({index for _, index in self._pending})
        seen["held"].append(
            (todo, held, sum(t.numel() for t in self._pending.values()))
        )
        send(self, indices)

    nested = []  # (gloo's reduce-scatter is an all-reduce: not counted twice)

    def scattered(self, tensor, what, step):
        nested.append(True)
        try:
            out = scatter(self, tensor, what, step)
        finally:
            nested.pop()
        inside = torch._C._current_autograd_node() is not None  # a backward pass
        seen["scattered"].append(
            (int(tensor.numel()), int(out.numel()), step, what, inside)
        )
        return out

    def watched(self, tensor, what, step, op="sum"):
        if not nested:
            seen["reduced"].append((what, int(tensor.numel())))
        return reduce(self, tensor, what, step, op)

    def joined(self, communicator, tensors, what, step):
        seen["joined"].append(what)
        return gather(self, communicator, tensors, what, step)

    process_group.Communicator.all_reduce = watched
    process_group.Communicator.reduce_scatter = scattered
    Sharding.gather, UnitSums.send = joined, sending
    try:
        cockpit = train(case, rank, world)
    finally:
        process_group.Communicator.all_reduce, Sharding.gather = reduce, gather
        process_group.Communicator.reduce_scatter, UnitSums.send = scatter, send
    sizes = [p.numel() for p in cockpit.params]
    units = sum(bool(g.fsdp_params) for s in cockpit._communicator.sharding._states()
                for g in s._fsdp_param_groups)  # fmt: skip
    return {"history": cockpit.history.to_dict(), "sizes": sizes, "units": units,
            **seen}  # fmt: skip


def host_traffic(rank: int, world: int, case: dict[str, Any]) -> dict:
    """Worker: train a case; what cockpit's code did on the host during the last
    tracked step, by place: ``"created"``, the tensors it made on the default device
    (factory calls without a device), and ``"synced"``, its copies to the host
    (:mod:`tests.utils.syncs`)."""
    from tests.utils.syncs import FactoryCounter, SyncCounter

    created, synced = FactoryCounter(), SyncCounter()

    @contextlib.contextmanager
    def both():
        with created, synced:
            yield

    train(case, rank, world, counter=both())

    def named(counter):
        return {f"{name} at {where}": n for (name, where), n in counter.places.items()}

    return {"created": named(created), "synced": named(synced)}


def refused(rank: int, world: int, layout: str) -> dict[str, Any]:
    """Worker: make a Cockpit over a layout cockpit cannot serve; what it raised.

    * ``tensor-parallel``: ``distribute_tensor`` rows (a DTensor FSDP does not
      manage);
    * ``shard-dim-1``: ``fully_shard`` with ``shard_placement_fn`` -> ``Shard(1)``;
    * ``hsdp``: ``fully_shard`` on a ``(1, world)`` mesh (HSDP's 2-D layout);
    * ``mixed``: one layer sharded, the other plain;
    * ``no-group``: ``process_group=None`` over sharded parameters.

    Then one training step without the Cockpit (FSDP itself works there).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    model, units, batch, logits_of = make("mlp")
    mesh = init_device_mesh("cpu", (world,))
    if layout == "tensor-parallel":
        for unit in units:
            unit.weight = torch.nn.Parameter(
                distribute_tensor(unit.weight.data, mesh, [Shard(0)])
            )
            unit.bias = torch.nn.Parameter(
                distribute_tensor(unit.bias.data, mesh, [Shard(0)])
            )
    elif layout == "shard-dim-1":

        def columns(param):  # dimension 1 where it splits evenly (FSDP's rule)
            even = param.dim() == 2 and param.shape[1] % world == 0
            return Shard(1) if even else Shard(0)

        fully_shard(model, shard_placement_fn=columns)
    elif layout == "hsdp":
        hybrid = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "shard"))
        fully_shard(model, mesh=hybrid)
    elif layout == "mixed":
        fully_shard(units[0])
    else:
        fully_shard(model)
    kwargs = {"process_group": None} if layout == "no-group" else {}
    try:
        Cockpit(model.named_parameters(), make_quantities("economy"), **kwargs)
    except ValueError as error:
        return {"raised": f"{type(error).__name__}: {error}"}
    return {"raised": None}


def refusals(rank: int, world: int, layouts: list[str]) -> dict[str, Any]:
    """Worker: :func:`refused` for each layout, in one process."""
    return {"raised": [refused(rank, world, layout)["raised"] for layout in layouts]}


launch = ddp.launch


def warm_start(rank: int, world: int, case: dict[str, Any]) -> dict:
    """Worker: train a case; HessMaxEV's warm-start vector as this rank holds it.

    ``"piece"``: the vector this rank keeps (its rows of every parameter, in
    order); ``"ranges"``: where they sit in the whole flat vector; ``"dim"``: its
    size.
    """
    from cockpit.distributed.sharded import Pieces

    cockpit = train(case, rank, world)
    (solver,) = [q for q in cockpit.quantities if q.key == "HessMaxEV"]
    pieces = Pieces(cockpit._communicator.sharding, cockpit._communicator, 0)
    return {
        "piece": solver._previous.tolist(),
        "ranges": pieces.ranges,
        "dim": pieces.dim,
    }


def joined_exactly(rank: int, world: int) -> dict:
    """Worker: one tracked step of a float32 and of a bfloat16 ``fully_shard`` MLP.

    Per dtype: whether the step's joined parameters and gradient
    (:meth:`Sharding.gather`) are ``DTensor.full_tensor()``'s bit for bit, in the
    parameter's dtype, and the dtype they travelled in (the communicator's
    all-reduce of them, watched).
    """
    from torch.distributed.fsdp import fully_shard

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, units, batch, logits_of = make("mlp")
        model = model.to(dtype)
        for unit in units:
            fully_shard(unit)
        fully_shard(model)
        # Parameters reads the full tensors (not shard-local): the shards are joined
        cockpit = Cockpit(model.named_parameters(), [quantities.Parameters(linear(1))])
        comm = cockpit._communicator
        seen = {"sent": [], "joined": []}
        reduce, gather = comm.all_reduce, comm.sharding.gather

        def watched(tensor, what, step, op="sum", reduce=reduce, seen=seen):
            if what in ("the parameters' shards", "the gradient's shards"):
                seen["sent"].append(str(tensor.dtype))
            return reduce(tensor, what, step, op)

        def kept(*args, gather=gather, seen=seen):
            joined = gather(*args)
            seen["joined"] += [t.clone() for t in joined]  # parameters, gradient
            return joined

        comm.all_reduce, comm.sharding.gather = watched, kept
        kwargs, y = batch(0, 4)
        out_ = model(kwargs["input"].to(dtype))
        loss = torch.nn.functional.cross_entropy(out_, y)
        losses = torch.nn.functional.cross_entropy(out_, y, reduction="none")
        info = {"batch_size": 4, "loss": loss, "individual_losses": losses}
        with cockpit(0, info=info):
            loss.backward()
        params = list(model.parameters())
        want = [p.full_tensor() for p in params]
        want += [p.grad.full_tensor() for p in params]
        out[str(dtype)] = {
            "equal": [
                bool(torch.equal(a, b)) and a.dtype == b.dtype
                for a, b in zip(seen["joined"], want, strict=True)
            ],  # fmt: skip
            "sent": seen["sent"],
        }
    return out
