"""oq.bridge.fakequant: torch fake quantization, bit-exact with onnxruntime's QuantizeLinear -> DequantizeLinear, and
its hand-written gradients (STE, LSQ, LSQ+, power-of-two) against finite differences and hand-computed values."""
import math
import subprocess
import sys
import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from oq.bridge.fakequant import (FakeQuantLSQ, FakeQuantLSQPlus, FakeQuantParams, FakeQuantPOT, FakeQuantSTE,
                                 fake_quantize, lsq_grad_scale)
from oq.errors import OqError
from oq.spec import DTYPES, QuantSpec, dequantize_array, quantize_array, weight_qparams

# dtype -> opset of its Q/DQ (blocked Q/DQ, int4 and 16-bit need 21)
OPSETS = {"int8": 13, "uint8": 13, "int16": 21, "uint16": 21, "int4": 21, "uint4": 21}


def ort_qdq(x, scale, zp, dtype, axis=None, block_size=None, clip=None):
    """onnxruntime's QuantizeLinear -> [Clip on the integers, for grids narrower than the dtype] -> DequantizeLinear."""
    elem = DTYPES[dtype][3]
    opset = 21 if block_size else OPSETS[dtype]
    attrs = {k: v for k, v in (("axis", axis), ("block_size", block_size)) if v is not None}
    scale = np.asarray(scale, np.float32)
    zp = np.asarray(zp)
    inits = [numpy_helper.from_array(scale, "s"),
             helper.make_tensor("z", elem, zp.shape, zp.ravel().astype(int).tolist())]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], **attrs)]
    q = "q"
    if clip is not None:
        np_dtype = DTYPES[dtype][2]
        inits += [numpy_helper.from_array(np.array(clip[0], np_dtype), "lo"),
                  numpy_helper.from_array(np.array(clip[1], np_dtype), "hi")]
        nodes.append(helper.make_node("Clip", ["q", "lo", "hi"], ["qc"]))
        q = "qc"
    nodes.append(helper.make_node("DequantizeLinear", [q, "s", "z"], ["y"], **attrs))
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, x.shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _expand(a, shape, axis, block_size):
    if axis is None:
        return a
    if block_size:
        return np.take(a, np.arange(shape[axis]) // block_size, axis=axis)
    view = [1] * len(shape)
    view[axis] = -1
    return a.reshape(view)


def make_case(dtype, granularity, rng, narrow=False):
    """x (with ties, their neighbours, saturating and non-finite values), scale, zero-point, axis, block size."""
    lo, hi = DTYPES[dtype][:2]
    qmin, qmax = (lo + 1, hi) if narrow else (lo, hi)
    shape = (3, 10, 20)
    axis, block = {"per_tensor": (None, None), "per_axis": (1, None), "per_block": (2, 6)}[granularity]
    pshape = () if axis is None else (10,) if not block else (3, 10, 4)
    scale = np.asarray(np.exp(rng.uniform(np.log(1e-3), np.log(10.0), pshape)), np.float32)
    if narrow:
        zp = np.zeros(pshape, np.int64)
    else:  # anywhere on the grid: negative for signed dtypes, near the top for unsigned (a mostly negative range)
        zp = np.asarray(rng.integers(lo, hi + 1, pshape))
        if zp.size > 1:
            zp.reshape(-1)[:2] = (hi, lo)
    s, z = _expand(scale, shape, axis, block), _expand(zp.astype(np.float32), shape, axis, block)
    k = rng.integers(qmin, qmax + 1, shape).astype(np.float32) - z
    kind = rng.integers(0, 6, shape)
    noise = rng.uniform(-0.5, 0.5, shape).astype(np.float32)
    x = np.select([kind == 0, kind == 1, kind == 2, kind == 3, kind == 4],
                  [(k + 0.5) * s,                                   # ties (or one ulp off after the float32 product)
                   np.nextafter((k + 0.5) * s, np.float32(np.inf)),
                   np.nextafter((k - 0.5) * s, np.float32(-np.inf)),
                   (k + noise) * s,                                 # inside the grid
                   (k + noise) * s * 40],                            # mostly saturating
                  rng.standard_normal(shape).astype(np.float32) * 1e30).astype(np.float32)
    x.reshape(-1)[:6] = [np.inf, -np.inf, 0.0, -0.0, 3e38, -3e38]
    return x, scale, zp.astype(DTYPES[dtype][2]), axis, block, (qmin, qmax)


CASES = [(d, g, False) for d in OPSETS for g in ("per_tensor", "per_axis", "per_block")] + \
        [("int8", g, True) for g in ("per_tensor", "per_axis", "per_block")]


@pytest.mark.parametrize("dtype,granularity,narrow", CASES)
@pytest.mark.parametrize("method", ["ste", "lsq+"])
def test_forward_bit_exact_with_onnxruntime(dtype, granularity, narrow, method):
    rng = np.random.default_rng(zlib.crc32(f"{dtype}/{granularity}/{narrow}".encode()))
    x, scale, zp, axis, block, (qmin, qmax) = make_case(dtype, granularity, rng, narrow)
    ref = ort_qdq(x, scale, zp, dtype, axis, block, clip=(qmin, qmax) if narrow else None)
    xt = torch.from_numpy(x).requires_grad_(method != "ste")
    st = torch.from_numpy(scale).requires_grad_(method != "ste")
    zt = torch.from_numpy(zp.astype(np.float32)).requires_grad_(method != "ste")
    y = fake_quantize(xt, st, zt, qmin, qmax, axis=axis, block_size=block, method=method)
    assert y.dtype == torch.float32
    np.testing.assert_array_equal(y.detach().numpy(), ref)
    if narrow:
        assert np.rint(ref / _expand(scale, x.shape, axis, block)).min() == qmin  # the grid really is narrow


def test_onnxruntime_divides_by_the_scale():
    """The reference divides x / scale in float32; multiplying by the reciprocal, or dividing in float64, does not
    match onnxruntime on the tie-heavy test data."""
    rng = np.random.default_rng(7)
    x, scale, zp, *_ = make_case("int8", "per_tensor", rng)
    x = np.where(np.abs(x) < 1e6, x, 0.0).astype(np.float32)
    ref = ort_qdq(x, scale, zp, "int8")
    z = np.float32(zp)

    def qdq(v):
        return ((np.clip(np.rint(v) + z, -128, 127) - z) * scale).astype(np.float32)
    np.testing.assert_array_equal(qdq(x / scale), ref)
    assert (qdq(x * (np.float32(1) / scale)) != ref).sum() > 0
    assert (qdq(x.astype(np.float64) / np.float64(scale)) != ref).sum() > 0


@pytest.mark.parametrize("spec,axis", [
    (QuantSpec("int8", narrow_range=True, granularity="per_channel"), 0),
    (QuantSpec("uint8", symmetric=False), None),
    (QuantSpec("int4", granularity="per_block", block_size=4), 1),
    (QuantSpec("uint16", symmetric=False, granularity="per_channel"), 0),
    (QuantSpec("int8", power_of_two=True, granularity="per_channel"), 0),
])
def test_params_from_oq_qparams(spec, axis):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((6, 10)) * rng.uniform(0.1, 3, (6, 1)) + 0.3).astype(np.float32)
    qp = weight_qparams(w, spec, axis)
    p = FakeQuantParams.from_qparams(qp)
    qmin, qmax = spec.qrange
    narrow = (qmin, qmax) != DTYPES[spec.dtype][:2]
    ref = ort_qdq(w, qp.scale, qp.zero_point, spec.dtype, qp.axis, qp.block_size, (qmin, qmax) if narrow else None)
    for method in ("ste", "lsq", "lsq+") + (("pot",) if spec.power_of_two else ()):
        np.testing.assert_array_equal(p(torch.from_numpy(w), method).detach().numpy(), ref)
    back = p.to_qparams()
    np.testing.assert_array_equal(back.scale, qp.scale)
    np.testing.assert_array_equal(back.zero_point, qp.zero_point)
    assert back.zero_point.dtype == qp.zero_point.dtype and (back.axis, back.block_size) == (qp.axis, qp.block_size)
    # oq's own offline quantization of the weights (float64 division) agrees on these (tie-free) weights
    np.testing.assert_array_equal(dequantize_array(quantize_array(w, qp), qp), ref)


def test_params_learn_and_export():
    spec = QuantSpec("uint8", symmetric=False)
    p = FakeQuantParams.from_spec(spec, 0.05, 128).requires_grad_("lsq+")
    x = torch.linspace(-10, 3, 50)
    p(x, "lsq+").pow(2).sum().backward()
    assert p.scale.grad is not None and p.zero_point.grad is not None
    pot = FakeQuantParams.from_spec(QuantSpec("int8", power_of_two=True), 0.25).requires_grad_("pot")
    assert float(pot.log2_scale.detach()) == -2.0
    with torch.no_grad():
        pot.log2_scale -= 0.4
    assert float(pot.to_qparams().scale) == 0.25  # 2^ceil(-2.4)
    with torch.no_grad():
        pot.log2_scale -= 0.7
    assert float(pot.to_qparams().scale) == 0.125
    with pytest.raises(OqError, match="float grid"):
        FakeQuantParams.from_spec(QuantSpec("float8e4m3"), 1.0)
    with pytest.raises(OqError, match="per-channel"):
        fake_quantize(torch.zeros(2, 3), torch.ones(4), 0, -128, 127, axis=1)
    with pytest.raises(OqError, match="method"):
        fake_quantize(torch.zeros(2), 1.0, method="dorefa")


# ---- gradients ---------------------------------------------------------------------------------------------------

def anchored(*points):
    """A rounding surrogate of slope 1 that equals round at the given base points: t -> t + (round(t0) - t0), the
    offset picked by shape. The forward with it agrees with the real one at the base point and is differentiable,
    so finite differences of it check the hand-written backward (which takes round's derivative as 1)."""
    offsets = {tuple(p.shape): (torch.round(p) - p).detach() for p in points}
    return lambda t: t + offsets[tuple(t.shape)]


def anchored_ceil(point):
    offset = (torch.ceil(point) - point).detach()
    return lambda t: t + offset


def _x(scale, zp, qmin, qmax, shape, rng):
    """float64 values away from rounding ties and from the grid's ends, inside and outside the clamp: round(x / s) + zp
    is k, an integer from qmin - 6 to qmax + 6 other than qmin and qmax (where the clamp has its kinks)."""
    k = rng.integers(qmin - 6, qmax + 7, shape).astype(np.float64)
    k = np.where(k == qmin, qmin - 2, np.where(k == qmax, qmax + 2, k))
    f = rng.uniform(-0.35, 0.35, shape)
    return torch.tensor((k - zp + f) * scale)


def test_gradcheck_ste_input():
    rng = np.random.default_rng(0)
    s, z = torch.tensor([[0.3], [0.7]], dtype=torch.float64), torch.tensor([[2.0], [-3.0]], dtype=torch.float64)
    x = _x(s.numpy(), z.numpy(), -8, 7, (2, 9), rng).requires_grad_()
    rnd = anchored(x / s, z)
    assert torch.autograd.gradcheck(lambda x: FakeQuantSTE.apply(x, s, z, -8, 7, rnd), (x,), eps=1e-6)


def test_gradcheck_lsq():
    g = 0.3
    rng = np.random.default_rng(1)
    s = torch.tensor([[0.3], [0.7], [1.1]], dtype=torch.float64, requires_grad=True)
    z = torch.tensor([[0.0], [4.0], [-5.0]], dtype=torch.float64)
    x = _x(s.detach().numpy(), z.numpy(), -8, 7, (3, 8), rng).requires_grad_()
    rnd = anchored(x / s, z)
    assert torch.autograd.gradcheck(lambda x, s: FakeQuantLSQ.apply(x, s, z, -8, 7, 1.0, rnd), (x, s), eps=1e-6)
    # the gradient scale multiplies the scale gradient only
    gy = torch.randn(3, 8, dtype=torch.float64)
    one = torch.autograd.grad(FakeQuantLSQ.apply(x, s, z, -8, 7, 1.0, rnd), s, gy)[0]
    scaled = torch.autograd.grad(FakeQuantLSQ.apply(x, s, z, -8, 7, g, rnd), s, gy)[0]
    torch.testing.assert_close(scaled, one * g)


def test_gradcheck_lsq_plus():
    rng = np.random.default_rng(2)
    s = torch.tensor([0.4, 0.9], dtype=torch.float64).reshape(1, 2, 1).requires_grad_()
    z = torch.tensor([3.0, -6.0], dtype=torch.float64).reshape(1, 2, 1).requires_grad_()
    x = _x(s.detach().numpy(), z.detach().numpy(), -128, 127, (4, 2, 5), rng).requires_grad_()
    x.data[0, :, 0], x.data[0, :, 1] = 1000 * s.detach()[0, :, 0], -1000 * s.detach()[0, :, 0]  # far outside
    rnd = anchored(x / s, z)
    assert torch.autograd.gradcheck(lambda x, s, z: FakeQuantLSQPlus.apply(x, s, z, -128, 127, 1.0, rnd),
                                    (x, s, z), eps=1e-6)


def test_gradcheck_pot():
    rng = np.random.default_rng(3)
    log2 = torch.tensor([-2.4, -0.7], dtype=torch.float64).reshape(2, 1).requires_grad_()
    s = torch.exp2(torch.ceil(log2.detach()))
    z = torch.zeros((), dtype=torch.float64)
    x = _x(s.numpy(), 0.0, -128, 127, (2, 12), rng).requires_grad_()
    rnd, ceil = anchored(x / s, z), anchored_ceil(log2)
    assert torch.autograd.gradcheck(lambda x, l: FakeQuantPOT.apply(x, l, z, -128, 127, 1.0, rnd, ceil),
                                    (x, log2), eps=1e-6)


def test_gradcheck_real_round_saturated_scale():
    """Where every value saturates the forward is smooth in the scale: the LSQ gradient is its true derivative."""
    s = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    x = torch.tensor([-40.0, -9.0, 8.0, 30.0, 100.0], dtype=torch.float64)
    for fn in (FakeQuantLSQ, FakeQuantLSQPlus):
        assert torch.autograd.gradcheck(lambda s: fn.apply(x, s, torch.tensor(3.0, dtype=torch.float64),
                                                           -128, 127, 1.0), (s,), eps=1e-7)


def _grads(method, x, scale, zp, qmin, qmax, axis=None, block_size=None, grad_scale=None):
    x = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    scale = torch.tensor(scale, dtype=torch.float32, requires_grad=True)
    zp = torch.tensor(zp, dtype=torch.float32, requires_grad=True)
    y = fake_quantize(x, scale, zp, qmin, qmax, axis, block_size, method, grad_scale)
    y.sum().backward()
    return y.detach().numpy(), x.grad.numpy(), None if scale.grad is None else scale.grad.numpy(), \
        None if zp.grad is None else zp.grad.numpy()


def test_hand_computed_ste_and_lsq():
    # int8, s = 0.5: v = 0.6, 1.4, 200, -200, 126.8, -127.6 -> round 1, 1, 200 (above), -200 (below), 127 and -128
    # (inside: the grid's ends belong to it)
    x = [0.3, 0.7, 100.0, -100.0, 63.4, -63.8]
    y, gx, gs, gz = _grads("ste", x, 0.5, 0.0, -128, 127)
    np.testing.assert_array_equal(y, [0.5, 0.5, 63.5, -64.0, 63.5, -64.0])
    np.testing.assert_array_equal(gx, [1, 1, 0, 0, 1, 1])
    assert gs is None and gz is None
    y, gx, gs, gz = _grads("lsq", x, 0.5, 0.0, -128, 127)
    np.testing.assert_array_equal(gx, [1, 1, 0, 0, 1, 1])
    per_value = np.array([1 - 0.6, 1 - 1.4, 127, -128, 127 - 126.8, -128 + 127.6])
    np.testing.assert_allclose(gs, per_value.sum() / math.sqrt(6 * 127), rtol=1e-5)
    assert gz is None
    # per channel: g = 1 / sqrt(values per channel * qmax)
    y, gx, gs, _ = _grads("lsq", [[0.3, 100.0], [0.7, -100.0]], [0.5, 0.25], 0.0, -8, 7, axis=0)
    np.testing.assert_array_equal(gx, [[1, 0], [1, 0]])
    np.testing.assert_allclose(gs, np.array([(1 - 0.6) + 7, (3 - 2.8) - 8]) / math.sqrt(2 * 7), rtol=1e-5)


def test_hand_computed_lsq_plus():
    # uint8, s = 0.5, z = 10: v = 0.6, -12, 400, 2.2 -> r + z = 11 (in), -2 (below), 410 (above), 12 (in)
    y, gx, gs, gz = _grads("lsq+", [0.3, -6.0, 200.0, 1.1], 0.5, 10.0, 0, 255)
    np.testing.assert_array_equal(y, [0.5, -5.0, 122.5, 1.0])
    np.testing.assert_array_equal(gx, [1, 0, 0, 1])
    g = 1 / math.sqrt(4 * 255)
    np.testing.assert_allclose(gs, (0.4 + (0 - 10) + (255 - 10) - 0.2) * g, rtol=1e-5)
    np.testing.assert_allclose(gz, (0 - 0.5 - 0.5 + 0) * g, rtol=1e-6)
    # a fractional zero-point is rounded (half to even) in the forward, straight through in the backward
    y2, *_ = _grads("lsq+", [0.3, -6.0, 200.0, 1.1], 0.5, 9.6, 0, 255)
    np.testing.assert_array_equal(y2, y)


def test_hand_computed_pot():
    # log2 scale -1.3 -> 2^ceil = 0.5; dL/dlog2 = dL/ds * 0.5 * ln 2 (no gradient scale by default)
    x = [0.3, 0.7, 100.0, -100.0, 63.4]
    y, gx, gl, gz = _grads("pot", x, -1.3, 0.0, -128, 127)
    np.testing.assert_array_equal(y, [0.5, 0.5, 63.5, -64.0, 63.5])
    np.testing.assert_array_equal(gx, [1, 1, 0, 0, 1])
    np.testing.assert_allclose(gl, (0.4 - 0.4 + 127 - 128 + 0.2) * 0.5 * math.log(2), rtol=1e-5)
    assert gz is None


def test_hand_computed_per_block():
    # 5 values along axis 1 in blocks of 2: blocks of 2, 2 and 1 values, each with its own g
    x = [[0.3, 0.7, 100.0, 0.2, -0.6]]
    y, gx, gs, gz = _grads("lsq+", x, [[0.5, 0.5, 0.5]], [[0.0, 1.0, 0.0]], -8, 7, axis=1, block_size=2)
    np.testing.assert_array_equal(gx, [[1, 1, 0, 1, 1]])
    per_value = [1 - 0.6, 1 - 1.4, 7 - 1, 0 - 0.4, -1 + 1.2]
    g = np.array([2, 2, 1]) ** -0.5 / math.sqrt(7)
    np.testing.assert_allclose(gs, [[(per_value[0] + per_value[1]) * g[0], (per_value[2] + per_value[3]) * g[1],
                                     per_value[4] * g[2]]], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gz, [[0, -0.5 * g[1], 0]], rtol=1e-6)
    np.testing.assert_allclose(lsq_grad_scale((1, 5), -8, 7, 1, 2).reshape(-1).numpy(), np.repeat(g, [2, 2, 1]),
                               rtol=1e-6)


# ---- LSQ learns ----------------------------------------------------------------------------------------------------

def _mse(x, s, qmin, qmax):
    return float(((np.clip(np.rint(x / s), qmin, qmax) * s - x) ** 2).mean())


@pytest.mark.parametrize("start", [0.05, 0.6])
def test_lsq_moves_the_scale_to_the_mse_optimum(start):
    """Minimizing the MSE of a 4-bit fake quantization of Gaussian data with LSQ lands near the scale a brute-force
    search finds, from a scale too small (clipping) or too large (the min/max scale, coarse)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(20000).astype(np.float32)
    qmin, qmax = -7, 7
    grid = np.linspace(0.05, 0.6, 1101)
    errs = [_mse(x, s, qmin, qmax) for s in grid]
    best = grid[int(np.argmin(errs))]
    xt = torch.from_numpy(x)
    s = torch.tensor(start, requires_grad=True)
    opt = torch.optim.Adam([s], lr=0.01)
    for _ in range(400):
        opt.zero_grad()
        loss = (fake_quantize(xt, s, 0.0, qmin, qmax, method="lsq") - xt).pow(2).mean()
        loss.backward()
        opt.step()
    learned = float(s.detach())
    assert abs(learned - best) < 0.5 * abs(start - best)  # moved toward the optimum
    assert abs(learned - best) / best < 0.03, (learned, best)
    assert _mse(x, learned, qmin, qmax) < 1.01 * min(errs)


def test_import_oq_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", "import oq, sys; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
