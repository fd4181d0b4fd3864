"""GradHist1d, GradHist2d and the bin-adaptation policies against numpy twins.

The twins clamp brute-force float64 per-sample gradients exactly as documented and
count them with ``numpy.histogram`` / ``numpy.histogram2d``; the counts must agree
exactly (integers), the edges bit for bit.
"""

import json
import math

import numpy as np
import pytest
import torch
from backpack import CTX
from backpack.extensions import BatchGrad

from cockpit import Cockpit
from cockpit import quantities as Q
from cockpit.param_view import ParamResults, ParamView
from cockpit.per_sample import FactoredLinearGradients, LinearFactors
from cockpit.quantities import histogram_kernels as kernels
from cockpit.quantities.bin_adaptation import GradAbsMax, NoAdaptation, ParamAbsMax
from cockpit.quantities.histogram_kernels import (
    bin_index,
    histogram_1d,
    histogram_2d,
    histogram_edges,
)
from cockpit.utils.schedules import linear
from tests.utils import brute_force as bf
from tests.utils import expected_warnings as expected
from tests.utils.harness import run
from tests.utils.problems import (
    make_problem,
    tracked_steps,
)

pytestmark = [expected.MISSCALED_LOOKALIKE]

STEPS = 5


# --- numpy twins ----------------------------------------------------------------------
def per_sample_gradients(problem, record):
    """Brute-force ``g_i`` per parameter as numpy arrays ``[N, D_p]``."""
    grads = bf.individual_gradients(problem, record.params, record.x, record.y)
    return [g.flatten(1).numpy() for g in grads]


def np_hist_1d(values, bins, lo, hi):
    counts, edges = np.histogram(np.clip(values, lo, hi), bins=bins, range=(lo, hi))
    return counts.tolist(), edges.tolist()


def inner_clamp(values, bins, lo, hi):
    half = (hi - lo) / bins / 2
    return np.clip(values, lo + half, hi - half)


def np_hist_2d(grads, params, bins, ranges):
    """2-D twin: ``grads`` list of [N, D_p], ``params`` list of [D_p]."""
    x = np.concatenate([g.reshape(-1) for g in grads])
    y = np.concatenate(
        [np.broadcast_to(p, g.shape).reshape(-1) for g, p in zip(grads, params)]
    )
    x = inner_clamp(x, bins[0], *ranges[0])
    y = inner_clamp(y, bins[1], *ranges[1])
    counts, xedges, yedges = np.histogram2d(x, y, bins=bins, range=ranges)
    return counts.astype(np.int64).tolist(), [xedges.tolist(), yedges.tolist()]


def assert_int_counts(hist):
    flat = np.asarray(hist).reshape(-1).tolist()
    assert all(type(c) is int for c in flat), "counts must be stored as ints"


# --- pure binning ---------------------------------------------------------------------
def edge_probes(edges, gen, scale, n=20_000):
    """Random values plus values on, one ulp below and one ulp above every edge."""
    return torch.cat(
        [
            torch.randn(n, generator=gen, dtype=edges.dtype) * scale,
            edges,
            torch.nextafter(edges, edges - 1),
            torch.nextafter(edges, edges + 1),
            torch.tensor([math.inf, -math.inf, 0.0, -0.0], dtype=edges.dtype),
        ]
    )


RANGES_1D = [
    (100, -2.0, 2.0),
    (7, -0.1, 0.1),
    (3, -1e-3, 5.0),
    (1, -1.0, 1.0),
    (5, 1000.0, 1000.5),  # narrow bins far from 0: rounding dominates
]


@pytest.mark.parametrize("bins,lo,hi", RANGES_1D)
def test_histogram_1d_matches_numpy_on_edges_and_outliers(bins, lo, hi):
    edges = histogram_edges(lo, hi, bins)
    np_edges = np.histogram_bin_edges(np.zeros(1), bins=bins, range=(lo, hi))
    assert np.array_equal(edges.numpy(), np_edges)
    values = edge_probes(edges, torch.Generator().manual_seed(0), hi - lo)
    values[: values.numel() // 2] += (lo + hi) / 2
    counts = histogram_1d(values, edges, (lo, hi))
    expected, _ = np_hist_1d(values.numpy(), bins, lo, hi)
    assert counts.tolist() == expected
    assert counts[-1] > 0 and counts[0] > 0  # clamped outliers and `hi` counted
    with_nan = torch.cat([values, torch.full((5,), math.nan, dtype=torch.float64)])
    assert histogram_1d(with_nan, edges, (lo, hi)).tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bins,lo,hi", RANGES_1D)
def test_bin_index_paths_agree_and_follow_the_edges(bins, lo, hi, dtype):
    """The CPU path (re-check near edges) equals the all-values path (GPU default)."""
    edges = histogram_edges(lo, hi, bins).to(dtype)
    values = edge_probes(edges, torch.Generator().manual_seed(2), hi - lo)
    values[: values.numel() // 2] += (lo + hi) / 2
    values = torch.cat([values, torch.full((3,), math.nan, dtype=dtype)])
    fast = bin_index(values, edges, (lo, hi), correct_all=False)
    full = bin_index(values, edges, (lo, hi), correct_all=True)
    assert torch.equal(fast, full)
    nan = torch.isnan(values)
    assert (fast[nan] == bins).all() and (fast[~nan] < bins).all()
    v = values[~nan].clamp(edges[0], edges[-1])
    k = fast[~nan]
    last = k == bins - 1
    assert (edges[k] <= v).all()
    assert ((v < edges[k + 1]) | (last & (v == edges[-1]))).all()


@pytest.mark.parametrize("clamp", [None, "at-zero"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "bins,lo,hi",
    [(100, -2.0, 2.0), (4, -1.0, 1.0), (7, -0.1, 0.1)],  # 7: 0 is no edge (control)
)
def test_many_exact_zeros_share_one_bin_without_re_checking_every_value(
    bins, lo, hi, dtype, clamp, monkeypatch
):
    """An embedding's per-sample gradients are mostly exact zeros (and -0.0): on a
    symmetric range with an even number of bins they sit on the edge at 0. They get
    the bin of 0 found once; the other values near edges are still re-checked. A
    clamp at 0 turns every negative value into a zero."""
    clamp = None if clamp is None else (0.0, hi)
    edges = histogram_edges(lo, hi, bins).to(dtype)
    probes = edge_probes(edges, torch.Generator().manual_seed(6), hi - lo, n=100)
    zeros = torch.zeros(4000, dtype=dtype)
    zeros[:200] = -0.0
    nan = torch.full((3,), math.nan, dtype=dtype)
    values = torch.cat([probes, zeros, nan])
    values = values[torch.randperm(values.numel())]
    sizes = []
    original = kernels._correct

    def correct(v, index, edges):
        sizes.append(v.numel())
        return original(v, index, edges)

    monkeypatch.setattr(kernels, "_correct", correct)
    fast = bin_index(values, edges, (lo, hi), clamp, correct_all=False)
    assert sizes and max(sizes) < values.numel() // 8  # no re-check of every value
    full = bin_index(values, edges, (lo, hi), clamp, correct_all=True)
    assert torch.equal(fast, full)
    counts = torch.bincount(fast.long(), minlength=bins + 1)[:bins]
    finite = values[~torch.isnan(values)]
    if clamp is not None:
        finite = finite.clamp(*clamp)
    expected, _ = np_hist_1d(finite.numpy(), bins, lo, hi)
    assert counts.tolist() == expected
    # a transposed (non-contiguous) block is binned like its contiguous copy
    square = values[:4096].reshape(64, 64)
    assert torch.equal(
        bin_index(square.T, edges, (lo, hi), clamp, correct_all=False),
        bin_index(square.T.contiguous(), edges, (lo, hi), clamp, correct_all=False),
    )


@pytest.mark.parametrize("correct_all", [False, True])
@pytest.mark.parametrize(
    "dtype,bins,lo,hi",
    [
        (torch.float16, 4000, -1.0, 1.0),
        (torch.bfloat16, 300, -0.5, 0.5),
        (torch.bfloat16, 1000, -1.0, 1.0),  # bins narrower than bfloat16's ulps
    ],
)
def test_half_precision_values_get_exactly_the_bins_of_their_edges(
    dtype, bins, lo, hi, correct_all
):
    """In float16/bfloat16 the scaled position can be off by more than one bin (and
    rounded edges can coincide): the bin is still the one the rounded edges give,
    ``edges[k] <= v < edges[k + 1]`` (of equal edges the last), last bin closed."""
    edges = histogram_edges(lo, hi, bins).to(dtype)
    values = edge_probes(edges, torch.Generator().manual_seed(7), hi - lo, n=5000)
    values = torch.cat([values.to(dtype), torch.full((3,), math.nan, dtype=dtype)])
    index = bin_index(values, edges, (lo, hi), correct_all=correct_all)
    e = edges.double().numpy()
    v = values.double().clamp(lo, hi).numpy()
    want = np.clip(np.searchsorted(e, v, side="right") - 1, 0, bins - 1)
    want[np.isnan(v)] = bins
    assert index.long().tolist() == want.tolist()


@pytest.mark.parametrize(
    "bins,ranges",
    [((40, 50), ((-1.0, 1.0), (-2.0, 2.0))), ((3, 4), ((-0.1, 0.2), (-1.0, 1.0)))],
)
def test_histogram_2d_matches_numpy_on_edges_and_outliers(bins, ranges):
    gen = torch.Generator().manual_seed(1)
    xedges, yedges = (histogram_edges(*r, b) for r, b in zip(ranges, bins))
    x = torch.randn(6, 500, generator=gen, dtype=torch.float64)
    y = 2 * torch.randn(500, generator=gen, dtype=torch.float64)
    x[0, : bins[0] + 1] = xedges  # values exactly on edges
    y[: bins[1] + 1] = yedges
    half = [(r[1] - r[0]) / b / 2 for r, b in zip(ranges, bins)]
    clamps = tuple((r[0] + h, r[1] - h) for r, h in zip(ranges, half))
    counts = histogram_2d(x, y, xedges, yedges, ranges, clamps)
    expected, _ = np_hist_2d([x.numpy()], [y.numpy()], bins, ranges)
    assert counts.tolist() == expected
    x[1, 0] = math.nan
    with_nan = histogram_2d(x, y, xedges, yedges, ranges, clamps)
    assert counts.sum() - with_nan.sum() == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("first,span", [(0, 1), (37, 3), (95, 5), (50, 2)])
def test_concentrated_values_take_the_comparison_path_and_stay_exact(
    dtype, first, span
):
    """Values within a few bins are counted by comparisons; still exact at edges."""
    bins, lo, hi = 100, -2.0, 2.0
    edges = histogram_edges(lo, hi, bins).to(dtype)
    inner = edges[first : first + span]  # edges inside the occupied bins
    gen = torch.Generator().manual_seed(first)
    width = float(edges[first + span] - edges[first])
    values = torch.cat(
        [
            edges[first] + width * torch.rand(5000, generator=gen, dtype=dtype),
            inner,
            torch.nextafter(inner[1:], inner[1:] - 1),
            torch.nextafter(inner, inner + 1),
        ]
    )
    values = values.clamp(max=edges[first + span])
    top = min(first + span, bins - 1)  # a value clamped onto the next edge: its bin
    k_lo, k_hi = kernels._span(values, edges, (lo, hi), None)  # the comparison path
    assert k_lo == first and first + span - 1 <= k_hi <= top, (k_lo, k_hi)
    counts = histogram_1d(values, edges, (lo, hi))
    expected, _ = np_hist_1d(values.numpy(), bins, lo, hi)
    assert counts.tolist() == expected
    # 2-D: x concentrated as above, y spread over its range
    xedges, yedges = edges, histogram_edges(-2.0, 2.0, 50).to(dtype)
    clamps = ((lo + 0.02, hi - 0.02), (-2.0 + 0.04, 2.0 - 0.04))
    x = values[: 4 * 1000].reshape(4, 1000)
    y = 3 * torch.randn(1000, generator=gen, dtype=dtype)
    k_lo, k_hi = kernels._span(x, xedges, (lo, hi), clamps[0])
    assert first <= k_lo <= k_hi <= top, (k_lo, k_hi)
    got = histogram_2d(x, y, xedges, yedges, ((lo, hi), (-2.0, 2.0)), clamps)
    want, _ = np_hist_2d([x.numpy()], [y.numpy()], (100, 50), ((lo, hi), (-2, 2)))
    assert got.tolist() == want


# --- the outer-product path (Linear weights) ------------------------------------------
def outer_case(dtype, seed, n=9, out=11, dim=40, scale=8.0, spread=0.05):
    """Factors with zeros, ties, both signs, and products landing exactly on edges."""
    gen = torch.Generator().manual_seed(seed)
    delta = torch.randn(n, out, generator=gen, dtype=dtype) * spread
    delta[:, 0] = 0.0
    delta[:, 1] = 2.0**-6  # exact products: inputs on edges give values on edges
    delta[:, 2] = -(2.0**-6)
    inputs = torch.randn(n, dim, generator=gen, dtype=dtype)
    inputs[:, : dim // 8] = 0.0
    inputs[:, dim // 8 : dim // 4] = inputs[:, dim // 4 : 3 * dim // 8]  # ties
    return delta, inputs, scale


def materialized_counts(delta, inputs, scale, edges, limits):
    factors = LinearFactors(inputs, delta)
    return histogram_1d(factors.materialize(scale=scale), edges, limits)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bins,lo,hi", RANGES_1D)
@pytest.mark.parametrize("seed", [0, 1])
def test_outer_product_counts_equal_the_materialised_ones(dtype, bins, lo, hi, seed):
    edges = histogram_edges(lo, hi, bins).to(dtype)
    spread = (hi - lo) / 4 + abs(lo + hi) / 2
    delta, inputs, scale = outer_case(dtype, seed, spread=spread)
    # inputs that put (delta * x) * scale exactly on every edge for delta = 2**-6
    on_edges = (edges / scale * 2.0**6)[: inputs.shape[1] // 2]
    inputs[0, : on_edges.numel()] = on_edges
    inputs[1, : on_edges.numel()] = -on_edges
    for force in (True, False):
        got = kernels.histogram_1d_outer(
            delta, inputs, scale, edges, (lo, hi), force=force
        )
        if got is not None:
            want = materialized_counts(delta, inputs, scale, edges, (lo, hi))
            assert got.tolist() == want.tolist()
            assert int(got.sum()) == delta.numel() * inputs.shape[1]


@pytest.mark.parametrize("dim", [1, 2, 3, 16, 17])
@pytest.mark.parametrize("scale", [1.0, 6.0, 128.0])
def test_outer_product_counts_for_any_row_length_and_scale(dim, scale):
    edges = histogram_edges(-0.3, 0.2, 13)
    delta, inputs, _ = outer_case(torch.float64, dim, dim=dim, spread=0.1)
    got = kernels.histogram_1d_outer(
        delta, inputs, scale, edges, (-0.3, 0.2), force=True
    )
    want = materialized_counts(delta, inputs, scale, edges, (-0.3, 0.2))
    assert got.tolist() == want.tolist()


def test_outer_product_path_declines_non_finite_factors():
    edges = histogram_edges(-2.0, 2.0, 10)
    delta, inputs, scale = outer_case(torch.float64, 3)
    inputs[2, 5] = math.inf  # inf * 0 would be NaN
    assert kernels.histogram_1d_outer(delta, inputs, scale, edges, (-2, 2)) is None
    empty = kernels.histogram_1d_outer(
        delta[:, :0], inputs, scale, edges, (-2, 2), force=True
    )
    assert empty.tolist() == [0] * 10


def test_grad_hist_1d_through_the_outer_product_path(problem, monkeypatch):
    """Forced onto every Linear weight, the counts still equal the numpy twin."""
    monkeypatch.setattr(kernels, "OUTER_COST_FRACTION", math.inf)
    taken = [0]
    original = kernels.histogram_1d_outer

    def counting(*args, **kwargs):
        result = original(*args, **kwargs)
        taken[0] += result is not None
        return result

    monkeypatch.setattr(kernels, "histogram_1d_outer", counting)
    kwargs = {"bins": 7, "range": (-0.05, 0.05)}
    result = run(problem, [Q.GradHist1d(linear(1), **kwargs)], steps=2)
    linear_weights = sum(
        isinstance(m, torch.nn.Linear) for m in problem.model.modules()
    )
    assert taken[0] == 2 * linear_weights > 0
    for step in range(2):
        grads = per_sample_gradients(problem, result.records[step])
        values = np.concatenate([g.reshape(-1) for g in grads])
        counts, _ = np_hist_1d(values, 7, -0.05, 0.05)
        assert result.output[step]["GradHist1d"]["hist"] == counts


def factored_view(delta, inputs, param):
    individual = FactoredLinearGradients(LinearFactors(inputs, delta))
    return ParamView(param, 0, ParamResults(individual=individual))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "case",
    ["around-zero", "spread", "underflow", "non-finite", "nan-weight", "no-zero-edge"],
)
def test_grad_hist_2d_from_linear_factors_equals_numpy(dtype, case, monkeypatch):
    """Rows in one x-bin, straddling the edge at 0, or wider: all exact."""
    taken = []
    original = kernels._may_round_to_zero

    def recording(*args):
        result = original(*args)
        taken.append(not result)
        return result

    monkeypatch.setattr(kernels, "_may_round_to_zero", recording)
    gen = torch.Generator().manual_seed(7)
    n, out, dim = 12, 9, 30
    delta = torch.randn(n, out, generator=gen, dtype=dtype) * 1e-3
    inputs = torch.randn(n, dim, generator=gen, dtype=dtype)
    inputs[:, :4] = 0.0
    delta[0] = delta[0].abs()  # all values >= 0: one x-bin
    delta[1] = 0.0
    delta[2] *= 500  # spans several bins
    if case == "spread":
        delta *= 100
    if case == "underflow":  # a product that rounds to zero: the path declines
        delta[3] *= 0.1  # keeps sample 3 in the two bins around 0
        delta[3, 0] = torch.finfo(dtype).tiny
        inputs[3, 5] = 1e-30
    if case == "non-finite":
        inputs[4, 6] = math.inf
    param = torch.randn(out, dim, generator=gen, dtype=dtype)
    ranges = ((-1.0, 1.0), (-2.0, 2.0))
    if case == "nan-weight":
        param[2, 3] = math.nan
    if case == "no-zero-edge":
        ranges = ((-0.93, 1.07), (-2.0, 2.0))
    quantity = Q.GradHist2d(linear(1), range=ranges)
    quantity.begin_step(0)
    got = quantity._count(0, factored_view(delta, inputs, param))
    grads = LinearFactors(inputs, delta).materialize(scale=n).reshape(n, -1)
    want, _ = np_hist_2d([grads.numpy()], [param.reshape(-1).numpy()], (40, 50), ranges)
    assert got.reshape(40, 50).tolist() == want
    # the sign-counting path ran where it is exact, and only there
    if case in ("around-zero", "nan-weight"):
        assert taken == [True]
    if case in ("underflow", "no-zero-edge", "non-finite"):
        assert True not in taken


# --- GradHist1d -----------------------------------------------------------------------
HIST_1D_SETTINGS = {
    "default": {},
    "narrow-clamped": {"bins": 7, "range": (-0.05, 0.05)},
}


@pytest.mark.parametrize("setting", list(HIST_1D_SETTINGS))
def test_grad_hist_1d(problem, schedule, setting):
    kwargs = HIST_1D_SETTINGS[setting]
    bins, (lo, hi) = kwargs.get("bins", 100), kwargs.get("range", (-2, 2))
    result = run(problem, [Q.GradHist1d(schedule, **kwargs)], steps=STEPS)
    assert sorted(result.output) == tracked_steps(schedule, STEPS)
    for step in tracked_steps(schedule, STEPS):
        value = result.output[step]["GradHist1d"]
        assert set(value) == {"hist", "edges"}
        grads = per_sample_gradients(problem, result.records[step])
        values = np.concatenate([g.reshape(-1) for g in grads])
        counts, edges = np_hist_1d(values, bins, lo, hi)
        assert value["hist"] == counts, f"step {step}"
        assert value["edges"] == edges
        assert_int_counts(value["hist"])
    if setting == "narrow-clamped":  # the clamp really moved values into edge bins
        last = result.output[tracked_steps(schedule, STEPS)[-1]]["GradHist1d"]["hist"]
        assert last[0] > 0 and last[-1] > 0


# --- GradHist2d -----------------------------------------------------------------------
HIST_2D_SETTINGS = {
    "default": {},
    "small-individual": {
        "bins": (5, 3),
        "range": ((-0.05, 0.05), (-0.5, 0.5)),
        "keep_individual": True,
    },
}


@pytest.mark.parametrize("setting", list(HIST_2D_SETTINGS))
def test_grad_hist_2d(problem, schedule, setting):
    kwargs = HIST_2D_SETTINGS[setting]
    bins = kwargs.get("bins", (40, 50))
    ranges = kwargs.get("range", ((-1, 1), (-2, 2)))
    result = run(problem, [Q.GradHist2d(schedule, **kwargs)], steps=STEPS)
    assert sorted(result.output) == tracked_steps(schedule, STEPS)
    for step in tracked_steps(schedule, STEPS):
        value = result.output[step]["GradHist2d"]
        record = result.records[step]
        grads = per_sample_gradients(problem, record)
        params = [p.reshape(-1).numpy() for p in record.params]
        counts, edges = np_hist_2d(grads, params, bins, ranges)
        assert value["hist"] == counts, f"step {step}"
        assert value["edges"] == edges
        assert_int_counts(value["hist"])
        n_params = len(record.params)
        if kwargs.get("keep_individual"):
            expected_keys = {"hist", "edges", "param_groups"}
            expected_keys |= {f"param_{k}" for k in range(n_params)}
            assert set(value) == expected_keys
            assert value["param_groups"] == n_params
            for k in range(n_params):
                single = np_hist_2d([grads[k]], [params[k]], bins, ranges)
                assert value[f"param_{k}"] == {"hist": single[0], "edges": single[1]}
        else:
            assert set(value) == {"hist", "edges"}


# --- bin adaptation -------------------------------------------------------------------
def abs_max_range(m, padding=0.0, min_size=1e-6):
    r = (1 + padding) * max(min_size / 2, m)
    return (-r, r)


def expected_range(initial, adapt_steps, step, compute):
    """The range in force at ``step``: set after the last adaptation step before it."""
    earlier = [s for s in adapt_steps if s < step]
    return compute(earlier[-1]) if earlier else initial


def test_adaptation_moves_range_after_the_histogram_on_its_own_schedule():
    problem = make_problem("cnn", "ce", "momentum")
    steps = 6
    hist_schedule = linear(2)  # 0, 2, 4
    grad_adapt = GradAbsMax(linear(3), padding=0.1)  # 0, 3: step 3 has no histogram
    param_adapt = ParamAbsMax(linear(1))
    quantities = [
        Q.GradHist1d(linear(1), bins=9, adapt=GradAbsMax(linear(2, offset=1))),
        Q.GradHist2d(hist_schedule, bins=(6, 4), adapt=(grad_adapt, param_adapt)),
    ]
    result = run(problem, quantities, steps=steps)
    grads = {s: per_sample_gradients(problem, result.records[s]) for s in range(steps)}

    def grad_max(s):
        return max(np.abs(g).max() for g in grads[s])

    def param_max(s):
        return max(p.abs().max().item() for p in result.records[s].params)

    assert "GradHist2d" not in result.output.get(3, {})
    for step in range(steps):
        # 1-D: adapted after odd steps, no padding
        lo, hi = expected_range(
            (-2.0, 2.0), [1, 3, 5], step, lambda s: abs_max_range(grad_max(s))
        )
        value = result.output[step]["GradHist1d"]
        np.testing.assert_allclose([value["edges"][0], value["edges"][-1]], [lo, hi])
        values = np.concatenate([g.reshape(-1) for g in grads[step]])
        lo, hi = value["edges"][0], value["edges"][-1]
        assert value["hist"] == np_hist_1d(values, 9, lo, hi)[0]
        if not hist_schedule(step):
            continue
        # 2-D: x adapted after 0 and 3 (padding 0.1), y after every step
        x_range = expected_range(
            (-1.0, 1.0), [0, 3], step, lambda s: abs_max_range(grad_max(s), 0.1)
        )
        y_range = expected_range(
            (-2.0, 2.0), range(steps), step, lambda s: abs_max_range(param_max(s))
        )
        value = result.output[step]["GradHist2d"]
        xedges, yedges = value["edges"]
        np.testing.assert_allclose([xedges[0], xedges[-1]], x_range, rtol=1e-12)
        np.testing.assert_allclose([yedges[0], yedges[-1]], y_range, rtol=1e-12)
        params = [p.reshape(-1).numpy() for p in result.records[step].params]
        ranges = ((xedges[0], xedges[-1]), (yedges[0], yedges[-1]))
        assert value["hist"] == np_hist_2d(grads[step], params, (6, 4), ranges)[0]
    # step 2's x range comes from step 0, step 4's from step 3 (an adapt-only step)
    assert (
        result.output[2]["GradHist2d"]["edges"][0]
        != (result.output[4]["GradHist2d"]["edges"][0])
    )


def test_min_size_no_adaptation_and_state_dict():
    problem = make_problem("mlp", "mse")
    floored = Q.GradHist1d(linear(1), adapt=ParamAbsMax(linear(1), min_size=100.0))
    fixed = Q.GradHist1d(
        linear(1), bins=4, range=(-3, 1), adapt=NoAdaptation(), key="Fixed"
    )
    result = run(problem, [floored, fixed], steps=2)
    assert result.output[1]["GradHist1d"]["edges"][0] == -50.0  # min_size / 2
    assert result.output[1]["Fixed"]["edges"] == [-3.0, -2.0, -1.0, 0.0, 1.0]
    restored = Q.GradHist1d(linear(1))
    restored.load_state_dict(json.loads(json.dumps(floored.state_dict())))
    assert restored.range == floored.range == (-50.0, 50.0)


def test_histograms_share_one_batch_grad_and_free_it():
    problem = make_problem("mlp", "ce")
    quantities = [
        Q.GradHist1d(linear(1), adapt=GradAbsMax(linear(1))),
        Q.GradHist2d(linear(1), adapt=(GradAbsMax(linear(1)), None)),
    ]
    cockpit = Cockpit(problem.params, quantities)
    x, y = problem.make_batch(0)
    loss = problem.loss_fn(problem.model(x), y)
    with cockpit(0, info={"loss": loss}):
        active = list(CTX.get_active_exts())
        loss.backward()
    # one per-sample-gradient extension (BackPACK's BatchGrad or the cockpit's
    # variant of it, both write ``grad_batch``) serves all four consumers
    assert [e.savefield for e in active] == ["grad_batch"]
    assert isinstance(active[0], BatchGrad)
    assert not any(hasattr(p, "grad_batch") for p in problem.params)
    output = cockpit.get_output()[0]
    assert sum(output["GradHist1d"]["hist"]) == x.shape[0] * sum(
        p.numel() for p in problem.params
    )


def test_float32_model_counts_every_value():
    torch.manual_seed(0)
    from backpack import extend

    model = extend(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)))
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    cockpit = Cockpit(
        model.parameters(), [Q.GradHist1d(linear(1)), Q.GradHist2d(linear(1))]
    )
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    loss = loss_fn(model(x), y)
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    out = cockpit.get_output()[0]
    total = 5 * sum(p.numel() for p in model.parameters())
    assert sum(out["GradHist1d"]["hist"]) == total
    assert sum(map(sum, out["GradHist2d"]["hist"])) == total


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: Q.GradHist1d(linear(1), bins=0), ValueError, "positive int"),
        (lambda: Q.GradHist1d(linear(1), range=(1, 1)), ValueError, "lo < hi"),
        (lambda: Q.GradHist1d(linear(1), range=3), ValueError, r"pair \(lo, hi\)"),
        (lambda: Q.GradHist1d(linear(1), adapt=GradAbsMax), TypeError, "instantiate"),
        (lambda: Q.GradHist2d(linear(1), bins=(3,)), ValueError, "pair"),
        (lambda: Q.GradHist2d(linear(1), adapt=(None, 1)), TypeError, "adapt"),
        (lambda: GradAbsMax(linear(1), padding=-1), ValueError, "padding"),
        (lambda: ParamAbsMax(linear(1), min_size=0), ValueError, "min_size"),
        (lambda: GradAbsMax(3), TypeError, "callable"),
    ],
)
def test_invalid_arguments_are_explained(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bins,lo,hi", RANGES_1D)
def test_small_blocks_are_counted_by_searching_the_edges(bins, lo, hi, dtype):
    """Up to SEARCH_AT_MOST values: torch.bucketize, exact on and next to every edge,
    outliers clamped, NaN dropped; equal to numpy and to the general path."""
    edges = histogram_edges(lo, hi, bins).to(dtype)
    values = edge_probes(edges, torch.Generator().manual_seed(4), hi - lo, n=300)
    values[:150] += (lo + hi) / 2
    values = torch.cat([values, torch.full((3,), math.nan, dtype=dtype)])
    assert values.numel() <= kernels.SEARCH_AT_MOST
    searched = []
    original = torch.bucketize

    def bucketize(*args, **kwargs):
        searched.append(True)
        return original(*args, **kwargs)

    torch.bucketize = bucketize
    try:
        counts = histogram_1d(values, edges, (lo, hi))
    finally:
        torch.bucketize = original
    assert searched, "the small block did not take the search path"
    expected, _ = np_hist_1d(values[~torch.isnan(values)].numpy(), bins, lo, hi)
    assert counts.tolist() == expected
    index = bin_index(values, edges, (lo, hi), correct_all=True)
    general = torch.bincount(index.reshape(-1).long(), minlength=bins + 1)[:bins]
    assert torch.equal(counts, general)


def test_an_adaptive_range_copies_one_number_per_device_to_the_host():
    """GradAbsMax and ParamAbsMax reduce each parameter to a scalar on its device;
    the range reads their maximum with one copy to the host per device, however
    many parameters there are (before: one copy per parameter)."""
    from cockpit.quantities.bin_adaptation import _max_of
    from tests.utils.syncs import SyncCounter

    values = [torch.tensor(v, dtype=torch.float32) for v in (0.5, 3.0, 2.0, 1.0, 0.25)]
    with SyncCounter() as counter:
        assert _max_of(values) == 3.0
    assert counter.total == 2, counter.places  # the one device's maximum, its float
    assert math.isnan(_max_of([torch.tensor(1.0), torch.tensor(float("nan"))]))
    assert _max_of([]) == 0.0
