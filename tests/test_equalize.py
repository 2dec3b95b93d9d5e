"""Cross-layer equalization: the function is unchanged and the channel ranges of each pair end equal."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import oq
from conftest import run_onnx
from oq import ir
from oq.passes.equalize import CrossLayerEqualization, _in_ranges, _out_ranges, equalizable_pairs
from oq.passmanager import Context
from oq.report import Report


def _uneven(rng, shape, axis):
    """Weights whose channels along `axis` span three orders of magnitude."""
    w = rng.normal(size=shape)
    spread = np.logspace(-1.5, 1.5, shape[axis])
    return (w * spread.reshape([-1 if d == axis else 1 for d in range(len(shape))])).astype(np.float32)


def chain(kind: str):
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(value, name))
        return name

    if kind == "conv":  # Conv -> Relu -> Conv (2 groups)
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 10, 10])
        nodes += [helper.make_node("Conv", ["x", const("w1", _uneven(rng, (8, 3, 3, 3), 0)),
                                            const("b1", rng.normal(size=8).astype(np.float32))], ["a"],
                                   pads=[1, 1, 1, 1], name="A"),
                  helper.make_node("Relu", ["a"], ["r"]),
                  helper.make_node("Conv", ["r", const("w2", _uneven(rng, (6, 4, 1, 1), 1))], ["y"], group=2,
                                   name="B")]
        feed = {"x": rng.normal(size=(2, 3, 10, 10)).astype(np.float32)}
    elif kind == "convtranspose":  # ConvTranspose (2 groups) -> LeakyRelu -> ConvTranspose
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6, 6])
        nodes += [helper.make_node("ConvTranspose", ["x", const("w1", _uneven(rng, (4, 4, 2, 2), 1)),
                                                     const("b1", rng.normal(size=8).astype(np.float32))], ["a"],
                                   strides=[2, 2], group=2, name="A"),
                  helper.make_node("LeakyRelu", ["a"], ["r"], alpha=0.1),
                  helper.make_node("ConvTranspose", ["r", const("w2", _uneven(rng, (8, 3, 3, 3), 0))], ["y"],
                                   name="B")]
        feed = {"x": rng.normal(size=(2, 4, 6, 6)).astype(np.float32)}
    else:  # Gemm (transB) -> Relu -> Gemm
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5])
        nodes += [helper.make_node("Gemm", ["x", const("w1", _uneven(rng, (7, 5), 0)),
                                            const("b1", rng.normal(size=7).astype(np.float32))], ["a"],
                                   transB=1, name="A"),
                  helper.make_node("Relu", ["a"], ["r"]),
                  helper.make_node("Gemm", ["r", const("w2", _uneven(rng, (7, 4), 1))], ["y"], name="B")]
        feed = {"x": rng.normal(size=(3, 5)).astype(np.float32)}
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), feed


@pytest.mark.parametrize("kind", ["conv", "convtranspose", "gemm"])
def test_equalization_keeps_the_function_and_balances_ranges(kind):
    model, feed = chain(kind)
    ctx = Context(graph=ir.to_graph(model), report=Report())
    a, _, b = equalizable_pairs(ctx.graph)[0]
    before = _out_ranges(a, ir.constant_value(a.inputs[1])) / _in_ranges(b, ir.constant_value(b.inputs[1]))
    assert before.max() / before.min() > 10  # the fixture really is uneven
    result = CrossLayerEqualization().run(ctx)
    assert result.modified and "A->B" in result.notes[0]
    out = ir.to_model(ctx.graph)
    np.testing.assert_allclose(run_onnx(out, feed), run_onnx(model, feed), rtol=1e-4, atol=1e-4)
    g = ir.to_graph(out)
    a, _, b = equalizable_pairs(g)[0]
    ra, rb = _out_ranges(a, ir.constant_value(a.inputs[1])), _in_ranges(b, ir.constant_value(b.inputs[1]))
    np.testing.assert_allclose(ra, rb, rtol=1e-5)


def test_pairs_need_a_private_path_and_a_scale_commuting_activation():
    model, _ = chain("conv")
    model.graph.node[1].op_type = "Sigmoid"  # not positively homogeneous
    assert equalizable_pairs(ir.to_graph(model)) == []
    model, _ = chain("conv")
    model.graph.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))  # read outside too
    assert equalizable_pairs(ir.to_graph(model)) == []
    model, _ = chain("conv")
    model.graph.node.append(helper.make_node("Relu", ["a"], ["other"]))  # A's output has two readers
    assert equalizable_pairs(ir.to_graph(model)) == []


def test_targets_with_per_tensor_weights_equalize_and_the_option_overrides(model_paths, calib_files):
    path, calib = model_paths["decoder"], calib_files["decoder"][0]
    on = oq.quantize(path, "vitis", calib, progress=False)
    off = oq.quantize(path, "vitis", calib, progress=False, equalize=False)
    names = lambda r: [p.name for p in r.report.passes]
    assert "cross-layer-equalization" in names(on) and "cross-layer-equalization" not in names(off)
    assert "cross-layer-equalization" not in names(oq.quantize(path, "tensorrt", calib, progress=False))
    assert oq.load_target("qnn").cross_layer_equalization and not oq.load_target("tensorrt").cross_layer_equalization
