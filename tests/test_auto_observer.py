"""The `auto` observer (best of minmax / percentile / MSE per tensor) and the entropy observer's collapse guard."""
import math

import numpy as np
import pytest

import oq
from oq.errors import OqError
from oq.observers import make_observer, observer_names, range_error
from oq.spec import QuantSpec

from conftest import run_onnx, sqnr_db

INT8 = QuantSpec("int8")  # TensorRT's activations: signed symmetric, zero-point 0
UINT8 = QuantSpec("uint8", symmetric=False)  # onnxruntime's: asymmetric


def observed(name, x, **kwargs):
    obs = make_observer(name, **kwargs)
    obs.update(np.asarray(x, np.float32))
    return obs


def gaussian(n=200_000, seed=0):
    return np.random.default_rng(seed).normal(size=n).astype(np.float32)


def sparse_tail(n=200_000, seed=0):
    """99.9 % exact zeros and a spread tail that carries the signal (a gated / mostly-dead activation)."""
    rng = np.random.default_rng(seed)
    x = np.zeros(n, np.float32)
    k = n // 1000
    x[:k] = rng.exponential(5.0, k)
    return x


def test_registered():
    assert "auto" in observer_names()
    with pytest.raises(OqError, match="margin"):
        make_observer("auto", margin=0.5)


@pytest.mark.parametrize("spec", [INT8, UINT8])
def test_gaussian_picks_the_best_candidate(spec):
    obs = observed("auto", gaussian(), spec=spec)
    lo, hi = obs.range()
    best = min(obs.errors.values())
    assert set(obs.errors) == {"minmax", "percentile99.999", "percentile99.99", "percentile99.9", "mse"}
    assert range_error(obs, lo, hi, spec) <= 1.05 * best
    assert range_error(obs, lo, hi, spec) <= obs.errors["minmax"]
    assert obs.errors["minmax"] > 1.1 * best  # a Gaussian's extremes are worth clipping on 8 bits
    assert obs.details == f"auto:{min(obs.errors, key=obs.errors.get)}"


def test_outliers_are_clipped():
    x = gaussian(1_000_000)
    x[:4] = [60.0, -55.0, 58.0, -60.0]  # four values set minmax's scale 15x wider than the bulk needs
    obs = observed("auto", x, spec=INT8)
    lo, hi = obs.range()
    assert obs.details != "auto:minmax" and hi < 30
    assert range_error(obs, lo, hi, INT8) < obs.errors["minmax"] / 2


def test_bounded_data_keeps_minmax():
    obs = observed("auto", np.random.default_rng(1).uniform(-1, 1, 100_000), spec=INT8)
    assert obs.range() == (obs.lo, obs.hi) and obs.details == "auto:minmax"


def test_margin_prefers_the_wider_range():
    obs = observed("auto", gaussian(), spec=INT8, margin=1.5)
    obs.range()
    assert obs.errors["minmax"] < 1.5 * min(obs.errors.values())  # so minmax is within the margin and first
    assert obs.details == "auto:minmax"


def test_errors_follow_the_grid():
    """The same histogram judged on different grids: unsigned asymmetric data has twice the levels of int8."""
    relu = np.maximum(gaussian(), 0)
    signed, unsigned = observed("auto", relu, spec=INT8), observed("auto", relu, spec=UINT8)
    signed.range(), unsigned.range()
    assert unsigned.errors["minmax"] == pytest.approx(signed.errors["minmax"] / 4, rel=0.05)


def test_batching_invariant_and_mergeable():
    x = np.random.default_rng(2).standard_t(3, size=(32, 500)).astype(np.float32)
    whole = observed("auto", x, spec=INT8)
    a, b = observed("auto", x[:7], spec=INT8), observed("auto", x[7:], spec=INT8)
    a.merge(b)
    assert a.range() == whole.range() and a.details == whole.details


def test_degenerate_data():
    assert observed("auto", np.zeros(10)).range() == (0.0, 0.0)
    lo, hi = observed("auto", [1.0, np.nan]).range()
    assert math.isnan(lo) and math.isnan(hi)
    obs = make_observer("auto")
    obs.update(gaussian(1000).astype(np.float64) * 1e300)
    lo, hi = obs.range()  # beyond float32 grids: ties, so minmax
    assert math.isfinite(lo) and math.isfinite(hi)


# -- the entropy guard --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [INT8, UINT8])
def test_entropy_collapse_is_caught(spec):
    plain = observed("entropy", sparse_tail(), spec=spec, guard=None)
    guarded = observed("entropy", sparse_tail(), spec=spec)
    mse = observed("mse", sparse_tail(), symmetric=spec.symmetric)
    kl_error = range_error(plain, *plain.range(), spec)
    mse_error = range_error(mse, *mse.range(), spec)
    assert kl_error > 2 * mse_error  # KL clips the tail that holds the signal
    guarded.range()
    assert plain.details == "entropy:kl" and guarded.details == "entropy:mse"
    assert range_error(guarded, *guarded.range(), spec) <= 2 * mse_error
    assert guarded.range()[1] > plain.range()[1]


def test_entropy_guard_leaves_healthy_ranges_alone():
    for x in (gaussian(), np.maximum(gaussian(), 0)):
        plain, guarded = observed("entropy", x, guard=None), observed("entropy", x)
        assert guarded.range() == plain.range() and guarded.details == "entropy:kl"
    with pytest.raises(OqError, match="guard"):
        make_observer("entropy", guard=0.5)


# -- end to end ---------------------------------------------------------------------------------------------------

def test_auto_end_to_end(model_paths, calib_files):
    path, (calib, held) = model_paths["transformer"], calib_files["transformer"]
    ref = run_onnx(path, held)
    auto = oq.quantize(path, "tensorrt", calib, calib_method="auto", progress=False)
    minmax = oq.quantize(path, "tensorrt", calib, calib_method="minmax", progress=False)
    db_auto, db_minmax = sqnr_db(ref, run_onnx(auto.model, held)), sqnr_db(ref, run_onnx(minmax.model, held))
    assert db_auto >= db_minmax - 0.5
    choices = auto.report.calibration["choices"]
    assert choices and all(c.startswith("auto:") for c in choices.values())
    notes = next(p.notes for p in auto.report.passes if p.name == "calibrate")
    assert any(n.startswith("range choice: auto:") for n in notes)
    assert "range choice: auto:" in auto.report.format_table()
    assert "choices" not in minmax.report.calibration
