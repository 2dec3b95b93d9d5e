"""Empirical bias correction: the correction equals the numpy-computed output mean shift, biases are added where a
layer had none (int32 where the target wants), and held-out accuracy of the depthwise-separable net improves."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import models
import oq
from conftest import run_onnx, sqnr_db

PER_TENSOR = ("Conv=weight.granularity:per_tensor", "Gemm=weight.granularity:per_tensor")


def depthwise_model(bias: bool):
    """x -> depthwise 3x3 Conv (8 channels, taps of very different sizes: per-tensor weights round the small ones
    away, shifting the channel means) -> y."""
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(8, 1, 3, 3)) * np.logspace(-2, 0, 8).reshape(8, 1, 1, 1)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    inputs = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.normal(size=8).astype(np.float32), "b"))
        inputs.append("b")
    node = helper.make_node("Conv", inputs, ["y"], group=8, pads=[1, 1, 1, 1], name="dw")
    graph = helper.make_graph([node], "dw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 6, 6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _inputs(n, seed):
    rng = np.random.default_rng(seed)  # positive mean: a weight error then shifts the output mean
    return {"x": (rng.normal(size=(n, 8, 6, 6)) + 1.0).astype(np.float32)}


def _depthwise_conv(x, w):
    """numpy depthwise 3x3 convolution with pads 1 (cross-correlation, as ONNX Conv)."""
    padded = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (1, 1), (1, 1)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))  # N, C, H, W, 3, 3
    return np.einsum("nchwij,cij->nchw", windows, w[:, 0].astype(np.float64))


def _initializer(model, name):
    return next(numpy_helper.to_array(i) for i in model.graph.initializer if i.name == name)


def _qdq(model, tensor):
    """(scale, zero point) of the DequantizeLinear reading `tensor`'s quantized form."""
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith(tensor))
    return _initializer(model, dq.input[1]), _initializer(model, dq.input[2]), dq


def test_correction_matches_numpy_on_a_depthwise_conv(tmp_path):
    model = depthwise_model(bias=True)
    calib = _inputs(32, 0)
    np.savez(tmp_path / "c.npz", **calib)
    out = oq.quantize(model, "tensorrt", tmp_path / "c.npz", progress=False, overrides=PER_TENSOR,
                      algo="bias-correction").model
    x = calib["x"]
    # the quantized model's input to the layer (per-tensor int8 Q/DQ) and its weights on their grid
    sx, zx, _ = _qdq(out, "x")
    xq = (np.clip(np.rint(x / sx) + zx, -128, 127) - zx) * sx
    sw, zw, dq = _qdq(out, "w")
    wq = (_initializer(out, dq.input[0]).astype(np.float32) - zw) * sw
    w, b = _initializer(model, "w"), _initializer(model, "b")
    shift = _depthwise_conv(xq, wq).mean(axis=(0, 2, 3)) - _depthwise_conv(x, w).mean(axis=(0, 2, 3))
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    corrected = _initializer(out, conv.input[2])
    assert np.abs(shift).max() > 1e-3  # the fixture really shifts the means
    np.testing.assert_allclose(corrected, b - shift, rtol=0, atol=1e-6)
    # the quantized model's channel means now match the float model's on the calibration data
    mean = lambda m: run_onnx(m, calib).mean(axis=(0, 2, 3))
    plain = oq.quantize(model, "tensorrt", tmp_path / "c.npz", progress=False, overrides=PER_TENSOR).model
    assert np.abs(mean(out) - mean(model)).max() < 0.05 * np.abs(mean(plain) - mean(model)).max()


def test_a_layer_without_bias_gets_an_int32_bias_where_the_target_quantizes_biases(tmp_path):
    model = depthwise_model(bias=False)
    np.savez(tmp_path / "c.npz", **_inputs(32, 0))
    result = oq.quantize(model, "vitis", tmp_path / "c.npz", progress=False, algo="bias-correction")
    out = result.model
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    assert len(conv.input) == 3  # a bias input was added ...
    producer = next(n for n in out.graph.node if conv.input[2] in n.output)
    assert producer.op_type == "DequantizeLinear"  # ... and quantized to int32 from the corrected value
    assert _initializer(out, producer.input[0]).dtype == np.int32
    notes = next(p.notes for p in result.report.passes if p.name == "bias-correction")
    assert "1 layers corrected in 1 passes over the data (1 biases added)" in notes[0]
    onnx.checker.check_model(out)


def test_matmul_without_a_following_add_is_reported(tmp_path):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(16, 8)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    np.savez(tmp_path / "c.npz", x=rng.normal(size=(32, 16)).astype(np.float32))
    result = oq.quantize(model, "tensorrt", tmp_path / "c.npz", progress=False, algo="bias-correction")
    notes = next(p.notes for p in result.report.passes if p.name == "bias-correction")
    assert "mm: not corrected (MatMul without a following Add to hold a bias)" in notes


def test_depthwise_separable_net_gains_with_per_tensor_weights(model_paths, calib_files):
    """mobilenet_mini at W8A8 with per-tensor weights, held-out SQNR on 128 samples (32 vary by +-1 dB between
    draws, more than the gain)."""
    path, calib = model_paths["mobilenet_mini"], calib_files["mobilenet_mini"][0]
    held = models.make_inputs("mobilenet_mini", 128, seed=1)
    ref = run_onnx(path, held)
    sqnr = {}
    for algo in (None, "bias-correction"):
        result = oq.quantize(path, "tensorrt", calib, progress=False, overrides=PER_TENSOR, algo=algo)
        sqnr[algo] = sqnr_db(ref, run_onnx(result.model, held))
    names = [p.name for p in result.report.passes]
    assert names.index("calibrate") < names.index("bias-correction-reference") \
        < names.index("bias-correction") < names.index("insert-qdq")
    print(f"mobilenet_mini W8A8 per-tensor weights: {sqnr[None]:.2f} -> {sqnr['bias-correction']:.2f} dB")
    assert sqnr["bias-correction"] > sqnr[None] + 0.4  # measured: 33.01 -> 33.74 dB


def test_rtn_output_is_unchanged_by_the_new_options(model_paths, calib_files):
    path, calib = model_paths["mlp"], calib_files["mlp"][0]
    default = oq.quantize(path, "tensorrt", calib, progress=False).model.SerializeToString()
    assert oq.quantize(path, "tensorrt", calib, progress=False, algo="rtn").model.SerializeToString() == default
    corrected = oq.quantize(path, "tensorrt", calib, progress=False, algo="rtn+bias-correction")
    assert corrected.model.SerializeToString() != default
