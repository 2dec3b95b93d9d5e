"""The weighted-op table, node by node: axes against hand-computed values, and channel scaling checked by running the
op in onnxruntime (scaled output channels scale the output; scaled input channels compensate a scaled input)."""
from typing import NamedTuple

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import run_onnx
from oq.opinfo import WEIGHTED_OPS, op_names, weighted_op


class Case(NamedTuple):
    op: str
    attrs: dict
    x_shape: tuple
    w_shape: tuple
    out_axis: int  # of the weight
    in_axis: int  # of the weight
    c_in: int  # input channels
    x_axis: int  # of the input: its channels
    y_axis: int  # of the output: its channels
    bias: int | None  # bias input
    groups: int
    gemm: tuple | None  # shape of the weight's GEMM form [G, K, N/G]


CASES = {
    "conv": Case("Conv", {}, (2, 4, 5, 5), (6, 4, 3, 3), 0, 1, 4, 1, 1, 2, 1, (1, 36, 6)),
    "conv_grouped": Case("Conv", {"group": 2}, (2, 4, 5, 5), (6, 2, 3, 3), 0, 1, 4, 1, 1, 2, 2, (2, 18, 3)),
    "convtranspose": Case("ConvTranspose", {}, (2, 4, 3, 3), (4, 6, 2, 2), 1, 0, 4, 1, 1, 2, 1, None),
    "convtranspose_grouped": Case("ConvTranspose", {"group": 2}, (2, 4, 3, 3), (4, 3, 2, 2), 1, 0, 4, 1, 1, 2, 2, None),
    "gemm": Case("Gemm", {}, (3, 5), (5, 7), 1, 0, 5, 1, 1, 2, 1, (1, 5, 7)),
    "gemm_transB": Case("Gemm", {"transB": 1}, (3, 5), (7, 5), 0, 1, 5, 1, 1, 2, 1, (1, 5, 7)),
    "matmul_rank2": Case("MatMul", {}, (3, 5), (5, 7), 1, 0, 5, 1, 1, None, 1, (1, 5, 7)),
    "matmul_rank3": Case("MatMul", {}, (2, 3, 5), (2, 5, 7), 2, 1, 5, 2, 2, None, 1, None),
}


def _weight(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _model(op, attrs, x_shape, w):
    inits = [numpy_helper.from_array(w, "w")]
    node = helper.make_node(op, ["x", "w"], ["y"], name="n", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _along(v, axis, rank):
    shape = [1] * rank
    shape[axis] = -1
    return v.reshape(shape)


@pytest.mark.parametrize("case", list(CASES))
def test_axes_and_inputs(case):
    c = CASES[case]
    node = gs.Node(c.op, attrs=c.attrs)
    info = weighted_op(node)
    assert info is WEIGHTED_OPS[c.op] is weighted_op(c.op)
    assert info.weight_input == 1 and info.bias_input == c.bias
    assert info.rescalable == (c.bias is not None)
    assert info.output_axis(node, len(c.w_shape)) == c.out_axis
    assert info.input_axis(node, len(c.w_shape)) == c.in_axis
    assert info.input_channels(node, c.w_shape) == c.c_in
    assert info.groups(node) == c.groups
    wg = info.gemm_weight(node, _weight(c.w_shape)) if info.gemm_weight is not None else None
    assert (None if wg is None else wg.shape) == c.gemm


def test_conv_gemm_form_orders_k_as_taps_then_channels():
    """K = (kh, kw, c_in) with c_in fastest: entry [g, (t * Cg + c), m] is w[g * Mg + m, c, tap t]."""
    w = _weight((6, 2, 3, 3))
    node = gs.Node("Conv", attrs={"group": 2})
    wg = weighted_op(node).gemm_weight(node, w)
    for g, t, c, m in [(0, 0, 0, 0), (1, 4, 1, 2), (0, 8, 1, 1), (1, 5, 0, 0)]:
        assert wg[g, t * 2 + c, m] == w[g * 3 + m, c, t // 3, t % 3]


def test_non_weighted_ops_and_names():
    assert weighted_op(gs.Node("Relu")) is None and weighted_op("Add") is None
    assert op_names() == "Conv/ConvTranspose/Gemm/MatMul"
    assert op_names(lambda w: w.rescalable) == "Conv/ConvTranspose/Gemm"
    assert op_names(lambda w: w.convolution, " and ") == "Conv and ConvTranspose"


@pytest.mark.parametrize("case", list(CASES))
def test_scaled_output_channels_scale_the_output(case):
    c = CASES[case]
    node = gs.Node(c.op, attrs=c.attrs)
    w, x = _weight(c.w_shape), _weight(c.x_shape, seed=1)
    y = run_onnx(_model(c.op, c.attrs, c.x_shape, w), {"x": x})
    f = np.random.default_rng(2).uniform(0.5, 2.0, y.shape[c.y_axis])
    w2 = weighted_op(node).scale_output_channels(node, w, f)
    assert w2.dtype == np.float64 and w2.shape == w.shape
    y2 = run_onnx(_model(c.op, c.attrs, c.x_shape, w2.astype(np.float32)), {"x": x})
    np.testing.assert_allclose(y2, y * _along(f, c.y_axis, y.ndim), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_scaled_input_channels_compensate_a_scaled_input(case):
    c = CASES[case]
    node = gs.Node(c.op, attrs=c.attrs)
    w, x = _weight(c.w_shape), _weight(c.x_shape, seed=1)
    y = run_onnx(_model(c.op, c.attrs, c.x_shape, w), {"x": x})
    f = np.random.default_rng(3).uniform(0.5, 2.0, c.x_shape[c.x_axis])
    w2 = weighted_op(node).scale_input_channels(node, w, f)
    x2 = (x / _along(f, c.x_axis, x.ndim)).astype(np.float32)
    y2 = run_onnx(_model(c.op, c.attrs, c.x_shape, w2.astype(np.float32)), {"x": x2})
    np.testing.assert_allclose(y2, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_ranges_are_the_largest_weight_of_each_channel(case):
    """Channel i's weights are exactly those that scaling channel i alone changes."""
    c = CASES[case]
    node = gs.Node(c.op, attrs=c.attrs)
    info = weighted_op(node)
    w = _weight(c.w_shape) + np.float32(10)  # no zero weight: every member of a scaled channel moves
    for scale, ranges in ((info.scale_output_channels, info.output_ranges(node, w)),
                          (info.scale_input_channels, info.input_ranges(node, w))):
        for i in range(ranges.size):
            f = np.ones(ranges.size)
            f[i] = 2.0
            members = scale(node, w, f) != w
            assert members.sum() == w.size // ranges.size
            assert ranges[i] == np.abs(w[members]).max()
