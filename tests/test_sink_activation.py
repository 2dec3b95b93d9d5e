"""Float activations move below a MaxPool they alone feed; the onnxruntime target keeps an RGB stem float."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import oq
from conftest import run_onnx
from oq import ir
from oq.errors import OqError
from oq.passes.sink_activation import SinkActivationBelowMaxPool
from oq.passmanager import Context
from oq.report import Report
from oq.target import load_target


def conv_act_pool(act="Relu", pool_outputs=("y",), extra_reader=False, no_q=False, **act_attrs):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w")
    scale = numpy_helper.from_array(np.array(0.05, np.float32), "s")
    zp = numpy_helper.from_array(np.array(0, np.uint8), "z")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node(act, ["c"], ["a"], name="act", **act_attrs),
             helper.make_node("MaxPool", ["a"], ["p", *pool_outputs[1:]], kernel_shape=[2, 2], strides=[2, 2],
                              pads=[0, 0, 1, 1], name="pool"),
             helper.make_node("QuantizeLinear", ["p", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if len(pool_outputs) > 1:
        outputs.append(helper.make_tensor_value_info(pool_outputs[1], TensorProto.INT64, None))
    if no_q:  # the pool's reader is not a QuantizeLinear: a backend may rather fuse the activation upwards
        nodes[3:] = [helper.make_node("Neg", ["p"], ["y"])]
    if extra_reader:
        nodes.append(helper.make_node("Neg", ["a"], ["n"]))
        outputs.append(helper.make_tensor_value_info("n", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 9, 9])],
                              outputs, [w, scale, zp])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("act,attrs", [("Relu", {}), ("LeakyRelu", {"alpha": 0.1})])
def test_activation_moves_below_the_pool_with_identical_results(act, attrs):
    model = conv_act_pool(act, **attrs)
    ctx = Context(graph=ir.to_graph(model), report=Report())
    result = SinkActivationBelowMaxPool().run(ctx)
    assert result.modified and result.notes == ["act below pool"]
    out = ir.to_model(ctx.graph)
    assert [n.op_type for n in out.graph.node] == ["Conv", "MaxPool", act, "QuantizeLinear", "DequantizeLinear"]
    x = np.random.default_rng(1).normal(size=(2, 3, 9, 9)).astype(np.float32)
    np.testing.assert_array_equal(run_onnx(out, {"x": x}), run_onnx(model, {"x": x}))


@pytest.mark.parametrize("kwargs", [{"extra_reader": True}, {"pool_outputs": ("y", "idx")}, {"no_q": True}])
def test_activation_stays_where_moving_it_would_change_something(kwargs):
    model = conv_act_pool(**kwargs)
    ctx = Context(graph=ir.to_graph(model), report=Report())
    assert not SinkActivationBelowMaxPool().run(ctx).modified


def test_onnxruntime_target_keeps_the_rgb_stem_and_its_pool_float(model_paths, calib_files):
    result = oq.quantize(model_paths["resnet_mini"], "onnxruntime", calib_files["resnet_mini"][0], progress=False)
    stem = result.report.node_status("/stem/stem.0/Conv")
    assert not stem.quantized and stem.reason.startswith("3 input channels < 4")
    pool = result.report.node_status("/pool/MaxPool")
    assert not pool.quantized and "inputs arrive in float" in pool.reason
    ops = [n.op_type for n in result.model.graph.node if n.op_type != "DequantizeLinear"]
    assert ops[:4] == ["Conv", "MaxPool", "Relu", "QuantizeLinear"]  # quantization starts after the pool


def test_min_input_channels_is_validated(tmp_path):
    assert load_target("onnxruntime").ops["Conv"].min_input_channels == 4
    for body, message in (('[ops.MatMul]\ninputs = { 0 = "activation" }\nmin_input_channels = 4\n', "Conv and ConvTranspose only"),
                          ('[ops.Conv]\ninputs = { 0 = "activation" }\nmin_input_channels = -1\n', "non-negative integer")):
        f = tmp_path / "t.toml"
        f.write_text('name = "t"\nextends = "onnxruntime"\n' + body)
        with pytest.raises(OqError, match=message):
            load_target(f)
