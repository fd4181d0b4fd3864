"""CockpitCallback under Lightning's DDP strategy: the log of the joined batch.

Real ``Trainer.fit`` runs on two gloo processes (CPU, float64):

* ``strategy="ddp_spawn"``: Lightning spawns the processes. Rank 0's log must equal
  the plain cockpit loop of one process on the joined batches (built from what
  each rank's ``DistributedSampler`` handed it), every rank must hold the same
  values, and only rank 0 writes (the log, TensorBoard).
* ``strategy="ddp"`` in processes started as ``torchrun`` starts them
  (``LOCAL_RANK`` set, Lightning launches nothing): gradient accumulation, where
  the tracked micro-batch runs inside DDP's ``no_sync()`` (values recomputed by
  brute force on the joined micro-batch), and gradient clipping.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cockpit import Cockpit
from cockpit.errors import CockpitWarning
from cockpit.history import History
from cockpit.quantities import Alpha, GradNorm, Variance
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from tests.utils import ddp

try:
    import lightning.pytorch as pl
except (ImportError, RuntimeError) as error:  # RuntimeError: a broken torchvision
    pytest.skip(f"lightning cannot be imported: {error}", allow_module_level=True)
from cockpit.integrations.lightning import CockpitCallback  # noqa: E402
from tests.integrations.test_integrations_lightning import (  # noqa: E402
    Classifier,
    Recording,
    _accumulation_quantities,
    _brute_force,
    _exact,
    _net,
    _net64,
    _norms_between,
)
from tests.utils import expected_warnings as expected

pytestmark = pytest.mark.skipif(
    not dist.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)
pytestmark = [pytestmark, expected.TIC_HESSIAN_NOT_POSITIVE, expected.LIGHTNING_NO_VAL]

WORLD = 2
PER_RANK, STEPS = 4, 4  # samples per process and step; optimizer steps (one epoch)
VALID = 8  # validation samples per process (one batch)


def _data(n: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=generator)
    return x, y


def _loader(x, y, batch_size: int):
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)


def _optimizer(params):
    opt = torch.optim.SGD(params, lr=0.5, momentum=0.5)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _quantities():
    return configuration("full") + [Variance(linear(1))]


class Shard(pl.LightningModule):
    """Keeps the batches this process saw; validates with and without sync."""

    def __init__(self):
        super().__init__()
        self.net = _net64()
        self.loss_fn = nn.CrossEntropyLoss()
        self.seen = []  # (global_step, x, y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((self.trainer.global_step, x.clone(), y.clone()))
        return self.loss_fn(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True)  # the whole validation set
        self.log("val_local", loss)  # this process's shard only

    def configure_optimizers(self):
        opt, scheduler = _optimizer(self.parameters())
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class Dump(pl.Callback):
    """Each process saves what its cockpit holds, after the cockpit's callback."""

    def __init__(self, cockpit_callback: CockpitCallback, outdir: str):
        self.cockpit_callback, self.outdir = cockpit_callback, outdir

    def on_train_end(self, trainer, pl_module):
        from cockpit import CockpitPlotter

        cockpit = self.cockpit_callback.cockpit
        plots = os.path.join(self.outdir, "plots")  # the live dashboard, as users do
        plotted = CockpitPlotter().plot(cockpit, save_plot=True, savedir=plots)
        payload = {
            "plotted": plotted,
            "history": cockpit.history.to_dict(),
            "data_parallel": cockpit.data_parallel,
            "is_writer": cockpit.is_writer,
            "logpath": cockpit.logpath,
            "log_dir": trainer.log_dir,
            "seen": pl_module.seen,
        }
        torch.save(payload, os.path.join(self.outdir, f"rank{trainer.global_rank}.pt"))


def _same(want, got, where: str, problems: list[str], rel: float = 1e-6) -> None:
    """Where ``got`` differs from ``want``: floats to ``rel`` (0: bit for bit),
    everything else (histogram counts, flags, reasons) exactly."""
    if isinstance(want, dict):
        if set(want) != set(got):
            problems.append(f"{where}: keys {sorted(set(want) ^ set(got))}")
            return
        for key in want:
            if key != "Time":
                _same(want[key], got[key], f"{where}/{key}", problems, rel)
    elif isinstance(want, list):
        if len(want) != len(got):
            problems.append(f"{where}: length {len(want)} != {len(got)}")
            return
        for i, (a, b) in enumerate(zip(want, got)):
            _same(a, b, f"{where}[{i}]", problems, rel)
    elif isinstance(want, float) and isinstance(got, float):
        if rel == 0.0:  # bit for bit (NaN where NaN)
            same = want == got or (math.isnan(want) and math.isnan(got))
        else:
            same = math.isclose(want, got, rel_tol=rel, abs_tol=1e-12)
        if not same:
            problems.append(f"{where}: {want!r} != {got!r}")
    elif type(want) is not type(got) or want != got:  # counts, flags, text
        problems.append(f"{where}: {want!r} != {got!r}")


def _as_json(history: dict) -> dict:
    return json.loads(json.dumps(history))


def _leaves(value) -> int:
    if isinstance(value, dict):
        return sum(_leaves(v) for v in value.values())
    if isinstance(value, list):
        return sum(_leaves(v) for v in value)
    return 1


def _plain_loop(batches, valid):
    """One process, the README's loop, on the joined batches; then validation."""
    from backpack import extend

    net = extend(_net64())
    loss_fn = extend(nn.CrossEntropyLoss())
    opt, scheduler = _optimizer(net.parameters())
    cockpit = Cockpit(net.parameters(), quantities=_quantities())
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        outputs = net(x)
        loss = loss_fn(outputs, y)
        losses = nn.functional.cross_entropy(outputs, y, reduction="none")
        info = {"batch_size": x.shape[0], "individual_losses": losses,
                "loss": loss, "optimizer": opt}  # fmt: skip
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        lr = opt.param_groups[0]["lr"]
        cockpit.log(step, 0, None, None, None, None, None, None, lr)
        opt.step()
        scheduler.step()
    (x, y), (x0, y0) = valid  # all validation samples; rank 0's shard
    with torch.no_grad():
        whole, local = float(loss_fn(net(x), y)), float(loss_fn(net(x0), y0))
    cockpit.log(step, 0, None, whole, local, None, None, None, lr)
    return cockpit, net


def test_ddp_spawn_logs_what_one_process_logs_on_the_joined_batch(tmp_path):
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    try:
        import tensorboard  # noqa: F401

        logger = TensorBoardLogger(str(tmp_path), name="runs")
    except ImportError:
        logger = CSVLogger(str(tmp_path), name="runs")
    x, y = _data(WORLD * PER_RANK * STEPS, seed=3)
    vx, vy = _data(WORLD * VALID, seed=4)
    callback = CockpitCallback(
        quantities=_quantities(),
        metrics={"valid_loss": "val_loss", "test_loss": "val_local"},
    )
    model = Shard()
    trainer = pl.Trainer(
        strategy="ddp_spawn", accelerator="cpu", devices=WORLD, max_epochs=1,
        logger=logger, log_every_n_steps=1,
        callbacks=[callback, Dump(callback, str(tmp_path))],
        default_root_dir=str(tmp_path), num_sanity_val_steps=0,
        enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, _loader(x, y, PER_RANK), _loader(vx, vy, VALID))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    first, second = ranks
    assert first["data_parallel"] and second["data_parallel"]
    assert first["is_writer"] and not second["is_writer"]

    # what each process saw: Lightning shuffles training data with a
    # DistributedSampler (seed 0), rank r taking every second sample of the
    # permutation from r on; the joined batch is rank 0's shard, then rank 1's
    # (cockpit's rank order)
    data = torch.utils.data.TensorDataset(x, y)
    batches = []
    for rank, result in enumerate(ranks):
        sampler = torch.utils.data.DistributedSampler(
            data, num_replicas=WORLD, rank=rank, shuffle=True, seed=0
        )
        assert [step for step, *_ in result["seen"]] == list(range(STEPS))
        order = torch.cat([sx for _, sx, _ in result["seen"]])
        assert torch.equal(order, x[list(sampler)])
    for step in range(STEPS):
        shards = [result["seen"][step][1:] for result in ranks]
        batches.append(tuple(torch.cat(parts) for parts in zip(*shards)))
    joined = torch.cat([bx for bx, _ in batches])
    assert sorted(joined.tolist()) == sorted(x.tolist())  # each sample once
    assert [len(r["seen"]) for r in ranks] == [STEPS, STEPS]
    reference, net = _plain_loop(batches, ((vx, vy), (vx[0::WORLD], vy[0::WORLD])))
    want = _as_json(reference.history.to_dict())

    # rank 0 wrote the log into the trainer's log dir; it equals the reference
    log_dir = first["log_dir"]
    assert log_dir == str(tmp_path / "runs" / "version_0") == second["log_dir"]
    assert first["logpath"] == os.path.join(log_dir, "cockpit.jsonl")
    assert second["logpath"] is None
    logged = _as_json(History.from_json(first["logpath"]).to_dict())
    assert list(logged) == [str(s) for s in range(STEPS)]
    keys = {"Loss", "GradNorm", "Variance", "Alpha", "HessMaxEV", "HessTrace"}
    keys |= {"GradHist1d", "GradHist2d", "InnerTest", "NormTest", "learning_rate"}
    assert keys <= set(logged["0"]) and "Alpha" in logged["2"]
    assert logged["3"]["valid_loss"] == pytest.approx(want["3"]["valid_loss"], 1e-6)
    problems: list[str] = []
    _same(want, logged, "log", problems)
    assert not problems, "\n".join(problems[:20])
    assert _leaves(want) > 200  # many values compared

    # every process holds the same values, bit for bit (the metrics too: rank 0's,
    # broadcast; rank 1's own val_local differs)
    for result in ranks:
        problems = []
        _same(logged, _as_json(result["history"]), "rank", problems, rel=0.0)
        assert not problems, "\n".join(problems[:20])

    # only rank 0 wrote files: the log, the dashboard, TensorBoard (the logger's)
    assert first["plotted"] and second["plotted"] == []
    assert sorted(os.listdir(tmp_path / "plots")) == sorted(
        os.path.basename(path) for path in first["plotted"]
    )
    files = sorted(
        os.path.relpath(os.path.join(d, f), tmp_path)
        for d, _, names in os.walk(tmp_path)
        for f in names
    )
    cockpit_logs = [f for f in files if f.endswith("cockpit.jsonl")]
    assert cockpit_logs == [os.path.join("runs", "version_0", "cockpit.jsonl")]
    if isinstance(logger, TensorBoardLogger):
        from tensorboard.backend.event_processing import event_accumulator

        events = [f for f in files if "tfevents" in f]
        assert len(events) == 1, files
        accumulator = event_accumulator.EventAccumulator(log_dir)
        accumulator.Reload()
        assert "cockpit/GradNorm/net.0.weight" in accumulator.Tags()["scalars"]

    # Lightning brings rank 0's weights back: the training was the reference's
    for (name, a), b in zip(model.named_parameters(), net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


# --- strategy="ddp" as under torchrun: accumulation and clipping ----------------------
MICRO, MICRO_BATCHES = 4, 5  # per process: 5 micro-batches of 4 samples an epoch


class Syncing(Recording):
    """Records whether DDP synchronises each backward pass (no_sync or not)."""

    def __init__(self):
        super().__init__()
        self.synchronised = []  # (global_step, batch_idx, require_backward_grad_sync)

    def training_step(self, batch, batch_idx):
        self._batch_idx = batch_idx
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss):
        sync = self.trainer.strategy.model.require_backward_grad_sync
        self.synchronised.append((self.trainer.global_step, self._batch_idx, sync))


def _micro_loader():
    return _loader(*_data(WORLD * MICRO * MICRO_BATCHES, seed=5), MICRO)


def _fit(root: str, callbacks, module=Syncing, strategy="ddp", **kwargs):
    model = module()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_epochs=-1,
        logger=False, callbacks=callbacks, default_root_dir=root,
        enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, **kwargs,
    )  # fmt: skip
    trainer.fit(model, _micro_loader())
    return model


def _listed(tensors: dict) -> dict:
    return {name: t.tolist() for name, t in tensors.items()}


def _cockpit_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CockpitWarning)]


def torchrun_fits(rank: int, world: int, root: str) -> dict:
    """Worker: the runs with ``strategy="ddp"`` on a process torchrun-style."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    result = {}
    # accumulation, k = 2: windows [0, 1], [2, 3] in no_sync then synchronised,
    # and [4] (the epoch's last micro-batch, a window of one, synchronised)
    callback = CockpitCallback(quantities=_accumulation_quantities())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _fit(
            os.path.join(root, "accumulation"),
            [callback],
            max_steps=3,
            accumulate_grad_batches=2,
        )
    plain = _fit(
        os.path.join(root, "plain"), [], max_steps=3, accumulate_grad_batches=2
    )
    seen = [(s, i, _listed(p), x.tolist(), y.tolist()) for s, i, p, x, y in model.seen]
    result["accumulation"] = {
        "history": callback.cockpit.history.to_dict(),
        "logpath": callback.cockpit.logpath,
        "seen": seen,
        "synchronised": model.synchronised,
        "final": _listed(dict(model.named_parameters())),
        "final_without_callback": _listed(dict(plain.named_parameters())),
        "warnings": _cockpit_warnings(caught),
    }
    # clipping: the callback notices it on every process, rank 0 warns
    every = linear(1)
    callback = CockpitCallback(quantities=[Alpha(every), GradNorm(every)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(
            os.path.join(root, "clipping"),
            [callback],
            max_steps=3,
            gradient_clip_val=1e-3,
        )
    result["clipping"] = {
        "history": callback.cockpit.history.to_dict(),
        "warnings": _cockpit_warnings(caught),
    }
    return result


def _tensors(listed: dict) -> dict:
    return {n: torch.tensor(v, dtype=torch.float64) for n, v in listed.items()}


def test_ddp_accumulation_and_clipping_as_under_torchrun(tmp_path):
    results = ddp.launch(torchrun_fits, WORLD, tmp_path, limit=240, root=str(tmp_path))
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
    first, second = (r["accumulation"] for r in results)

    # Lightning ran the window's first micro-batch inside no_sync(), except in
    # the window of one; the cockpit tracked the first of each window
    expected = [[0, 0, False], [0, 1, True], [1, 2, False], [1, 3, True], [2, 4, True]]
    assert first["synchronised"] == second["synchronised"] == expected
    history = first["history"]
    assert list(history) == ["0", "1", "2"]

    # every value is the joined first micro-batch's, recomputed by brute force
    firsts = [{}, {}]  # per rank: {step: (batch_idx, parameters, x, y)}
    for result, first_of in zip((first, second), firsts):
        for step, index, params, x, y in result["seen"]:
            first_of.setdefault(step, (index, _tensors(params), x, y))
    starts = {}
    for step in range(3):
        (i0, p0, x0, y0), (i1, p1, x1, y1) = firsts[0][step], firsts[1][step]
        assert i0 == i1 == 2 * step  # the window's first micro-batch on both
        for name in p0:
            assert torch.equal(p0[name], p1[name])  # DDP: the same parameters
        x = torch.tensor(x0 + x1, dtype=torch.float64)  # rank 0's shard, rank 1's
        y = torch.tensor(y0 + y1)
        assert x.shape[0] == WORLD * MICRO
        starts[step] = p0
        want = _brute_force(_net64(), p0, x, y)
        for key, value in want.items():
            _exact(history[str(step)][key], value, f"step {step}, {key}", rel=1e-9)
        _exact(
            history[str(step)]["Distance"], _norms_between(p0, starts[0]), "Distance"
        )
        if step:
            _exact(
                history[str(step - 1)]["UpdateSize"],
                _norms_between(p0, starts[step - 1]),
                f"step {step - 1}, UpdateSize",
            )
        assert "accumulate_grad_batches=2" in history[str(step)]["missing"]["Alpha"]
    assert json.dumps(second["history"]) == json.dumps(history)  # the same values
    # the optimizer got what Lightning gives it without the callback (k = 2: bitwise)
    assert first["final"] == first["final_without_callback"]
    assert second["final"] == first["final"]
    # rank 0 streamed the log into the trainer's log dir and warned once
    assert first["logpath"] == str(tmp_path / "accumulation" / "cockpit.jsonl")
    assert second["logpath"] is None
    assert sorted(os.listdir(tmp_path / "accumulation")) == ["cockpit.jsonl"]
    alpha = [w for w in first["warnings"] if "Alpha has no value" in w]
    assert len(alpha) == 1 and "accumulate_grad_batches=1" in alpha[0]
    assert not [w for w in second["warnings"] if "Alpha has no value" in w]

    # clipping changed .grad after the tracked backward: Alpha missing, everywhere
    for result in results:
        clipped = result["clipping"]["history"]
        assert list(clipped) == ["0", "1", "2"]
        for step in clipped.values():
            assert "gradient_clip_val=0.001" in step["missing"]["Alpha"]
            assert "GradNorm" in step
    first, second = (r["clipping"] for r in results)
    assert json.dumps(first["history"]) == json.dumps(second["history"])
    caught = [w for w in first["warnings"] if "Alpha has no value" in w]
    assert len(caught) == 1 and "Trainer(gradient_clip_val=None)" in caught[0]
    assert not [w for w in second["warnings"] if "Alpha has no value" in w]


# --- ModelParallelStrategy: FSDP2 (fully_shard) in configure_model ------------------
class ShardedRecording(Recording):
    """``fully_shard`` on each Linear and on the net, over the data-parallel mesh."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        full = {n: p.full_tensor() for n, p in self.net.named_parameters()}
        self.seen.append((self.trainer.global_step, batch_idx, full, x, y))
        return self.loss_fn(self.net(x), y)


def model_parallel_fits(rank: int, world: int, root: str) -> dict:
    """Worker: the same fit with DDP and with FSDP2 (ModelParallelStrategy)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    result = {}
    for name, strategy, module in [
        ("ddp", "ddp", Recording),
        ("fsdp2", ModelParallelStrategy(world, 1), ShardedRecording),
        ("plain", ModelParallelStrategy(world, 1), ShardedRecording),
    ]:
        quantities = _accumulation_quantities(create_graph=False)
        callbacks = [] if name == "plain" else [CockpitCallback(quantities=quantities)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = _fit(
                os.path.join(root, name), callbacks, module=module,
                strategy=strategy, max_steps=3,
            )  # fmt: skip
        full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p
                for n, p in model.named_parameters()}  # fmt: skip
        seen = [(s, _listed(p), x.tolist(), y.tolist()) for s, _, p, x, y in model.seen]
        result[name] = {
            "history": callbacks[0].cockpit.history.to_dict() if callbacks else None,
            "final": _listed(full),
            "seen": seen,
            "warnings": _cockpit_warnings(caught),
        }
    return result


#: The Hessian's diagonal under DDP (BackPACK), the GGN's under FSDP2.
_CURVATURE = ("HessTrace", "HessTrace_estimate")


def _ggn_traces(net, params: dict, x, y) -> list[float]:
    """Per parameter, the trace of the mean cross-entropy's GGN: brute force.

    ``(1/n) sum_i J_i^T (diag(p_i) - p_i p_i^T) J_i`` with each sample's dense
    Jacobian of the logits.
    """
    from torch.func import functional_call

    names = list(params)
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]
    flat = torch.cat([params[n].flatten() for n in names])
    total = torch.zeros_like(flat)
    for i in range(x.shape[0]):

        def logits(f, i=i):
            theta = dict(
                zip(names, (t.view(s) for t, s in zip(f.split(sizes), shapes)))
            )
            return functional_call(net, theta, (x[i : i + 1],))[0]

        jac = torch.autograd.functional.jacobian(logits, flat)  # [C, D]
        p = torch.softmax(logits(flat), 0)
        middle = torch.diag(p) - torch.outer(p, p)
        total += torch.einsum("cd,ce,ed->d", jac, middle, jac)
    return [float(t.sum()) for t in (total / x.shape[0]).split(sizes)]


def test_model_parallel_strategy_logs_what_ddp_logs(tmp_path):
    """FSDP2 through Lightning: ``ModelParallelStrategy`` with ``fully_shard`` in
    ``configure_model`` (2 processes). Every value of the sharded fit equals the
    same fit's under DDP to 1e-8 on every rank, and the first-order ones the
    brute force of the joined batch; nothing is missing: HessTrace reads the GGN
    there (DDP the Hessian, from BackPACK), equal to the brute-force GGN's
    traces of the joined batch; Alpha replays SGD's momentum from its joined
    shards; the optimizer trains as without the callback."""
    results = ddp.launch(
        model_parallel_fits, WORLD, tmp_path, limit=240, root=str(tmp_path)
    )
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
    want = results[0]["ddp"]["history"]
    assert list(want) == ["0", "1", "2"]
    for result in results:
        got = result["fsdp2"]["history"]
        assert all("missing" not in values for values in got.values()), got
        assert all("HessTrace" in values for values in want.values()), want
        problems: list[str] = []
        _same(
            {s: {k: v for k, v in w.items() if k not in _CURVATURE}
             for s, w in want.items()},
            {s: {k: v for k, v in g.items() if k not in _CURVATURE}
             for s, g in got.items()},
            "fsdp2", problems, rel=1e-8,
        )  # fmt: skip
        assert not problems, problems[:10]
        for values in got.values():  # the engines of sharded models: the GGN
            how = values["HessTrace_estimate"]
            assert (how["method"], how["curvature"]) == ("ggn_exact", "ggn"), how
        said = [w for w in result["fsdp2"]["warnings"] if "use the generalised" in w]
        assert len(said) == 1, result["fsdp2"]["warnings"]
        assert said[0].startswith(
            "HessTrace: no engine that serves fully_shard (FSDP2) models forms the "
            "Hessian diagonal (BackPACK does not serve them)"
        ), said
        assert not problems, problems[:10]
        assert result["fsdp2"]["final"] == result["plain"]["final"]
    first, second = (r["fsdp2"]["seen"] for r in results)
    for (s0, p0, x0, y0), (s1, p1, x1, y1) in zip(first, second, strict=True):
        assert s0 == s1 and p0 == p1  # every rank saw the same full parameters
        x = torch.tensor(x0 + x1, dtype=torch.float64)
        y = torch.tensor(y0 + y1)
        brute = _brute_force(_net64(), _tensors(p0), x, y)
        brute["HessTrace"] = _ggn_traces(_net64(), _tensors(p0), x, y)
        for key in ("Loss", "GradNorm", "Variance", "NormTest", "HessTrace"):
            got = results[0]["fsdp2"]["history"][str(s0)][key]
            _exact(got, brute[key], f"step {s0}, {key}", rel=1e-9)
    assert len(first) == 3  # one batch an optimizer step


# --- what the callback refuses -------------------------------------------------------
def test_sharding_strategies_are_refused_with_the_fix():
    from lightning.pytorch.strategies import FSDPStrategy

    callback = CockpitCallback()
    trainer = SimpleNamespace(
        strategy=FSDPStrategy(), world_size=2, is_global_zero=True
    )
    with pytest.raises(RuntimeError, match="single-device training, DDP and") as error:
        callback.setup(trainer, Classifier(_net()), "fit")
    assert "FSDPStrategy" in str(error.value) and "FlatParameter" in str(error.value)
    assert "Fix: Trainer(strategy=ModelParallelStrategy(" in str(error.value)


def test_tensor_parallelism_is_refused_with_the_fix():
    from lightning.pytorch.strategies import ModelParallelStrategy

    callback = CockpitCallback()
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    trainer = SimpleNamespace(strategy=strategy, world_size=2, is_global_zero=True)
    with pytest.raises(RuntimeError, match="tensor_parallel_size=2") as error:
        callback.setup(trainer, Classifier(_net()), "fit")
    assert (
        "Fix: ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)"
        in (str(error.value))
    )


def test_a_ddp_strategy_without_torch_ddp_is_refused():
    """E.g. DeepSpeed (a DDPStrategy subclass) wraps the model in its own engine."""
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(model=nn.Linear(2, 2)), world_size=2
    )
    with pytest.raises(RuntimeError, match="not torch's DistributedDataParallel"):
        CockpitCallback._check_data_parallel(trainer)
    trainer.world_size = 1  # one process: nothing to check
    CockpitCallback._check_data_parallel(trainer)


def test_a_callback_with_every_configuration_pickles():
    """ddp_spawn pickles the callbacks, with their quantities and schedules."""
    import pickle

    callback = CockpitCallback(quantities=configuration("full") + [Variance(linear(2))])
    copy = pickle.loads(pickle.dumps(callback))
    assert [q.key for q in copy.quantities] == [q.key for q in callback.quantities]
