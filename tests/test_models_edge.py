"""Graphs unlike the reference models: float16, control flow, old IR with initializers as inputs, fixed batch."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import oq
from conftest import run_onnx, sqnr_db


def conv_model(dtype=np.float32, batch="n"):
    rng = np.random.default_rng(0)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    w1 = numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(dtype), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.3, (4, 8, 3, 3)).astype(dtype), "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["h"], name="c1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="c2", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, [batch, 3, 12, 12])],
                              [helper.make_tensor_value_info("y", elem, None)], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("target", ["tensorrt", "onnxruntime"])
def test_float16_model_is_quantized_at_opset_19(target, tmp_path):
    model = conv_model(np.float16)
    x = np.random.default_rng(1).normal(size=(16, 3, 12, 12)).astype(np.float16)
    np.savez(tmp_path / "c.npz", x=x)
    result = oq.quantize(model, target, tmp_path / "c.npz", progress=False)
    onnx.checker.check_model(result.model, full_check=True)
    assert next(i.version for i in result.model.opset_import if i.domain == "") >= 19
    assert any("float16 model" in w for w in result.report.warnings)
    feed = {"x": x[:4]}
    got = run_onnx(result.model, feed)
    assert got.dtype == np.float16 and sqnr_db(run_onnx(model, feed), got) > 25


def test_fixed_batch_model_takes_whole_feeds_stacked_on_a_new_axis(tmp_path):
    model = conv_model(batch=1)
    x = np.random.default_rng(1).normal(size=(10, 1, 3, 12, 12)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    result = oq.quantize(model, "tensorrt", tmp_path / "c.npz", progress=False)
    assert result.report.calibration["samples"] == 10


def test_control_flow_stays_float_with_a_reason(tmp_path):
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    then_g = helper.make_graph([helper.make_node("Relu", ["h"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 4])])
    else_g = helper.make_graph([helper.make_node("Neg", ["h"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 4])])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("ReduceSum", ["h"], ["s"], keepdims=0, name="rs"),
             helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
             helper.make_node("If", ["c"], ["y0"], then_branch=then_g, else_branch=else_g, name="if"),
             helper.make_node("MatMul", ["y0", "w"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                              [w, numpy_helper.from_array(np.array(0, np.float32), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(0).normal(size=(8, 1, 4)).astype(np.float32))
    result = oq.quantize(model, "tensorrt", tmp_path / "c.npz", progress=False)
    status = {n.name: n for n in result.report.nodes}
    assert status["mm"].quantized and status["mm2"].quantized
    assert status["if"].reason == "control flow (If): its subgraphs stay float"
    feed = {"x": np.ones((1, 4), np.float32)}
    assert sqnr_db(run_onnx(model, feed), run_onnx(result.model, feed)) > 30
