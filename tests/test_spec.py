"""QuantSpec constraints and qparams from ranges and weights, against hand-computed values."""
import numpy as np
import pytest

from oq.errors import OqError
from oq.spec import QuantSpec, dequantize_array, qparams_from_range, quantize_array, weight_qparams


def test_symmetric_int8_and_asymmetric_uint8_by_hand():
    qp = qparams_from_range(-2.0, 1.0, QuantSpec("int8", symmetric=True))
    assert qp.scale == pytest.approx(2.0 / 127) and qp.zero_point == 0
    qp = qparams_from_range(-1.0, 3.0, QuantSpec("uint8", symmetric=False))
    assert qp.scale == pytest.approx(4.0 / 255) and qp.zero_point == round(1.0 / (4.0 / 255))
    qp = qparams_from_range(0.5, 3.0, QuantSpec("uint8", symmetric=False))  # range widened to include 0
    assert qp.scale == pytest.approx(3.0 / 255) and qp.zero_point == 0


def test_zero_range_gives_a_valid_scale():
    for spec in (QuantSpec("int8"), QuantSpec("uint8", symmetric=False), QuantSpec("int8", power_of_two=True)):
        qp = qparams_from_range(0.0, 0.0, spec)
        assert np.isfinite(qp.scale) and qp.scale > 0
    with pytest.raises(OqError, match="not finite"):
        qparams_from_range(np.nan, 1.0, QuantSpec())


def test_constraints():
    spec = QuantSpec("int8", quant_min=-8, quant_max=7)
    assert spec.qrange == (-8, 7) and spec.bits == 4
    assert qparams_from_range(-1, 1, spec).scale == pytest.approx(1 / 7)
    assert qparams_from_range(-1e-9, 1e-9, QuantSpec(min_scale=1e-3)).scale == pytest.approx(1e-3)
    assert qparams_from_range(-1, 3, QuantSpec(power_of_two=True)).scale == 2.0 ** np.ceil(np.log2(3 / 127))
    with pytest.raises(OqError, match="cannot fix the zero-point"):
        QuantSpec("uint8", symmetric=False, zero_point=0)
    with pytest.raises(OqError, match="outside the range"):
        QuantSpec("int8", zero_point=200)


def test_rounding_modes():
    qp = qparams_from_range(-127, 127, QuantSpec("int8"))  # scale 1
    x = np.array([0.5, 1.5, 2.5, -0.5])
    np.testing.assert_array_equal(quantize_array(x, qp), [0, 2, 2, 0])
    qp_away = qparams_from_range(-127, 127, QuantSpec("int8", rounding="half_away"))
    np.testing.assert_array_equal(quantize_array(x, qp_away), [1, 2, 3, -1])


def test_per_channel_weight_axis_and_mse_clipping():
    rng = np.random.default_rng(0)
    w = rng.laplace(size=(4, 64, 3, 3)).astype(np.float32)
    w[2] = rng.standard_t(1.5, size=(64, 3, 3))  # heavy tails: clipping pays off in channel 2
    mm = weight_qparams(w, QuantSpec("int8", narrow_range=True, granularity="per_channel"), axis=0)
    np.testing.assert_allclose(mm.scale, np.abs(w).reshape(4, -1).max(1) / 127, rtol=1e-6)
    # at 4 bits, clipping the tails beats covering them (at 8 bits rounding error is too small to trade)
    four = dict(quant_min=-7, quant_max=7, granularity="per_channel")
    mm = weight_qparams(w, QuantSpec("int8", **four), axis=0)
    mse = weight_qparams(w, QuantSpec("int8", observer="mse", **four), axis=0)
    assert mse.axis == 0 and np.all(mse.scale <= mm.scale + 1e-12) and mse.scale[2] < 0.8 * mm.scale[2]

    def err(qp):
        return ((dequantize_array(quantize_array(w, qp), qp) - w) ** 2).sum()
    assert err(mse) < err(mm)
    # ConvTranspose-style axis 1
    ct = weight_qparams(w, QuantSpec("int8", granularity="per_channel"), axis=1)
    np.testing.assert_allclose(ct.scale, np.abs(w).transpose(1, 0, 2, 3).reshape(64, -1).max(1) / 127, rtol=1e-6)


def test_float8_grid():
    spec = QuantSpec("float8e4m3")
    qp = qparams_from_range(-2.0, 1.0, spec)
    assert qp.scale == pytest.approx(2.0 / 448) and float(qp.zero_point) == 0.0
    x = np.array([0.0, 1e-3, 0.3, -2.0, 5.0], np.float32)
    q = quantize_array(x, qp)
    assert q.dtype.name == "float8_e4m3fn"
    back = dequantize_array(q, qp)
    assert back[-1] == pytest.approx(2.0)  # saturated at the grid's end, not NaN
    assert np.all(np.abs(back[:4] - x[:4]) <= np.abs(x[:4]) * 2 ** -4 + 1e-6)  # 3 mantissa bits
    with pytest.raises(OqError, match="float grid: symmetric only"):
        QuantSpec("float8e4m3", symmetric=False)


def test_per_block_qparams_by_hand():
    w = np.arange(2 * 5, dtype=np.float32).reshape(2, 5) - 4.0  # rows [-4..0], [1..5]
    spec = QuantSpec("int8", granularity="per_block", block_size=2)
    qp = weight_qparams(w, spec, axis=1)
    assert qp.block_size == 2 and qp.scale.shape == (2, 3)  # 5 values -> blocks of 2, 2, 1
    amax = np.array([[4, 2, 0], [2, 4, 5]], np.float32)
    np.testing.assert_allclose(qp.scale, np.where(amax > 0, amax / 127, 1.0), rtol=1e-6)
    np.testing.assert_allclose(dequantize_array(quantize_array(w, qp), qp), w, atol=5 / 127 / 2 + 1e-6)
