"""Observers: hand-computed results, batching invariance, merging, degenerate data, bounded state, registry."""
import math

import numpy as np
import pytest

from oq.errors import OqError
from oq.observers import (EMAObserver, EntropyObserver, HistogramObserver, MinMaxObserver, MSEObserver, Observer,
                          PercentileObserver, kl_divergences, make_observer, observer_names, register_observer)
from oq.spec import QuantSpec, qparams_from_range

BUILTIN = ["minmax", "ema", "percentile", "entropy", "mse"]
INVARIANT = ["minmax", "percentile", "entropy", "mse"]  # everything but ema is batching-invariant by contract
HISTOGRAM = ["percentile", "entropy", "mse"]


def observed(name, *batches, **kwargs):
    obs = make_observer(name, **kwargs)
    for b in batches:
        obs.update(np.asarray(b))
    return obs


def samples(n=64, shape=(8, 16), seed=0):
    """Heavy-tailed samples whose scale grows over the stream, so the histogram grid re-bins several times."""
    rng = np.random.default_rng(seed)
    out = rng.standard_t(3, size=(n, *shape)) * np.exp2(np.arange(n) / 8.0)[:, None, None]
    out[n // 2, 0, 0] = -300.0  # a lone outlier mid-stream
    return out.astype(np.float32)


# -- per observer, against hand-computed results -----------------------------------------------------------------

def test_registry_lists_builtins():
    assert set(BUILTIN) <= set(observer_names())


def test_minmax_exact():
    obs = observed("minmax", [[1.0, -2.5], [0.25, 3.0]], np.array([7.5], np.float32), np.zeros((0, 3)))
    assert obs.range() == (-2.5, 7.5)
    assert obs.count == 5


def test_ema_two_batches_by_hand():
    obs = observed("ema", [-1.0, 0.0, 2.0], [-3.0, 4.0, 1.0])
    lo, hi = obs.range()
    assert lo == pytest.approx(0.9 * -1.0 + 0.1 * -3.0, rel=1e-12)
    assert hi == pytest.approx(0.9 * 2.0 + 0.1 * 4.0, rel=1e-12)
    obs = observed("ema", [-1.0, 2.0], [-3.0, 4.0], momentum=0.5)
    assert obs.range() == pytest.approx((-2.0, 3.0))


def test_ema_merge_is_count_weighted():
    a = observed("ema", np.array([-1.0, 1.0]))  # 2 elements
    b = observed("ema", np.array([-4.0, 0.0, 0.0, 0.0, 0.0, 7.0]))  # 6 elements
    a.merge(b)
    assert a.range() == pytest.approx((0.25 * -1.0 + 0.75 * -4.0, 0.25 * 1.0 + 0.75 * 7.0))
    empty = make_observer("ema")
    a.merge(empty)
    assert a.range() == pytest.approx((-3.25, 5.5))


def test_percentile_matches_numpy_within_a_bin():
    x = np.random.default_rng(1).normal(0.5, 2.0, size=100_000).astype(np.float32)
    ordered = np.sort(x.astype(np.float64))
    for p in (90.0, 99.0, 99.9, 99.99):
        obs = observed("percentile", x[:30_000], x[30_000:], percentile=p)
        lo, hi = obs.range()
        for q, got in ((100 - p, lo), (p, hi)):
            ref = np.percentile(ordered, q)
            if p <= 99.0:  # dense there: within one bin of numpy
                assert abs(got - ref) <= obs.width
            k = int(q / 100 * (x.size - 1))  # sparse tails: between the bracketing order statistics, +- one bin
            assert ordered[k] - obs.width <= got <= ordered[k + 1] + obs.width
    obs = observed("percentile", x, percentile=100)
    assert obs.range() == (float(x.min()), float(x.max()))


def test_percentile_never_beyond_observed():
    x = np.array([1.0, 1.0, 1.0, 2.0], np.float32)
    lo, hi = observed("percentile", x, percentile=99.99).range()
    assert 1.0 <= lo <= hi <= 2.0


def test_mse_clips_laplacian_outliers_but_not_uniform():
    rng = np.random.default_rng(2)
    lap = rng.laplace(0.0, 1.0, size=200_000).astype(np.float32)
    lap[:2] = [25.0, -20.0]  # rare huge outliers (the Laplacian's own max is ~12)
    lo, hi = observed("mse", lap).range()
    assert lo == -hi  # t is below both extremes
    assert 6.0 < hi < 0.6 * 25.0

    uni = rng.uniform(-3.0, 3.0, size=100_000).astype(np.float32)
    lo, hi = observed("mse", uni).range()
    t = max(-lo, hi)
    assert 0.97 * 3.0 <= t <= 3.0 and lo >= float(uni.min()) and hi <= float(uni.max())


def test_mse_sign_modes():
    rng = np.random.default_rng(3)
    relu = np.maximum(rng.normal(size=50_000), 0).astype(np.float32)
    lo, hi = observed("mse", relu).range()
    assert lo == 0.0 and 0.5 * relu.max() < hi <= relu.max()
    lo, hi = observed("mse", relu, symmetric=True).range()
    assert lo == 0.0 and hi > 0  # searched as (-t, t), clipped to the data
    shifted = rng.uniform(-1.0, 3.0, size=50_000).astype(np.float32)
    lo, hi = observed("mse", shifted, symmetric=False).range()
    assert lo / hi == pytest.approx(float(shifted.min()) / float(shifted.max()), rel=1e-9)
    assert 0.97 * 3.0 <= hi <= 3.0


def test_entropy_gaussian_and_uniform():
    rng = np.random.default_rng(4)
    sigma = 1.5
    g = rng.normal(0.0, sigma, size=200_000).astype(np.float32)
    lo, hi = observed("entropy", g).range()
    t = max(-lo, hi)
    assert 2.5 * sigma < t < 5.0 * sigma
    assert lo == max(-t, float(g.min())) and hi == min(t, float(g.max()))  # (-t, t) within the data

    u = rng.uniform(-2.0, 2.0, size=200_000).astype(np.float32)
    lo, hi = observed("entropy", u).range()
    assert 0.97 * 2.0 <= max(-lo, hi) <= float(np.abs(u).max())

    # barely negative data: the threshold is symmetric, but lo stops at the observed min (same qparams for a
    # symmetric spec, no wasted range for an asymmetric one)
    skewed = np.concatenate([rng.exponential(1.0, 100_000), -0.1 * rng.random(100)]).astype(np.float32)
    lo, hi = observed("entropy", skewed).range()
    assert lo == float(skewed.min()) and 3.0 < hi <= float(skewed.max())


def test_entropy_non_negative_data_is_one_sided():
    relu = np.maximum(np.random.default_rng(5).normal(size=100_000), 0).astype(np.float32)
    obs = observed("entropy", relu)
    lo, hi = obs.range()
    assert lo == 0.0 and 2.0 < hi <= relu.max()
    lo128, hi128 = observed("entropy", relu, levels=128).range()
    assert lo128 == 0.0 and hi128 <= hi + obs.width  # fewer levels never loosen the clip much


def _kl_brute_force(habs, levels, eps=1e-4):
    """The TensorRT loop, one candidate at a time (smoothing only where Q = 0 < P, as documented)."""
    h = np.asarray(habs, np.float64)
    h = h[: np.flatnonzero(h)[-1] + 1]
    n, total, out = h.size, h.sum(), []
    for i in range(levels, n + 1):
        sliced = h[:i]
        p = sliced.copy()
        p[-1] += h[i:].sum()
        nonzero = p > 0
        merged = i // levels
        q = np.zeros(i)
        for j in range(levels):
            start, stop = j * merged, (i if j == levels - 1 else (j + 1) * merged)
            norm = nonzero[start:stop].sum()
            if norm:
                q[start:stop] = np.where(nonzero[start:stop], sliced[start:stop].sum() / norm, 0.0)
        if q.sum() == 0:
            out.append(np.inf)
            continue
        q_total = q.sum()
        q = np.where(nonzero & (q == 0), eps, q)
        pn, qn = p[nonzero] / total, q[nonzero] / q_total
        out.append(float(np.sum(pn * np.log(pn / qn))))
    return np.arange(levels, n + 1), np.array(out)


@pytest.mark.parametrize("case", ["gauss", "outliers", "sparse"])
def test_entropy_vectorised_matches_loop(case):
    rng = np.random.default_rng(6)
    x = np.abs(rng.standard_normal(20_000))
    if case == "outliers":
        x[:3] = 40.0
    if case == "sparse":
        x = np.round(x * 3) / 3  # many empty bins
    habs, _ = np.histogram(x, bins=400, range=(0, x.max() * 1.001))
    cand, kl = kl_divergences(habs, 24)
    ref_cand, ref_kl = _kl_brute_force(habs, 24)
    np.testing.assert_array_equal(cand, ref_cand)
    finite = np.isfinite(ref_kl)
    np.testing.assert_array_equal(np.isfinite(kl), finite)
    np.testing.assert_allclose(kl[finite], ref_kl[finite], rtol=1e-9, atol=1e-12)


# -- batching invariance and merging ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", INVARIANT)
def test_batching_invariance(name):
    x = samples()
    one = observed(name, *x)  # 64 batches of one sample
    sixteen = observed(name, *(x[i:i + 16] for i in range(0, 64, 16)))
    reversed_ = observed(name, *x[::-1])
    assert one.range() == sixteen.range() == reversed_.range()
    if isinstance(one, HistogramObserver):
        np.testing.assert_array_equal(one.counts, sixteen.counts)
        assert one.width == sixteen.width


@pytest.mark.parametrize("name", INVARIANT)
def test_merge_equals_observing_everything(name):
    x = samples(seed=8)
    a, b = observed(name, *x[:40]), observed(name, *x[40:])
    a.merge(b)
    whole = observed(name, x)
    assert a.range() == whole.range()
    assert a.count == whole.count == x.size
    if isinstance(a, HistogramObserver):
        np.testing.assert_array_equal(a.counts, whole.counts)
    # merging in the other order, and with empty or all-zero observers, changes nothing either
    b2, a2 = observed(name, *x[40:]), observed(name, *x[:40])
    b2.merge(a2)
    b2.merge(make_observer(name))
    assert b2.range() == whole.range()
    zeros = observed(name, np.zeros(7, np.float32))
    zeros.merge(b2)
    with_zeros = observed(name, x, np.zeros(7, np.float32))
    assert zeros.range() == with_zeros.range()


def test_histogram_kinds_merge_and_minmax_absorbs_histogram():
    x = samples(seed=9)
    ent, pct = observed("entropy", x[:10]), observed("percentile", x[10:])
    ent.merge(pct)
    np.testing.assert_array_equal(ent.counts, observed("entropy", x).counts)
    mm = observed("minmax", x[:10])
    mm.merge(pct)
    assert mm.range() == observed("minmax", x).range()
    with pytest.raises(OqError, match="cannot merge"):
        ent.merge(observed("minmax", x))
    with pytest.raises(OqError, match="cannot merge"):
        observed("ema", x).merge(ent)
    with pytest.raises(OqError, match="bins"):
        ent.merge(observed("percentile", x, bins=1024))


# -- degenerate data -----------------------------------------------------------------------------------------------

SPECS = [QuantSpec(), QuantSpec(dtype="uint8", symmetric=False), QuantSpec(dtype="uint8", symmetric=True)]


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("value", [0.0, -0.0, 3.0, -2.5])
def test_constant_data(name, value):
    obs = observed(name, np.full((4, 5), value, np.float32), np.full(3, value, np.float32))
    lo, hi = obs.range()
    assert math.isfinite(lo) and math.isfinite(hi) and lo <= hi
    assert min(lo, 0.0) <= value <= max(hi, 0.0)  # the constant stays representable
    if value != 0.0:
        assert max(abs(lo), abs(hi)) == abs(value)
    for spec in SPECS:
        scale = float(qparams_from_range(lo, hi, spec).scale)
        assert math.isfinite(scale) and scale > 0


@pytest.mark.parametrize("name", BUILTIN)
def test_no_data(name):
    assert make_observer(name).range() == (0.0, 0.0)


@pytest.mark.parametrize("name", BUILTIN)
def test_tiny_range(name):
    x = (np.random.default_rng(10).normal(size=5000) * 1e-30).astype(np.float32)
    lo, hi = observed(name, x[:1000], x[1000:]).range()
    assert math.isfinite(lo) and math.isfinite(hi)
    amax = float(np.abs(x).max())
    assert lo < -1e-31 and 1e-31 < hi and max(-lo, hi) <= amax * (1 + 1e-6)
    if name == "minmax":
        assert (lo, hi) == (float(x.min()), float(x.max()))
    for spec in SPECS:
        scale = float(qparams_from_range(lo, hi, spec).scale)
        assert math.isfinite(scale) and scale > 0


@pytest.mark.parametrize("name", HISTOGRAM)
def test_float64_extremes(name):
    for scale in (1e-300, 1e300):
        x = np.random.default_rng(11).normal(size=1000) * scale
        lo, hi = observed(name, x).range()
        assert math.isfinite(lo) and math.isfinite(hi) and lo < 0 < hi and hi <= np.abs(x).max()


@pytest.mark.parametrize("name", BUILTIN)
def test_nan_or_inf_poisons_the_range(name):
    for bad in (np.nan, np.inf):
        lo, hi = observed(name, np.ones(4, np.float32), np.array([1.0, bad], np.float32)).range()
        assert not (math.isfinite(lo) and math.isfinite(hi))  # so calibration reports the tensor


def test_zeros_then_data_keeps_the_zeros():
    obs = observed("percentile", np.zeros(900, np.float32), np.linspace(1, 2, 100, dtype=np.float32),
                   percentile=80)
    assert int(obs.counts.sum()) == 1000 == obs.count
    assert obs.counts[obs.half] >= 900  # zeros land in [0, w)
    assert obs.exact_zeros == 900
    assert obs.range() == (0.0, 0.0)  # 80% of the data is exactly zero
    obs.percentile = 95.0
    lo, hi = obs.range()
    assert lo == 0.0 and 1.4 < hi < 1.6


def test_range_growth_rebins_exactly():
    rng = np.random.default_rng(12)
    small = rng.uniform(-1, 1, size=10_000).astype(np.float32)
    big = rng.uniform(-1000, 3000, size=5_000).astype(np.float32)
    obs = observed("percentile", small, big, small, percentile=100)
    assert int(obs.counts.sum()) == obs.count == 25_000
    assert obs.range() == (float(big.min()), float(big.max()))
    w = obs.width
    assert w == 2.0 ** round(math.log2(w)) and obs.half * w > float(big.max()) >= obs.half * w / 2
    direct = np.histogram(np.concatenate([small, big, small]).astype(np.float64),
                          bins=2 * obs.half, range=(-obs.half * w, obs.half * w))[0]
    np.testing.assert_array_equal(obs.counts, direct)


# -- bounded state, registry ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BUILTIN)
def test_state_bytes_bounded(name):
    x = samples(n=64)
    one = observed(name, x[0])
    size = one.state_bytes()
    for batch in x[1:]:
        one.update(batch)
    for batch in x:
        one.update(batch * 10)
    assert one.state_bytes() == size
    assert size <= 4 * 2048 * 8 + 1024


def test_make_observer_kwargs_and_errors():
    assert make_observer("percentile", percentile=99.0).percentile == 99.0
    assert make_observer("ema", momentum=0.5).momentum == 0.5
    assert isinstance(make_observer("mse", bits=4, symmetric=False), MSEObserver)
    with pytest.raises(OqError, match="'nope'") as err:
        make_observer("nope")
    assert "unknown calibration method" in str(err.value) and "minmax" in str(err.value)
    with pytest.raises(OqError, match="bad options"):
        make_observer("minmax", percentile=99.0)
    for name, kwargs in [("percentile", {"percentile": 101}), ("ema", {"momentum": 1.0}), ("entropy", {"bits": 1}),
                         ("mse", {"candidates": 1}), ("percentile", {"bins": 4})]:
        with pytest.raises(OqError):
            make_observer(name, **kwargs)


def test_register_custom_observer():
    class AbsMaxObserver(Observer):
        name = "test_absmax"

        def __init__(self, factor=1.0):
            self.amax, self.factor = 0.0, factor

        def update(self, x):
            self.amax = max(self.amax, float(np.abs(x).max()))

        def merge(self, other):
            self.amax = max(self.amax, other.amax)

        def range(self):
            return -self.amax * self.factor, self.amax * self.factor

    register_observer("test_absmax", AbsMaxObserver)
    try:
        assert "test_absmax" in observer_names()
        obs = make_observer("test_absmax", factor=0.5)
        obs.update(np.array([1.0, -4.0]))
        assert obs.range() == (-2.0, 2.0)
        assert obs.state_bytes() > 0  # the base class's rough default
    finally:
        from oq import observers
        observers._REGISTRY.pop("test_absmax", None)


def test_classes_are_registered_under_their_names():
    for cls in (MinMaxObserver, EMAObserver, PercentileObserver, EntropyObserver, MSEObserver):
        assert isinstance(make_observer(cls.name), cls)


@pytest.mark.parametrize("name", ["percentile", "entropy", "mse"])
def test_strided_sampling_of_large_samples_is_batching_invariant_and_close(name):
    rng = np.random.default_rng(7)
    data = np.maximum(rng.laplace(size=(64, 8, 24, 24)), 0).astype(np.float32)  # 4608 values per sample

    def observe(batch, limit):
        obs = make_observer(name)
        obs.rows_are_samples, obs.sample_limit = True, limit
        for i in range(0, len(data), batch):
            obs.update(data[i:i + batch])
        return obs

    one, sixteen = observe(1, 2304), observe(16, 2304)  # every 2nd value of each sample
    assert one.range() == sixteen.range()
    assert one.count == data.size  # each kept value stands for 2
    full = observe(16, None).range()[1]
    # as close to the full result as half of the samples taken whole (the method's own sampling noise) would be
    half = make_observer(name)
    for i in range(0, len(data), 2):
        half.update(data[i:i + 1])
    assert abs(one.range()[1] - full) <= max(2 * abs(half.range()[1] - full), 0.05 * full)


def test_quantization_error_prefers_the_finer_power_of_two_grid_for_thin_tails():
    rng = np.random.default_rng(3)
    bulk = rng.normal(0, 1, 100_000).astype(np.float32)
    tail = np.array([40.0, -40.0], np.float32)  # two outliers set the range
    obs = make_observer("percentile")
    obs.update(np.concatenate([bulk, tail]))
    from oq.spec import QuantSpec, qparams_from_range
    qp = qparams_from_range(obs.lo, obs.hi, QuantSpec("int8", power_of_two=True))  # min/max: scale 0.5
    coarse = obs.quantization_error(float(qp.scale), 0.0, -128, 127)
    fine = obs.quantization_error(float(qp.scale) / 2, 0.0, -128, 127)
    assert fine < coarse  # clipping two values costs less than doubling every other value's rounding error
    # without the tail, halving the grid would clip the bulk itself: the covering scale wins
    only_bulk = make_observer("percentile")
    only_bulk.update(np.clip(bulk, -3, 3))
    qp = qparams_from_range(only_bulk.lo, only_bulk.hi, QuantSpec("int8", power_of_two=True))
    s = float(qp.scale)
    assert only_bulk.quantization_error(s, 0.0, -128, 127) < only_bulk.quantization_error(s / 2, 0.0, -128, 127)


def test_entropy_never_clips_below_a_clamp():
    """ReLU6 outputs pile up at 6: KL happily clips below the spike, which moves every clamped value."""
    rng = np.random.default_rng(0)
    relu6 = np.clip(rng.laplace(0.0, 1.2, size=200_000), 0.0, 6.0).astype(np.float32)
    assert (relu6 == 6.0).mean() > 0.002
    obs = make_observer("entropy")
    for chunk in np.array_split(relu6, 7):
        obs.update(chunk)
    assert obs.range() == (0.0, 6.0)
    # the same distribution without the clamp is clipped well inside its maximum
    tail = np.abs(rng.laplace(0.0, 1.2, size=200_000)).astype(np.float32)
    free = make_observer("entropy")
    free.update(tail)
    assert free.range()[1] < 0.9 * float(tail.max())


def test_clamp_counts_merge_like_one_pass():
    rng = np.random.default_rng(1)
    data = np.clip(rng.normal(0, 2, size=30_000), -3.0, 3.0).astype(np.float32)
    whole = make_observer("entropy")
    whole.update(data)
    a, b = make_observer("entropy"), make_observer("entropy")
    a.update(data[:10_000])
    b.update(data[10_000:])
    a.merge(b)
    assert (a.at_lo, a.at_hi, a.binned) == (whole.at_lo, whole.at_hi, whole.binned)
    assert whole.at_lo == int((data == -3.0).sum()) and whole.at_hi == int((data == 3.0).sum())
    assert a.range() == whole.range() == (-3.0, 3.0)
