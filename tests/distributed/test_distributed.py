"""Data-parallel runs (DDP): the same numbers on P processes as on one.

Real ``torch.distributed`` processes (gloo, CPU, float64) train with DDP, each on its
shard of the joined batches; one process trains on the joined batches. Every value of
the full configuration plus Variance, MeanGSNR, TICTrace, TICDiag (GGN), an adapted
GradHist1d, a per-parameter GradHist2d and (with SGD) CABS and EarlyStopping must
agree to 1e-6 relative. The last step has uneven shards (the last batch of an epoch),
where values are weighted by sample count; DDP's own update there weights the
processes equally, which is why it is the last step (only values of that step exist).
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch.distributed as dist

from cockpit.curvature import source as curvature_source
from cockpit.engines.routing import PER_SAMPLE_BACKWARD
from tests.utils import ddp
from tests.utils import expected_warnings as expected

pytestmark = pytest.mark.skipif(
    not dist.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)
pytestmark = [
    pytestmark,
    expected.TIC_HESSIAN_NOT_POSITIVE,
    expected.GGN_FOR_HESSIAN,
    expected.TIC_WITHOUT_CURVATURE_RULE,
    expected.ALPHA_GRAD_CHANGED,
]

#: Values that are not functions of the data (wall-clock time).
_NOT_COMPARED = ("Time",)


def _compare(want, got, path, problems):
    """Collect where ``got`` differs from ``want`` (numbers: 1e-6 relative)."""
    if isinstance(want, dict):
        if set(want) != set(got):
            problems.append(f"{path}: keys {sorted(set(want) ^ set(got))}")
            return
        for key in want:
            if key not in _NOT_COMPARED:
                _compare(want[key], got[key], f"{path}/{key}", problems)
    elif isinstance(want, list):
        if len(want) != len(got):
            problems.append(f"{path}: length {len(want)} != {len(got)}")
            return
        for i, (a, b) in enumerate(zip(want, got)):
            _compare(a, b, f"{path}[{i}]", problems)
    elif isinstance(want, bool) or not isinstance(want, (int, float)):
        if want != got:
            problems.append(f"{path}: {want!r} != {got!r}")
    elif not math.isclose(want, got, rel_tol=1e-6, abs_tol=1e-12):
        problems.append(f"{path}: {want!r} != {got!r}")


def _leaves(value) -> int:
    if isinstance(value, dict):
        return sum(_leaves(v) for v in value.values())
    if isinstance(value, list):
        return sum(_leaves(v) for v in value)
    return 1


def _as_json(history):
    """The reference history with the JSON key types the processes wrote."""
    import json

    return json.loads(json.dumps(history))


CASES = [
    ("mlp", "sgd", 2, "full"),
    ("cnn", "adam", 2, "full"),
    ("mlp", "adam", 3, "full"),
    ("cnn", "sgd", 3, "full"),
    # the autograd engine (a replayed gate, a GRU by backward passes per sample)
    # and a Hutchinson HessTrace, with economy (SGD) and with full (Adam)
    ("gru", "sgd", 3, "economy"),
    ("gru", "adam", 3, "full"),
]


@pytest.mark.parametrize(
    "model, optimizer, world, label",
    CASES,
    ids=["-".join(map(str, c)) for c in CASES],
)
def test_every_value_equals_one_process_on_the_joined_batch(
    tmp_path, model, optimizer, world, label
):
    even = 4 * world
    case = {
        "model": model,
        "optimizer": optimizer,
        "sizes": [even, even, even, even - 1],  # the last shard is one short
        "configuration": label,
        "curvature": True,
    }
    results = ddp.launch(ddp.ddp_history, world, tmp_path, case=case)
    want = _as_json(ddp.train(case).history.to_dict())
    assert list(want) == ["0", "1", "2", "3"]
    keys = {key for step in want.values() for key in step}
    expected = {"Loss", "GradNorm", "Variance", "MeanGSNR", "InnerTest", "OrthoTest"}
    expected |= {"NormTest", "Alpha", "UpdateSize", "Distance", "GradHist1d"}
    expected |= {"HessTrace", "GradHist1dAdaptive"}
    if label == "full":
        expected |= {"HessMaxEV", "TICTrace", "GradHist2d", "H2"}
    if model != "gru":
        expected |= {"TICDiagGGN"} if label == "full" else set()
    else:
        # a GRU: the curvature is the GGN of the cross-entropy, in one process and
        # in the data-parallel run alike (exact: the joined batch's rows times
        # classes are few), so the TIC diagonals have values too
        expected |= {"HessTrace_estimate", "TICTrace", "TICTrace_estimate"}
        if label == "full":
            expected |= {"TICDiag", "TICDiagGGN"}
        estimates = [step["HessTrace_estimate"] for step in want.values()]
        assert {e["curvature"] for e in estimates} == {"ggn"}
        assert {e["method"] for e in estimates} == {"ggn_exact"}
    if optimizer == "sgd":
        expected |= {"CABS", "EarlyStopping"}
    assert expected <= keys, expected - keys
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
        assert result["data_parallel"]
        if model == "gru":  # both ways of the autograd engine ran
            assert "replay of Gate" in result["methods"]
            assert PER_SAMPLE_BACKWARD in result["methods"]
        problems: list[str] = []
        _compare(want, result["history"], f"rank {result['rank']}", problems)
        assert not problems, "\n".join(problems[:20])
    assert _leaves(want) > 200  # the comparison covered many values


def test_a_step_with_the_ggn_and_the_hessian_joins_each_estimates_errors(tmp_path):
    """One step estimates the GGN (HessTrace, TICTrace: exact on this joined batch)
    and the Hessian (a HessTrace with ``curvature="hutchinson"``, 16 products from
    the same probes on every process). Each estimate's standard errors are joined
    from its own draws: the GGN's stay zero, Hutchinson's equal one process's, and
    every value and error agrees with one process to 1e-6 on every rank."""
    case = {
        "model": "gru",
        "optimizer": "sgd",
        "sizes": [6, 6, 5],
        "configuration": "economy",
        "curvature": True,
        "hutchinson": True,
    }
    results = ddp.launch(ddp.ddp_history, 2, tmp_path, case=case)
    want = _as_json(ddp.train(case).history.to_dict())
    for step in want.values():
        assert step["HessTrace_estimate"]["method"] == "ggn_exact"
        assert step["HessTraceH_estimate"]["method"] == "hutchinson"
        assert set(step["HessTrace_estimate"]["stderr"]) == {0.0}
        assert min(step["HessTraceH_estimate"]["stderr"]) > 0
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
        problems: list[str] = []
        _compare(want, result["history"], f"rank {result['rank']}", problems)
        assert not problems, "\n".join(problems[:20])


#: What a Monte-Carlo GGN step records from its draws (compared within errors).
_DRAWN = ("HessTrace", "TICTrace", "HessTrace_estimate", "TICTrace_estimate")


@pytest.mark.parametrize("world", [2, 3])
def test_the_monte_carlo_ggn_of_the_joined_batch_agrees_with_one_process(
    tmp_path, world
):
    """A GRU (no BackPACK curvature rule) on batches whose rows times classes
    exceed the exact GGN's budget: the Monte-Carlo GGN. One draw's vector is a sum
    over the batch's rows, so a process's draw lacks the cross terms with the other
    shards' rows (zero in expectation): the joined estimate is unbiased like one
    process's, but not the same numbers. Each process draws its rows' labels from
    its own columns of the joined batch's uniform numbers (independent across
    processes), and the count and the top-up are decided on the joined draws'
    traces, so every rank records the same values; HessTrace and TICTrace agree
    with one process within 4 standard errors (of the difference), everything else
    to 1e-6. TICDiag, which takes only an exact diagonal, is missing in both (one
    process decides when routing, a process of the run once it knows the joined
    batch's size: the reasons' words differ)."""
    case = {
        "model": "gru",
        "optimizer": "sgd",
        "sizes": [24, 24, 23],
        "configuration": "economy",
        "curvature": True,
        "tic_diag": True,
    }
    results = ddp.launch(ddp.ddp_history, world, tmp_path, case=case)
    want = _as_json(ddp.train(case).history.to_dict())
    histories = []
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
        histories.append(result["history"])
    for history in [want, *histories]:
        for step in history.values():
            assert "TICDiagGGN" in step.pop("missing", {}), step
            assert step["HessTrace_estimate"]["method"] == "ggn_monte_carlo"
            assert step["HessTrace_estimate"]["probes"] >= curvature_source.MIN_DRAWS
    for rank, history in enumerate(histories[1:], start=1):  # the ranks agree
        problems: list[str] = []
        _compare(histories[0], history, f"rank {rank}", problems)
        assert not problems, "\n".join(problems[:20])
    got = histories[0]
    deviations = []
    for step, values in want.items():
        for key in ("HessTrace", "TICTrace"):
            a, b = values[key], got[step][key]
            a, b = (a, b) if isinstance(a, list) else ([a], [b])
            errors = [values[f"{key}_estimate"], got[step][f"{key}_estimate"]]
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                se = math.hypot(errors[0]["stderr"][i], errors[1]["stderr"][i])
                assert abs(x - y) <= 4 * se, (step, key, i, x, y, se)
                deviations.append(abs(x - y) / se)
        rest = {k: v for k, v in values.items() if k not in _DRAWN}
        problems = []
        _compare(rest, {k: got[step][k] for k in rest}, f"step {step}", problems)
        assert not problems, "\n".join(problems[:20])
    assert len(deviations) >= 3 * 8 and max(deviations) > 0  # not the same draws


def test_a_micro_batch_tracked_inside_no_sync_describes_the_joined_batch(tmp_path):
    """Gradient accumulation with DDP: the tracked micro-batch runs inside
    ``no_sync()``, where ``.grad`` is each process's own; with ``no_sync=True`` the
    cockpit joins the processes' gradients itself. Every value (full configuration,
    with Alpha recorded as missing: ``.grad`` changes before the step) equals one
    process on the joined micro-batches, on every rank."""
    case = {"model": "mlp", "optimizer": "sgd", "sizes": [8] * 6}
    results = ddp.launch(ddp.ddp_accumulating_history, 2, tmp_path, case=case)
    want = _as_json(ddp.train_accumulating(case).history.to_dict())
    assert list(want) == ["0", "1", "2"]
    assert {"GradNorm", "Variance", "HessMaxEV", "InnerTest", "CABS"} <= set(want["1"])
    assert "Alpha" in want["0"]["missing"]  # .grad changed before optimizer.step()
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
        problems: list[str] = []
        _compare(want, result["history"], f"rank {result['rank']}", problems)
        assert not problems, "\n".join(problems[:20])
    assert _leaves(want) > 100


def _errors(results):
    return {r["rank"]: r.get("error", "") for r in results}


@pytest.mark.parametrize(
    "how, says",
    [
        ("quantities", "quantities of rank(s) [1] differ"),
        ("schedules", "schedules of rank(s) [1] differ"),
        ("steps", "first step of rank(s) [1] differ"),
        ("no-ddp", "gradients differ across processes"),
        ("inside-no-sync", "no_sync=True"),
        ("no-sync-one-rank", "ranks [0, 1] plan different work at step 0"),
        ("shapes", "parameters of rank(s) [1] differ"),
    ],
)
def test_processes_that_disagree_fail_with_a_clear_error_on_every_rank(
    tmp_path, how, says
):
    results = ddp.launch(ddp.misuse, 2, tmp_path, limit=90, how=how)
    for rank, error in _errors(results).items():
        assert error.startswith("DistributedError"), (rank, error)
        assert says in error, (rank, error)
        assert "Fix:" in error or "process_group=None" in error


def test_untracked_steps_send_nothing(tmp_path):
    """Only the first step (the set-up check) and tracked steps communicate."""
    for result in ddp.launch(ddp.collectives_per_step, 2, tmp_path, limit=90):
        assert "error" not in result, result.get("traceback", result.get("error"))
        assert result["tracked"] == [0, 2, 4]
        counts = result["counts"]
        assert counts[1] == counts[3] == 0, counts  # untracked: nothing at all
        assert counts[2] > 0 and counts[4] > 0, counts  # the counter sees cockpit


@pytest.mark.parametrize("how", ["raise", "raise-and-wait"])
def test_a_rank_that_raises_inside_a_tracked_step_does_not_block_the_others(
    tmp_path, how
):
    """Rank 1 raises after its backward pass, inside the tracked step: it tells
    the others as it leaves, so rank 0 raises a DistributedError naming rank 1, the
    step and the error at once (not after the timeout), whether rank 1's process
    ends or lives on."""
    results = ddp.launch(
        ddp.misuse, 2, tmp_path, limit=90, how=how, timeout=5.0, wait_dir=str(tmp_path)
    )
    first, second = results
    assert second.get("raised") == "ValueError: the user's code failed on rank 1"
    assert first.get("error", "").startswith("DistributedError"), first
    says = "rank 1 left step 0 with ValueError: the user's code failed on rank 1"
    assert says in first["error"], first
    assert first["seconds"] < 5


def test_rank_local_opt_out_and_one_log_writer(tmp_path):
    """process_group=None: each process describes its own shard (as one process
    on that shard would); with the default, only rank 0 streams and writes the
    log, and every rank holds the same values."""
    results = ddp.launch(ddp.local_and_logged, 2, tmp_path, logdir=str(tmp_path))
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
    case = {"model": "mlp", "optimizer": "sgd", "configuration": "economy"}
    for result in results:
        assert result["local_data_parallel"] is False
        rank = result["rank"]
        # the shard's own run: its first step is one process on that shard
        shard = ddp.joined_batches("mlp", [8])[0]
        one = ddp.train_on(
            case,
            [(shard[0][rank * 4 : rank * 4 + 4], shard[1][rank * 4 : rank * 4 + 4])],
        )
        want = _as_json(one.history.to_dict())["0"]  # (no step 1: no two-step values)
        got = {k: v for k, v in result["local"]["0"].items() if k in want}
        assert len(got) >= 8
        problems: list[str] = []
        _compare(want, got, f"rank {rank}", problems)
        assert not problems, "\n".join(problems)
    first, second = results
    assert first["logpath"] == str(tmp_path / "run.jsonl")
    assert second["logpath"] is None and second["written"] is None
    assert first["written"] == str(tmp_path / "written.json")
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".json") == [
        "run.jsonl"
    ]
    problems = []
    _compare(first["logged"], second["logged"], "ranks", problems)
    assert not problems
    assert first["local"]["0"]["Loss"] != second["local"]["0"]["Loss"]


def test_log_rank_picks_the_writer_and_a_rank_outside_the_group_is_refused(tmp_path):
    """log_rank=1: rank 1 streams and writes the log, rank 0 writes nothing, values
    equal; log_rank=2 of 2 processes: a ValueError on every rank, before training."""
    results = ddp.launch(ddp.logged_by, 2, tmp_path, logdir=str(tmp_path), log_rank=1)
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
    first, second = results
    assert [first["is_writer"], second["is_writer"]] == [False, True]
    assert first["logpath"] is None and first["written"] is None
    assert second["logpath"] == str(tmp_path / "run.jsonl")
    assert second["written"] == str(tmp_path / "written.json")
    logged = [json.loads(line) for line in (tmp_path / "run.jsonl").open()]
    assert len(logged) >= 2
    problems: list[str] = []
    _compare(first["logged"], second["logged"], "ranks", problems)
    assert not problems

    for log_rank, kind in ((2, "ValueError"), ("1", "TypeError")):
        bad = tmp_path / f"bad-{kind}"  # its own folder: no rank file of another run
        bad.mkdir()
        results = ddp.launch(ddp.logged_by, 2, bad, logdir=str(bad), log_rank=log_rank)
        for result in results:
            assert "error" not in result, result.get("traceback", result["error"])
            assert result["raised"].startswith(f"{kind}: log_rank"), result
        assert "ranks 0 to 1" in results[0]["raised"] or kind == "TypeError"
        assert not any(p.name.startswith("run") for p in bad.iterdir())


def test_two_data_parallel_groups_each_describe_their_own_joined_batch(tmp_path):
    """Four processes in two DDP groups {0, 1} and {2, 3}, each cockpit on its own
    group: each group's values equal one process on that group's joined batch (the
    groups train on different data); a cockpit given a group this process is not a
    member of is refused with a message naming the fix."""
    results = ddp.launch(ddp.two_groups, 4, tmp_path)
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
    case = {"model": "mlp", "optimizer": "sgd", "configuration": "economy"}
    for group in (0, 1):
        want = _as_json(ddp.train_on(case, ddp.group_batches(group)).history.to_dict())
        members = results[2 * group : 2 * group + 2]
        assert [r["group_rank"] for r in members] == [0, 1]
        assert [r["is_writer"] for r in members] == [True, False]
        for result in members:
            assert "not a member of the process group" in result["refused"]
            assert "Fix:" in result["refused"]
            problems: list[str] = []
            _compare(want, result["history"], f"group {group}", problems)
            assert not problems, "\n".join(problems[:20])
    assert results[0]["history"]["0"]["Loss"] != results[2]["history"]["0"]["Loss"]


# --- the step's header and shared projections, without processes ---------------------
class _Gathering:
    """A header in flight: ready when told, then every process's row."""

    def __init__(self, rows):
        self.rows, self.is_ready, self.waits = rows, False, 0

    def ready(self):
        return self.is_ready

    def wait(self):
        self.waits += 1
        return self.rows


class _Rank:
    rank, size, local = 1, 2, False


def test_header_settles_once_when_first_needed_and_keeps_its_error():
    """The header travels during the backward pass; counts are read after it."""
    from cockpit.distributed import DistributedError, StepComm

    header = _Gathering([[7, 3, 11], [7, 5, 11]])
    step = StepComm(_Rank(), 7, n_local=5, header=header)
    assert step.n_local == 5 and not step.settled and header.waits == 0
    assert not step.known_even()  # not arrived yet: never waits
    assert header.waits == 0
    assert (step.n_global, step.offset, step.counts) == (8, 3, [3, 5])
    assert step.weight == 5 / 8 and step.uneven and step.settled
    assert header.waits == 1 and step.settle() is step and header.waits == 1

    even = _Gathering([[7, 4, 11], [7, 4, 11]])
    step = StepComm(_Rank(), 7, n_local=4, header=even)
    even.is_ready = True
    assert step.known_even() and step.n_global == 8

    for rows, message in (
        ([[7, 4, 11], [8, 4, 11]], "track different steps"),
        ([[7, 4, 11], [7, 4, 12]], "plan different work"),
        ([[7, 0, 11], [7, 4, 11]], "empty shard"),
    ):
        bad = _Gathering(rows)
        step = StepComm(_Rank(), 7, n_local=4, header=bad)
        bad.is_ready = True
        assert not step.known_even()  # a bad header is left for settle() to raise
        for _ in range(2):  # the same error again, without a second wait
            with pytest.raises(DistributedError, match=message):
                step.settle()
        assert bad.waits == 1


def test_projections_onto_one_vector_are_computed_once_per_parameter():
    """Alpha's SGD direction and the gradient tests' gradient share a projection."""
    import torch

    from cockpit.distributed import StepComm
    from cockpit.per_sample import DenseGradients

    torch.manual_seed(0)
    per_sample = torch.randn(6, 3, 2, dtype=torch.float64)
    individual = DenseGradients(per_sample, scale=1)
    calls = []
    project = individual.project
    individual.project = lambda v: calls.append(1) or project(v)
    step = StepComm(_Rank(), 0, counts=[6, 6])
    grad = torch.randn(3, 2, dtype=torch.float64)
    want = torch.einsum("nij,ij->n", per_sample, grad)
    first = step.projection(0, individual, grad)
    assert torch.allclose(first, want) and len(calls) == 1
    again = step.projection(0, individual, grad.detach())  # same memory
    equal = step.projection(0, individual, grad.clone())  # equal values
    assert len(calls) == 1 and again is first and equal is first
    other = grad + 1
    moved = step.projection(0, individual, other)
    assert len(calls) == 2
    assert torch.allclose(moved, torch.einsum("nij,ij->n", per_sample, other))


# --- ranks that part ways in the middle of a run --------------------------------------
#: cockpit's timeout in the tests below, and the margin every rank must end within:
#: a few polls of the store and one roll call of notes (0.6 s each at most).
_TIMEOUT, _MARGIN = 3.0, 4.0
#: The process group's own timeout: where DDP or gloo would end a hang without
#: cockpit (the tests fail by assertion, not by waiting for it).
_PG_TIMEOUT = 30.0

PARTED = [
    # how, processes, tracked every k steps, what every process's error says
    ("untracked", 3, 1, ["tracks step 2, which rank 1 does not track", "schedule"]),
    ("plain", 2, 2, ["rank 0 tracks step 2, which rank 1 does not track"]),
    ("plain", 3, 1, ["tracks step 2, which rank 1 does not track"]),
    ("ahead", 2, 2, ["rank 0 tracks step 2, which rank 1 does not track"]),
    ("caught", 2, 1, ["rank 1 left step 2 with ValueError: the user's code"]),
    ("left", 3, 1, ["rank 1 left step 2 with ValueError: the user's code"]),
    ("died", 2, 1, ["the connection to another process broke at step 2"]),
    ("stuck", 2, 1, ["no answer within 3 s at step 2", "rank 1: no report"]),
]


@pytest.mark.parametrize(
    "how, world, every, says",
    PARTED,
    ids=[f"{c[0]}-{c[1]}-every{c[2]}" for c in PARTED],
)
def test_ranks_that_part_ways_mid_run_all_stop_with_cockpits_error_in_time(
    tmp_path, how, world, every, says
):
    """Rank 1 parts ways with the others at step 2 of a DDP run in which every step
    is wrapped in ``with cockpit(...)``: its schedule skips the step the others
    track, it runs that step's backward pass outside cockpit, it counts steps one
    ahead, it raises inside the step and catches the error and goes on, it raises
    and leaves (alive), it dies, or it stays inside the step (the others wait for
    cockpit's timeout, then say so). Every process still alive raises cockpit's
    DistributedError naming the ranks and the step, within cockpit's timeout plus
    a margin: never a hang on the process group, never a raw gloo error. (The
    rank that raised its own error keeps it.)"""
    results = ddp.launch(
        ddp.disagree,
        world,
        tmp_path,
        limit=_PG_TIMEOUT + 15,
        pg_timeout=_PG_TIMEOUT,
        how=how,
        timeout=_TIMEOUT,
        every=every,
        wait_dir=str(tmp_path),
    )
    for result in results:
        rank = result["rank"]
        if how == "died" and rank == 1:
            assert result["error"] == "exit code 3", result
            continue
        assert "error" not in result, result.get("traceback", result.get("error"))
        raised = result["raised"] or ""
        if how == "left" and rank == 1:  # its own error, unchanged
            assert raised == "ValueError: the user's code failed on rank 1"
            continue
        if how == "stuck" and rank == 1:  # back from its long pause: told, too
            assert raised.startswith("DistributedError: "), result["traceback"]
            assert "no answer within 3 s at step 2" in raised
            continue
        assert raised.startswith("DistributedError: "), (rank, raised)
        assert f"cockpit on rank {rank} of {world}" in raised
        assert "stops at step 2" in raised, (rank, raised)
        for text in says:
            assert text in raised, (rank, raised)
        for other in range(world):  # where each process is, or that it is gone
            assert f"rank {other}: " in raised, (rank, raised)
        assert "Fix:" in raised
        assert result["since_parting"] < _TIMEOUT + _MARGIN, result
        assert max(result["finished"]) <= ddp.PARTING, result  # nothing after it
