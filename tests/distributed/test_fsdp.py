"""FSDP2 (``fully_shard``) runs: the numbers of one process, or a refusal.

Real ``torch.distributed`` processes (gloo, CPU, float64) train models wrapped with
``torch.distributed.fsdp.fully_shard`` (per unit and on the root, or the root
only; ``reshard_after_forward`` on and off), each on its shard of the joined
batches; one process trains the plain model on the joined batches with the same
engines. Every value the sharded run records, the second-order ones included
(HessMaxEV's Lanczos, the GGN's and Hutchinson's curvature diagonals), equals the
single process's to 1e-8 relative on every rank, nothing is missing, and layouts
cockpit does not serve are refused on every rank when the Cockpit is made.
"""

from __future__ import annotations

import math
import sys
import time

import pytest
import torch
import torch.distributed as dist

from cockpit.errors import CockpitWarning
from tests.utils import expected_warnings as expected
from tests.utils import fsdp

pytestmark = pytest.mark.skipif(
    not dist.is_available() or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)
pytestmark = [pytestmark, expected.GGN_FOR_HESSIAN, expected.FROZEN_SKIPPED]

#: Values that are not functions of the data (wall-clock time).
_NOT_COMPARED = ("Time", "missing")
#: What every run records (the full configuration: the second-order ones too).
_FIRST_ORDER = {"GradNorm", "Variance", "InnerTest", "GradHist1d", "MeanGSNR"}
_SECOND_ORDER = {"HessMaxEV", "HessTrace", "TICDiag"}


def _compare(want, got, path, problems):
    """Where ``got`` differs from ``want`` (numbers: 1e-8 relative)."""
    if isinstance(want, dict):
        for key in set(want) | set(got):
            if key in _NOT_COMPARED:
                continue
            if key not in want or key not in got:
                problems.append(
                    f"{path}/{key}: only in {'got' if key in got else 'want'}"
                )
                continue
            _compare(want[key], got[key], f"{path}/{key}", problems)
    elif isinstance(want, list) and path.endswith("GradHist1d/hist") and want != got:
        _compare_counts(want, got, path, problems)
    elif isinstance(want, list) and path.endswith("GradHist2d/hist") and want != got:
        _compare_counts_2d(want, got, path, problems)
    elif isinstance(want, list):
        if len(want) != len(got):
            problems.append(f"{path}: length {len(want)} != {len(got)}")
            return
        for i, (a, b) in enumerate(zip(want, got)):
            _compare(a, b, f"{path}[{i}]", problems)
    elif isinstance(want, bool) or not isinstance(want, (int, float)):
        if want != got:
            problems.append(f"{path}: {want!r} != {got!r}")
    elif not math.isclose(want, got, rel_tol=1e-8, abs_tol=1e-13):
        problems.append(f"{path}: {want!r} != {got!r}")


def _compare_counts(want, got, path, problems):
    """Histogram counts: equal, except across the edge at zero after a step.

    After the first update the parameters differ by rounding (FSDP's
    reduce-scatter averages the shards' gradients, one process sums the batch),
    so per-sample gradient elements that are zero in exact arithmetic (about
    1e-18 in float64) may fall on either side of the edge at zero: the two middle
    bins (the range is symmetric) may trade counts, the total may not change.
    """
    if len(want) != len(got) or sum(want) != sum(got):
        problems.append(f"{path}: {want!r} != {got!r}")
        return
    middle = {len(want) // 2 - 1, len(want) // 2}
    odd = [i for i, (a, b) in enumerate(zip(want, got)) if a != b and i not in middle]
    if odd:
        problems.append(f"{path}: counts differ in bins {odd}")


def _compare_counts_2d(want, got, path, problems):
    """GradHist2d's counts (gradient bins x parameter bins): as in 1d, per column.

    The two gradient bins at zero (the middle rows) may trade counts within a
    parameter bin (a column): a per-sample gradient element that is zero in
    exact arithmetic (a causal attention's first position, say) is about 1e-18
    either side, its parameter the same in both runs.
    """
    if len(want) != len(got) or any(len(a) != len(b) for a, b in zip(want, got)):
        problems.append(f"{path}: shapes differ")
        return
    low, high = len(want) // 2 - 1, len(want) // 2
    for i, (a, b) in enumerate(zip(want, got)):
        if i not in (low, high) and a != b:
            problems.append(f"{path}[{i}]: {a!r} != {b!r}")
    pairs = zip(want[low], want[high], got[low], got[high])
    for j, (a_low, a_high, b_low, b_high) in enumerate(pairs):
        if a_low + a_high != b_low + b_high:
            problems.append(f"{path}[:, {j}]: the middle rows' counts differ")


def _rank_histories(case, tmp_path, world: int = 2) -> list[dict]:
    """Every rank's history of one FSDP2 case (asserting that none failed)."""
    histories = []
    for result in fsdp.launch(fsdp.histories, world, tmp_path, cases=[case]):
        assert "error" not in result, result.get("traceback", result["error"])
        got = result["cases"][0]
        assert "error" not in got, got.get("traceback", got["error"])
        histories.append(got["history"])
    return histories


def _as_json(history):
    import json

    return json.loads(json.dumps(history))


CASES = [
    {"model": "mlp", "wrap": "units", "reshard": True, "configuration": "full"},
    # HessMaxEV by power iteration on the rows each rank holds
    {
        "model": "mlp",
        "wrap": "root",
        "reshard": False,
        "configuration": "full",
        "solver": "power",
    },
    {"model": "transformer", "wrap": "units", "reshard": False},
    {"model": "transformer", "wrap": "root", "reshard": True},
    # Hutchinson's probes and HessMaxEV: Hessian-vector products through every
    # unit, a frozen one too (the gradient of the embedding reads its weights)
    dict(
        model="transformer",
        wrap="units",
        reshard=True,
        configuration="full",
        curvature="hutchinson",
        frozen="blocks.0",
    ),
    dict(model="bert", wrap="units", reshard=True, steps=1, configuration="full"),
    # Adam's state is sharded: joined like the parameters for Alpha's replay
    {"model": "mlp", "wrap": "units", "reshard": True, "optimizer": "adam"},
    # AdamW's defaults hold a setting its constructor does not take
    {"model": "mlp", "wrap": "units", "reshard": True, "optimizer": "adamw"},
    # shards of different sizes: .grad is not the joined batch's gradient (its
    # rows are taken from the joined one); one step (FSDP's update is not the
    # joined batch's then)
    {"model": "mlp", "wrap": "units", "reshard": True, "sizes": [3, 5], "steps": 1},
]


def _check(cases, results, world):
    for k, case in enumerate(cases):
        want = _as_json(fsdp.train(case, None, world).history.to_dict())
        keys = {key for step in want.values() for key in step} - {"missing"}
        expected = set(_FIRST_ORDER)
        if case.get("steps", 2) > 1:  # two-step quantities
            expected |= {"Alpha", "UpdateSize"}
        if case.get("configuration") == "full":
            expected |= _SECOND_ORDER
        assert expected <= keys, expected - keys
        assert not any("missing" in step for step in want.values()), want
        for result in results:
            assert "error" not in result, result.get("traceback", result["error"])
            got = result["cases"][k]
            assert "error" not in got, got.get("traceback", got["error"])
            print(f"{case} rank {result['rank']}: {result['seconds']:.1f} s")
            got = got["history"]
            problems: list[str] = []
            _compare(want, got, f"{case} rank {result['rank']}", problems)
            assert not problems, problems[:10]
            missing = {q for step in got.values() for q in step.get("missing", {})}
            assert not missing, (case, missing)


def test_every_value_equals_one_process_on_the_joined_batch(tmp_path):
    results = fsdp.launch(fsdp.histories, 2, tmp_path, cases=CASES)
    _check(CASES, results, 2)


def test_four_processes(tmp_path):
    cases = [
        dict(model="mlp", wrap="units", reshard=True, batch=2, configuration="full"),
        {"model": "transformer", "wrap": "units", "reshard": True, "batch": 2},
        {"model": "bert", "wrap": "units", "reshard": False, "batch": 2, "steps": 1},
    ]
    results = fsdp.launch(fsdp.histories, 4, tmp_path, cases=cases)
    _check(cases, results, 4)


def _watched(tmp_path, case, want=None) -> list[dict]:
    """Train ``case`` on 2 processes, watching cockpit's collectives
    (:func:`fsdp.collectives`): each rank's values equal one process's (``want``,
    trained here if not given) and none is missing. The ranks' results."""
    if want is None:
        want = _as_json(fsdp.train(case, None, 2).history.to_dict())
    results = fsdp.launch(fsdp.collectives, 2, tmp_path, case=case)
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
        problems: list[str] = []
        _compare(want, result["history"], f"rank {result['rank']}", problems)
        assert not problems, problems[:10]
        assert not any("missing" in step for step in result["history"].values())
    return results


#: A transformer stack tracking business with Variance and MeanGSNR.
_ELEMENTWISE = dict(
    model="transformer",
    wrap="units",
    reshard=True,
    configuration="business",
    extras=["Variance", "MeanGSNR"],
)


@pytest.mark.parametrize(
    "case",
    [
        {"model": "transformer", "wrap": "units", "reshard": True},
        # elementwise sums (MeanGSNR's, TICDiag's): each process its rows of them
        _ELEMENTWISE,
        # the same, the sums sent in runs of at most 40 numbers (rows of a
        # larger parameter in pieces)
        dict(_ELEMENTWISE, scatter_elements=40),
        # Adam's update replayed on each process's rows of the state
        {"model": "mlp", "wrap": "root", "reshard": False, "optimizer": "adam"},
        # Parameters reads the full tensors: the shards are joined for it
        {"model": "mlp", "wrap": "units", "reshard": True, "extras": ["Parameters"]},
    ],
    ids=[
        "transformer",
        "elementwise",
        "elementwise-runs",
        "adam",
        "joined-for-parameters",
    ],
)
def test_shard_local_quantities_never_form_the_full_model(tmp_path, case):
    """Economy plus Variance compute from each process's rows: the full
    parameters and gradient are never joined, and no collective of cockpit's
    carries more numbers than the largest parameter holds (one parameter's full
    gradient or step, joined for the projection of its per-sample gradients),
    though the values equal one process's. Elementwise sums (MeanGSNR's
    ``sum_i g_i^2``, TICDiag's and its curvature diagonal) are reduce-scattered
    unit by unit during the backward pass: each process receives its rows of
    them. A quantity that reads the full tensors
    (Parameters) has them joined at each tracked step, and the values still
    agree."""
    case = dict(case, extras=case.get("extras", ["Variance"]))
    for result in _watched(tmp_path, case):
        sizes, reduced = result["sizes"], [tuple(r) for r in result["reduced"]]
        if "Parameters" in case["extras"]:
            shards = ["the parameters' shards", "the gradient's shards"]
            assert result["joined"] == shards * 2, result["joined"]
            assert (shards[0], sum(sizes)) in reduced
            continue
        assert result["joined"] == []
        # one parameter's full vector at a time, for a projection: step 0 the
        # gradient (the tests' and, with SGD, Alpha's direction: one product), step
        # 1 the gradient and Alpha's kept direction; Adam's directions are two more
        joins = 5 if case.get("optimizer") == "adam" else 3
        rows = [(f"the rows of parameter {i}", n) for i, n in enumerate(sizes)]
        assert sorted(r for r in reduced if r[0].startswith("the rows")) == sorted(
            rows * joins
        )
        sums = [n for what, n in reduced if what == "the step's sums"]
        assert len(sums) + joins * len(sizes) == len(reduced), reduced
        if case["model"] == "transformer":  # per-sample values, counts, scalars
            assert max(sums) < sum(sizes), (sums, sum(sizes))
        elementwise = case.get("configuration") == "business"
        assert bool(result["scattered"]) is elementwise, result["scattered"]
        by_step: dict[tuple[int, bool], list] = {}
        for sent, _, step, what, inside in result["scattered"]:
            unit = what == "the elementwise sums of a unit"
            by_step.setdefault((step, unit), []).append((sent, inside))
        cap, steps = case.get("scatter_elements"), case.get("steps", 2)
        if elementwise:  # every sum sent unit by unit, none late
            assert sorted(by_step) == [(s, True) for s in range(steps)], by_step
            # when a unit's sums are sent, cockpit holds no other unit's but the
            # root's (sent last, at the end of the backward pass, as FSDP
            # reduces the root's gradient): never the whole model's
            sent = [todo for todo, _, _ in result["held"] if todo]
            assert len(sent) == steps * result["units"], result["held"]
            root = set(sent[result["units"] - 1])
            for todo, held, _ in result["held"]:
                assert set(held) <= set(todo) | root, (todo, held)
            largest = max(sum(sizes[i] for i in todo) for todo in sent)
            most = max(n for *_, n in result["held"])  # (of the three sums)
            assert most <= 3 * (largest + sum(sizes[i] for i in root)), most
            assert most < 3 * sum(sizes), most
        for (step, _), scattered in by_step.items():
            sent = [n for n, _ in scattered]
            # three elementwise sums (MeanGSNR's, TICDiag's two) of D numbers:
            # each process receives its half (padded to the larger process's
            # rows), an all-reduce would give 3 D; one reduce-scatter per unit as
            # it finishes, inside the backward pass (the root's at its end, in
            # FSDP's final callback, where autograd runs no node)
            received = sum(sent) / 2
            assert 1.5 * sum(sizes) <= received < 0.6 * 3 * sum(sizes), sent
            assert 0 < sum(inside for _, inside in scattered), scattered
            if cap is None:
                assert len(sent) == result["units"], (step, sent)
            else:  # each unit's in runs of at most `cap` (a larger parameter in
                # pieces of whole rows)
                assert len(sent) > result["units"], (step, sent)
                assert all(n <= cap for n in sent), sent


def test_a_sum_formed_after_its_unit_was_sent_joins_after_the_backward_pass(
    tmp_path,
):
    """MeanGSNR's and EarlyStopping's sum ``sum_i g_i^2`` (the same numbers:
    one common channel, sent once for both) is sent unit by unit in the
    backward pass. Where one process forms a parameter's sum only after its
    unit was sent (rank 0 holds parameter 0's back until after the backward
    pass), that process had sent zeros; every process then sends its late sums
    of that parameter (or zeros) in a next round of the bucket, and the values
    of both quantities equal one process's on both ranks."""
    case = {"model": "transformer", "wrap": "units", "reshard": True, "late": True,
            "extras": ["MeanGSNR", "EarlyStopping"]}  # fmt: skip
    for result in _watched(tmp_path, case):
        late = [
            (sent, step)
            for sent, _, step, what, _ in result["scattered"]
            if what == "the step's sums"
        ]
        # the next round, once per step: only parameter 0 (the embedding, 23
        # rows of 8), the one common sum; each process its rows, padded to the
        # larger process's (12 rows): 96 numbers
        assert [step for _, step in late] == [0, 1], late
        assert result["sizes"][0] == 23 * 8, result["sizes"]
        assert all(sent == 2 * 12 * 8 for sent, _ in late), late
        # in the backward pass, each step: one sum of D numbers, each process
        # its half (padded), not one per quantity
        total = sum(result["sizes"])
        unit, scattered = "the elementwise sums of a unit", result["scattered"]
        for step in (0, 1):
            sent = [n for n, _, at, w, _ in scattered if (at, w) == (step, unit)]
            assert 0.5 * total <= sum(sent) / 2 < 0.6 * total, (step, sent)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_with_another_plan_stops_every_rank_after_the_backward_pass(
    tmp_path, rank
):
    """At step 1 one rank tracks with a plan of its own (``no_sync``): the first
    to claim the step goes on into its backward pass, where MeanGSNR's sums are
    sent unit by unit, the other stops after its backward pass and sends
    nothing. The one that went on waits for the step's header at its first unit,
    sees the other's failure, makes no collective for the rest of its backward
    pass (FSDP's own stay matched) and raises after it: every rank raises the
    same DistributedError, well within the limit (no hang)."""
    case = {"model": "transformer", "wrap": "units", "reshard": True,
            "extras": ["MeanGSNR"], "apart": [1, rank]}  # fmt: skip
    _every_rank_stops_in_time(tmp_path, case, ["plan different work at step 1"])


@pytest.mark.parametrize("extra", ["MeanGSNR", "HessMaxEV"])
@pytest.mark.parametrize("slow", [0, 1], ids=["tracker-late", "skipper-late"])
def test_a_rank_that_skips_a_tracked_step_stops_every_rank_in_time(
    tmp_path, slow, extra
):
    """Rank 1's schedule skips step 1, which rank 0 tracks with collectives of
    cockpit's inside its backward pass (MeanGSNR's sums, unit by unit) or before
    it (HessMaxEV's products), with no other quantity (none of step 0 goes on
    into step 1); one rank enters the step a second after the other. Rank 1
    first: rank 0's claim finds its pass of the step, and rank 0 runs its
    backward pass without cockpit's collectives (FSDP's pair). Rank 0 first:
    rank 1 finds the claim and raises the failed flag, which rank 0 sees at its
    first wait in cockpit (the step's header, or its first product). Either
    way every rank raises the same DistributedError well within cockpit's 60 s
    timeout (before passes, the first order waited for it)."""
    case = {"model": "transformer", "wrap": "units", "reshard": True,
            "configuration": None, "extras": [extra],
            "skip": [1, 1, slow]}  # fmt: skip
    says = ["rank 0 tracks step 1, which rank 1 does not track",
            "its schedule skips that step"]  # fmt: skip
    _every_rank_stops_in_time(tmp_path, case, says)


def _every_rank_stops_in_time(tmp_path, case, says) -> None:
    """Both ranks of ``case`` raise a DistributedError saying each of ``says``,
    well within cockpit's 60 s timeout."""
    start = time.monotonic()
    results = fsdp.launch(fsdp.histories, 2, tmp_path, limit=90, cases=[case])
    assert time.monotonic() - start < 40, "waited for cockpit's 60 s timeout"
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
        (outcome,) = result["cases"]
        error = outcome.get("error", "")
        assert error.startswith("DistributedError"), (result["rank"], outcome)
        for text in says:
            assert text in error, error


def test_a_parameter_the_backward_pass_never_reaches_joins_after_it(tmp_path):
    """A Linear layer the forward pass never uses: its unit (the root's) is sent
    with zeros for it, the zero results it is shown after the backward pass are
    late on every process, and only its two parameters go in the next round of
    the bucket; the values equal one process's (which shows it the same zeros)."""
    case = {"model": "transformer", "wrap": "units", "reshard": True,
            "spare": True, "extras": ["MeanGSNR"]}  # fmt: skip
    with pytest.warns(CockpitWarning, match="'spare.weight'.*received no gradient"):
        want = _as_json(fsdp.train(case, None, 2).history.to_dict())
    for result in _watched(tmp_path, case, want):
        late = [
            s for s, _, _, what, _ in result["scattered"] if what == "the step's sums"
        ]
        spare = result["sizes"][-2:]  # (the weight, 3 x 2, and the bias, 3)
        # each process's rows of both, padded to the larger process's: 2 and 2
        assert late == [2 * (2 * 2 + 2)] * 2 and spare == [6, 3], (late, spare)


def test_joining_the_shards_stays_on_the_parameters_device(tmp_path):
    """The vector the shards are joined in is made on the parameters' device, and
    each shard is copied into it there: during a tracked step (economy, Adam, whose
    state is joined too) cockpit's code creates no tensor on the default device and
    copies nothing of the join to the host; on a GPU each would be a host tensor
    and a copy per shard. Before: 2 vectors made without a device and 16 shards
    copied to the host (``.to("cpu")``), per rank."""
    case = {"model": "mlp", "wrap": "units", "reshard": True, "optimizer": "adam"}
    results = fsdp.launch(fsdp.host_traffic, 2, tmp_path, case=case)
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
        assert result["created"] == {}, result["created"]
        joined = [where for where in result["synced"] if "distributed/" in where]
        # one number: whether a process formed an elementwise sum (MeanGSNR's)
        # after its unit was sent in the backward pass, which adds a round
        assert [w.split(" at ")[1].split(":")[0] for w in joined] == [
            "distributed/unit_sums.py"
        ], result["synced"]
        assert result["synced"][joined[0]] == 1, result["synced"]
        # what is left: the step's two health checks (as in one process) and the
        # replayed Adam step reading its step counter, a host tensor in torch.optim
        assert "step/checks.py" in " ".join(result["synced"]), result["synced"]


def test_each_rank_keeps_its_rows_of_the_lanczos_vectors(tmp_path):
    """HessMaxEV on FSDP2: each rank holds only its rows of the eigensolver's
    vectors (the Lanczos basis, the warm start kept between steps); put together
    they are the one process's warm start (unit vectors, to rounding)."""
    case = {"model": "mlp", "wrap": "units", "reshard": True, "configuration": "full"}
    want = fsdp.train(case, None, 2)
    (solver,) = [q for q in want.quantities if q.key == "HessMaxEV"]
    whole = solver._previous.double()
    results = fsdp.launch(fsdp.warm_start, 2, tmp_path, case=case)
    joined = torch.zeros_like(whole)
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
        assert result["dim"] == whole.numel()
        held = sum(b - a for a, b in result["ranges"])
        assert len(result["piece"]) == held < whole.numel()
        piece = torch.tensor(result["piece"], dtype=torch.float64)
        position = 0
        for a, b in result["ranges"]:
            joined[a:b] += piece[position : position + b - a]
            position += b - a
    assert float((joined - whole).abs().max()) < 1e-6, (joined, whole)


@expected.TIC_WITHOUT_EXACT_DIAGONAL
def test_the_monte_carlo_ggn_agrees_within_its_standard_errors(tmp_path):
    """24 rows of 3 classes: the GGN's exact diagonal would take 72 > 64 backward
    passes, so HessTrace is the Monte-Carlo estimate, as in one process on the
    joined batch, but not the same draws (each rank draws its rows' labels): within
    4 standard errors of the difference, every other value to 1e-8, the ranks
    alike. TICDiag, exact only, is missing in both."""
    case = {"model": "mlp", "wrap": "units", "reshard": True, "batch": 12,
            "configuration": "business", "steps": 3}  # fmt: skip
    want = _as_json(fsdp.train(case, None, 2).history.to_dict())
    histories = _rank_histories(case, tmp_path)
    for history in [want, *histories]:
        for step in history.values():
            missing = step.pop("missing", {})
            assert set(missing) == {"TICDiag"}, step
            assert "track TICTrace" in missing["TICDiag"], missing
            assert "Fix: ," not in missing["TICDiag"], missing
            assert step["HessTrace_estimate"]["method"] == "ggn_monte_carlo"
    problems: list[str] = []
    _compare(histories[0], histories[1], "rank 1", problems)
    drawn = ("HessTrace", "HessTrace_estimate")
    deviations = []
    for step, values in want.items():
        got = histories[0][step]
        errors = [values["HessTrace_estimate"], got["HessTrace_estimate"]]
        for i, (x, y) in enumerate(zip(values["HessTrace"], got["HessTrace"])):
            se = math.hypot(errors[0]["stderr"][i], errors[1]["stderr"][i])
            assert abs(x - y) <= 4 * se, (step, i, x, y, se)
            deviations.append(abs(x - y) / se)
        rest = {k: v for k, v in values.items() if k not in drawn}
        _compare(rest, {k: got[k] for k in rest}, f"step {step}", problems)
    assert not problems, problems[:10]
    assert len(deviations) == 3 * 4 and max(deviations) > 0  # not the same draws


def test_an_optimizer_that_cannot_be_rebuilt_leaves_its_readers_out(tmp_path):
    """An optimizer whose class cannot be made from its parameter groups (a
    constructor argument its ``defaults`` lack): Alpha, which reads the learning
    rates from a copy over the full parameters, is missing with the reason and
    the fix on every rank; the other values are recorded."""
    case = {"model": "mlp", "wrap": "units", "reshard": True, "optimizer": "needy"}
    for history in _rank_histories(case, tmp_path):
        for step in history.values():
            assert set(step["missing"]) == {"Alpha"}, step["missing"]
            reason = step["missing"]["Alpha"]
            assert "could not make a Needy over copies of the parameters" in reason
            assert "missing 1 required positional argument: 'token'" in reason
            assert "Fix:" in reason
            assert {"GradNorm", "Variance", "InnerTest"} <= set(step)


def test_mixed_precision_records_every_value_alike_on_every_rank(tmp_path):
    """FSDP2's ``MixedPrecisionPolicy`` (bfloat16 forward and backward, float32
    reduction): the full configuration, second derivatives through bfloat16 units
    included, records every value on every rank, finite, the ranks alike (no
    float64 reference: bfloat16 numbers are not one process's float64 ones)."""
    case = {"model": "mlp", "wrap": "units", "reshard": True, "configuration": "full",
            "mixed": True}  # fmt: skip
    histories = _rank_histories(case, tmp_path)
    recorded = {key for step in histories[0].values() for key in step}
    assert {"HessMaxEV", "HessTrace", "TICDiag", "Alpha", "GradNorm"} <= recorded
    for step in histories[0].values():
        assert "missing" not in step, step["missing"]
        for key in ("HessMaxEV", "HessTrace", "GradNorm", "Variance", "Loss"):
            values = step[key] if isinstance(step[key], list) else [step[key]]
            assert all(math.isfinite(v) for v in values), (key, values)
    problems: list[str] = []
    _compare(histories[0], histories[1], "rank 1", problems)
    assert not problems, problems[:10]


def test_a_resumed_run_keeps_each_ranks_warm_start(tmp_path):
    """Each process saves its state after step 0 and a new Cockpit goes on from
    it: every value equals the uninterrupted one process's (HessMaxEV's warm start
    is each rank's piece, kept with the rows it holds). Loading rank 0's state on
    every rank (the pieces differ: 32 and 25 numbers) neither hangs nor mixes
    pieces: all ranks start cold alike and agree, HessMaxEV within Lanczos'
    tolerance of the warm-started one. What is kept as each rank's rows across
    steps (Distance's first parameters, UpdateSize's and Alpha's start) is then
    another rank's on rank 1: recorded missing on every rank, with the fix."""
    case = {"model": "mlp", "wrap": "units", "reshard": True, "configuration": "full"}
    want = _as_json(fsdp.train(case, None, 2).history.to_dict())
    cases = [
        dict(case, resume={"path": str(tmp_path), "source": s}) for s in ("own", 0)
    ]
    results = fsdp.launch(fsdp.histories, 2, tmp_path, limit=120, cases=cases)
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
        own, first = (c.get("history", c) for c in result["cases"])
        problems: list[str] = []
        _compare(want, own, f"own state, rank {result['rank']}", problems)
        assert not problems, problems[:10]
        assert "error" not in first, first.get("traceback", first["error"])
        got = first["1"]["HessMaxEV"]
        assert got == results[0]["cases"][1]["history"]["1"]["HessMaxEV"]
        assert math.isclose(got, want["1"]["HessMaxEV"], rel_tol=2e-3), got
        missing = {step: first[step].get("missing", {}) for step in first}
        assert {s: sorted(m) for s, m in missing.items()} == {
            "0": ["Alpha", "UpdateSize"],
            "1": ["Distance"],
        }, missing
        for reasons in missing.values():
            for reason in reasons.values():
                assert "another process's rows" in reason, reason
                assert "save and load its own cockpit state" in reason, reason


def test_alpha_started_on_rows_and_ended_on_full_tensors_says_why(tmp_path):
    """Alpha starts on each process's rows (SGD's step) and the next step's
    optimizer is a subclass of SGD, replayed only on the full tensors: the value
    is missing on every rank with that cause and the fix (not the reason for
    another process's state), and every other value equals one process's."""
    case = {"model": "mlp", "wrap": "units", "reshard": True, "switch": True}
    want = _as_json(fsdp.train(case, None, 2).history.to_dict())
    assert "Alpha" in want["0"], want["0"]
    results = fsdp.launch(fsdp.histories, 2, tmp_path, cases=[case])
    for result in results:
        (got,) = (c.get("history", c) for c in result["cases"])
        assert "error" not in got, got.get("traceback", got["error"])
        missing = {step: got[step].get("missing", {}) for step in got}
        assert {s: sorted(m) for s, m in missing.items() if m} == {"0": ["Alpha"]}
        reason = missing["0"]["Alpha"]
        assert "the optimizer is a OwnSGD" in reason, reason
        assert "replays only on the full tensors" in reason, reason
        assert "another process's rows" not in reason, reason
        problems: list[str] = []
        expected = {step: dict(values) for step, values in want.items()}
        expected["0"].pop("Alpha")
        _compare(expected, got, f"rank {result['rank']}", problems)
        assert not problems, problems[:10]


def test_the_shards_are_joined_exactly_in_the_parameters_dtype(tmp_path):
    """float32 shards travel as float32 (half the bytes of float64), bfloat16 ones
    as float32; each element is one process's value plus zeros, so the joined
    parameters and gradients are ``full_tensor()``'s bit for bit."""
    results = fsdp.launch(fsdp.joined_exactly, 2, tmp_path)
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
        for dtype, sent in (("torch.float32", "torch.float32"),
                            ("torch.bfloat16", "torch.float32")):  # fmt: skip
            assert result[dtype]["sent"] == [sent, sent], result[dtype]
            assert result[dtype]["equal"] == [True] * 8, result[dtype]


LAYOUTS = {
    "tensor-parallel": "that fully_shard does not manage (tensor parallelism",
    "shard-dim-1": "placements (S(1)) on a device mesh of shape (2,): only shards "
    "along dimension 0",
    "hsdp": "placements (R, S(0)) on a device mesh of shape (1, 2): a mesh of 2 "
    "dimensions",
    "mixed": "it is a plain tensor while '0.weight'",
    "no-group": "no data-parallel group to join their shards over",
}


def test_layouts_cockpit_cannot_serve_are_refused_on_every_rank(tmp_path):
    layouts = list(LAYOUTS)
    results = fsdp.launch(fsdp.refusals, 2, tmp_path, limit=120, layouts=layouts)
    for result in results:
        assert "error" not in result, result.get("traceback", result["error"])
        for layout, raised in zip(layouts, result["raised"]):
            assert raised is not None, layout
            assert raised.startswith("ValueError: cockpit cannot serve"), raised
            assert LAYOUTS[layout] in raised, raised
            assert (
                "Fix: wrap the model with torch.distributed.fsdp.fully_shard" in raised
            )
