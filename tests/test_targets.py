"""Targets as data: built-ins, user files that extend them, rejected files, constraints met, side files."""
import json
import struct

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import models
import oq
from conftest import run_onnx
from oq.errors import OqError
from oq.target import builtin_names, load_target

# SQNR floors of test_every_target_meets_its_constraints.  The reference models' weights are committed fixtures, so
# every machine quantizes the same ONNX models: the measurements below are identical (to 0.001 dB) on AVX512-VNNI
# (AMD EPYC) and on AVX2 (qemu -cpu Haswell).  Each listed floor sits 0.5-0.6 dB under its measurement, room for
# onnxruntime's float kernels and small calibration changes, not for retrained models (re-freezing the weights means
# measuring again).  Every pair not listed needs 25.0 dB: the lowest of them measured 25.8 dB on both (mlp/vitis;
# then mlp/tensorrt 26.1, decoder/tensorrt 26.9), a 0.8 dB margin.
# Power-of-two per-tensor weight scales cost Vitis accuracy on the decoder, whose grouped ConvTranspose channels
# differ in scale: measured 25.3 dB with cross-layer equalization on AVX512-VNNI and on AVX2 (23.6 dB without).
MIN_SQNR_DB = {("vitis", "decoder"): 24.8}
# FP8 E4M3 keeps 3 mantissa bits: a relative error per value that int8 only reaches near its range limits (output
# layers in float): measured 25.6 dB (resnet_mini) and 25.4 dB (mobilenet_mini) on AVX512-VNNI and on AVX2.
MIN_SQNR_DB.update({("tensorrt_fp8", "resnet_mini"): 25.0, ("tensorrt_fp8", "mobilenet_mini"): 24.9})
BUILTINS = ("tensorrt", "onnxruntime", "openvino", "qnn", "qnn_w8a16", "vitis", "academic", "tensorrt_fp8")


def test_builtin_targets_load_and_describe():
    assert set(BUILTINS) <= set(builtin_names())
    for name in BUILTINS:
        t = load_target(name)
        assert t.name == name and t.summary()
        assert "specs:" in t.describe() and "ops:" in t.describe()


def write(tmp_path, text, name="t.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def qdq_signature(model):
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return [(n.op_type, [inits[i].tolist() if i in inits else i for i in n.input]) for n in model.graph.node]


def test_file_with_only_name_and_extends_behaves_like_the_builtin(tmp_path, model_paths, calib_files):
    path = write(tmp_path, 'name = "my_trt"\nextends = "tensorrt"\n')
    mine, builtin = load_target(path), load_target("tensorrt")
    assert mine.name == "my_trt" and mine.specs == builtin.specs and mine.ops == builtin.ops
    a = oq.quantize(model_paths["resnet_mini"], path, calib_files["resnet_mini"][0], progress=False)
    b = oq.quantize(model_paths["resnet_mini"], "tensorrt", calib_files["resnet_mini"][0], progress=False)
    assert qdq_signature(a.model) == qdq_signature(b.model)


def test_file_overrides_pieces(tmp_path, model_paths, calib_files):
    path = write(tmp_path, '''
name = "my_npu"
extends = "onnxruntime"
[specs.activation]
dtype = "int8"
symmetric = true
[specs.weight]
granularity = "per_tensor"
power_of_two = true
[ops.Add]
output = "float"
''')
    t = load_target(path)
    assert t.activation.dtype == "int8" and t.activation.symmetric and t.ops["Add"].output == "float"
    assert t.ops["Conv"] == load_target("onnxruntime").ops["Conv"]  # untouched pieces inherited
    result = oq.quantize(model_paths["resnet_mini"], path, calib_files["resnet_mini"][0], progress=False)
    inits = {i.name: numpy_helper.to_array(i) for i in result.model.graph.initializer}
    for n in result.model.graph.node:
        if n.op_type == "QuantizeLinear":
            assert inits[n.input[2]].dtype == np.int8 and inits[n.input[2]] == 0
        if n.op_type == "DequantizeLinear" and n.input[0] in inits and inits[n.input[0]].dtype == np.int8:
            s = inits[n.input[1]]
            assert s.ndim == 0 and np.log2(s) == np.round(np.log2(s))


@pytest.mark.parametrize("text,key,reason", [
    ('name = "x"\nextends = "tensorrt"\nfoo = 1\n', "foo", "unknown key"),
    ('name = "x"\nextends = "tensorrt"\n[specs.activation]\nbits = 4\n', "specs.activation.bits", "unknown key"),
    ('name = "x"\nextends = "tensorrt"\n[specs.activation]\nsymmetric = false\nzero_point = 0\n', "specs.activation",
     "asymmetric spec cannot fix the zero-point"),
    ('name = "x"\nextends = "tensorrt"\n[ops.Relu]\ninputs = { 0 = "weight" }\n', "ops.Relu.inputs.0",
     "per-channel spec 'weight' on an input that is not a weight of Relu"),
    ('name = "x"\nextends = "tensorrt"\n[ops.Conv]\ninputs = { 0 = "nope" }\n', "ops.Conv.inputs.0",
     "spec 'nope' is not defined"),
    ('name = "x"\nextends = "tensorrt"\n[ops.Conv]\noutput = "sometimes"\n', "ops.Conv.output", "must be one of"),
    ('name = "x"\nextends = "tensorrt"\n[ops.Conv]\nwhen = "sometimes"\n', "ops.Conv.when", "must be one of"),
    ('name = "x"\nextends = "tensorrt"\nfusions = ["conv_magic"]\n', "fusions", "unknown fusion pattern 'conv_magic'"),
    ('name = "x"\nextends = "tensorrt"\n[specs.activation]\ndtype = "int16"\n', "specs.activation.dtype",
     "needs opset >= 21"),
    ('name = "x"\nextends = "tensorrt"\n[specs.activation]\ndtype = "int3"\n', "specs.activation",
     "unsupported quantization dtype 'int3'"),
    ('name = "x"\nextends = "tensorrt"\n[specs.weight]\nquant_min = 5\nquant_max = 2\n', "specs.weight",
     "must be an increasing range"),
    ('name = "x"\nextends = "nosuch"\n', None, "unknown target 'nosuch'"),
    ('name = "x"\nextends = "tensorrt"\n[specs.activation]\ngranularity = "per_channel"\n',
     "specs.activation.granularity", "activations are quantized per tensor"),
    ('name = [1', None, "not valid TOML"),
])
def test_bad_target_files_are_rejected_with_file_key_and_reason(tmp_path, text, key, reason):
    path = write(tmp_path, text)
    with pytest.raises(OqError) as err:
        load_target(path)
    msg = str(err.value)
    assert str(path) in msg and reason in msg, msg
    if key:
        assert f"key '{key}'" in msg, msg


def check_constraints(model, target):
    """Walk every Q/DQ pair: dtypes, zero-points and scales as the target's specs demand."""
    t = load_target(target)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    act, wspecs = t.activation, [s for s in t.specs.values() if s is not t.activation]
    for n in model.graph.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        scale, zp = inits[n.input[1]], inits[n.input[2]]
        assert np.all(np.isfinite(scale)) and np.all(scale > 0), n.name
        is_weight = n.op_type == "DequantizeLinear" and n.input[0] in inits
        if is_weight and zp.dtype == np.int32:
            assert t.bias == "int32" and not zp.any()  # bias
            continue
        spec = act if not is_weight else next((s for s in wspecs if s.np_dtype == zp.dtype), act)
        assert zp.dtype == spec.np_dtype, (n.name, zp.dtype, spec.dtype)
        qmin, qmax = spec.qrange
        if spec.symmetric:
            center = 0 if spec.signed else (qmin + qmax + 1) // 2
            assert np.all(zp.astype(np.float32) == center), n.name
        if is_weight:
            q = inits[n.input[0]].astype(np.float32)
            assert q.min() >= qmin and q.max() <= qmax, n.name
            per_channel = scale.ndim == 1
            assert per_channel == (spec.granularity == "per_channel" and q.ndim > 1) or q.ndim <= 1, n.name
        else:
            assert scale.ndim == 0, "activations per tensor"
        if spec.power_of_two:
            np.testing.assert_array_equal(np.log2(scale), np.round(np.log2(scale)))


@pytest.mark.parametrize("target", BUILTINS)
@pytest.mark.parametrize("name", models.REFERENCE_MODELS)
def test_every_target_meets_its_constraints(name, target, model_paths, calib_files):
    result = oq.quantize(model_paths[name], target, calib_files[name][0], progress=False)
    onnx.checker.check_model(result.model, full_check=True)
    check_constraints(result.model, target)
    _, held_out = calib_files[name]
    from conftest import sqnr_db
    sqnr = sqnr_db(run_onnx(model_paths[name], held_out), run_onnx(result.model, held_out))
    assert sqnr >= MIN_SQNR_DB.get((target, name), 25.0), f"{name}/{target}: {sqnr:.1f} dB"


def test_tensorrt_side_files(tmp_path, model_paths, calib_files):
    result = oq.quantize(model_paths["resnet_mini"], "tensorrt", calib_files["resnet_mini"][0], progress=False)
    out = result.save(tmp_path / "m.trt.onnx")
    cache = (tmp_path / "m.trt.calib.cache").read_text().splitlines()
    ranges = json.loads((tmp_path / "m.trt.ranges.json").read_text())
    assert cache[0].startswith("TRT-") and cache[0].endswith("EntropyCalibration2")
    inits = {i.name: numpy_helper.to_array(i) for i in result.model.graph.initializer}
    q_scale = {n.input[0]: float(inits[n.input[1]]) for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    entries = dict(line.split(": ") for line in cache[1:])
    assert set(entries) == set(q_scale) == set(ranges)
    for name, hexval in entries.items():
        scale = struct.unpack(">f", bytes.fromhex(hexval))[0]
        assert scale == pytest.approx(q_scale[name], rel=1e-6)
        assert ranges[name] == pytest.approx(q_scale[name] * 127, rel=1e-6)
    assert str(tmp_path / "m.trt.calib.cache") in result.report.side_files and out.exists()


def weight_scales_by_consumer(model):
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    dq = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    return {n.op_type + ":" + n.name: inits[dq[n.input[1]].input[1]] for n in model.graph.node
            if len(n.input) > 1 and n.input[1] in dq}


def test_override_changes_spec_on_matching_nodes(model_paths, calib_files):
    result = oq.quantize(model_paths["resnet_mini"], "tensorrt", calib_files["resnet_mini"][0], progress=False,
                         overrides=["Conv=weight.granularity:per_tensor"])
    scales = weight_scales_by_consumer(result.model)
    assert all(v.ndim == 0 for k, v in scales.items() if k.startswith("Conv:"))
    assert all(v.ndim == 1 for k, v in scales.items() if k.startswith("Gemm:"))
    assert not result.report.warnings


def test_overrides_the_target_cannot_honour_are_reported(model_paths, calib_files):
    result = oq.quantize(model_paths["mlp"], "tensorrt", calib_files["mlp"][0], progress=False,
                         overrides=["Gemm=activation.dtype:int16", "NoSuchNode=dtype:uint8",
                                    "Gemm=activation.granularity:per_channel"])
    w = result.report.warnings
    assert any("not honoured" in x and "int16 Q/DQ needs opset >= 21" in x for x in w), w
    assert any("NoSuchNode=dtype:uint8: matches no quantized node" in x for x in w), w
    assert any("per-channel needs a weight input" in x for x in w), w
    inits = {i.name: numpy_helper.to_array(i) for i in result.model.graph.initializer}
    assert all(inits[n.input[2]].dtype == np.int8 for n in result.model.graph.node if n.op_type == "QuantizeLinear")


@pytest.mark.parametrize("text,msg", [("Conv", "expected NODE_OR_OP=key:value"), ("Conv=bits:4", "unknown key 'bits'"),
                                      ("Conv=bias.dtype:int8", "role 'bias'"), ("Conv=symmetric:maybe", "true or false"),
                                      ("Gemm=dtype:int3", "unsupported quantization dtype")])
def test_bad_override_syntax(text, msg, model_paths, calib_files):
    with pytest.raises(OqError, match=msg):
        oq.quantize(model_paths["mlp"], "tensorrt", calib_files["mlp"][0], progress=False, overrides=[text])


def test_fakequant_function_matches_quantize_dequantize():
    from oq.fakequant import reference
    from onnx.reference import ReferenceEvaluator
    from oq.fakequant import function_proto
    from onnx import helper, TensorProto
    x = np.linspace(-3, 3, 61, dtype=np.float32)
    node = helper.make_node("FakeQuant", ["x", "s", "z", "lo", "hi"], ["y"], domain="oq")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                            for n in ("x", "s", "z", "lo", "hi")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("oq", 1)],
                              functions=[function_proto(17)])
    feeds = {"x": x, **{k: np.array(v, np.float32) for k, v in (("s", 0.25), ("z", 1), ("lo", -8), ("hi", 7))}}
    got = ReferenceEvaluator(model).run(None, feeds)[0]
    np.testing.assert_array_equal(got, reference(x, 0.25, 1, -8, 7))
    assert got.min() == -9 * 0.25 and got.max() == 6 * 0.25  # clipped to the 4-bit grid around zero-point 1
    np.testing.assert_array_equal(run_onnx(model, feeds), got)  # onnxruntime inlines the function


@pytest.mark.parametrize("wbits,abits", [(4, 8), (2, 6), (12, 16)])
def test_academic_any_bit_width(wbits, abits, model_paths, calib_files):
    result = oq.quantize(model_paths["resnet_mini"], "academic", calib_files["resnet_mini"][0], progress=False,
                         weight_bits=wbits, act_bits=abits)
    onnx.checker.check_model(result.model, full_check=True)
    inits = {i.name: numpy_helper.to_array(i) for i in result.model.graph.initializer}
    fq = [n for n in result.model.graph.node if n.op_type == "FakeQuant"]
    assert fq and all(n.domain == "oq" for n in fq)
    assert not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in result.model.graph.node)
    ranges = {(float(inits[n.input[3]]), float(inits[n.input[4]])) for n in fq}
    assert (-(2 ** (wbits - 1)) + 1, 2 ** (wbits - 1) - 1) in ranges  # narrow symmetric weights
    assert (0, 2 ** abits - 1) in ranges
    _, held = calib_files["resnet_mini"]
    assert np.isfinite(run_onnx(result.model, held, optimize=True)).all()


def test_more_bits_are_more_accurate(model_paths, calib_files):
    _, held = calib_files["transformer"]
    ref = run_onnx(model_paths["transformer"], held)
    from conftest import sqnr_db
    got = [sqnr_db(ref, run_onnx(oq.quantize(model_paths["transformer"], "academic", calib_files["transformer"][0],
                                             progress=False, weight_bits=b, act_bits=b).model, held))
           for b in (4, 6, 8, 12)]
    assert got == sorted(got) and got[-1] - got[0] > 20, got


def test_bits_beyond_the_container_are_refused_for_qdq_targets(model_paths, calib_files):
    with pytest.raises(OqError, match="12-bit activations need int16 Q/DQ .* use --target academic"):
        oq.quantize(model_paths["mlp"], "tensorrt", calib_files["mlp"][0], progress=False, act_bits=12)
    result = oq.quantize(model_paths["mlp"], "tensorrt", calib_files["mlp"][0], progress=False, weight_bits=4)
    inits = {i.name: numpy_helper.to_array(i) for i in result.model.graph.initializer}
    w = [inits[n.input[0]] for n in result.model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert all(a.dtype == np.int8 and a.min() >= -7 and a.max() <= 7 for a in w)


def test_qoperator_export_for_onnxruntime(model_paths, calib_files):
    qdq = oq.quantize(model_paths["resnet_mini"], "onnxruntime", calib_files["resnet_mini"][0], progress=False)
    qop = oq.quantize(model_paths["resnet_mini"], "onnxruntime", calib_files["resnet_mini"][0], progress=False,
                      export_format="qoperator")
    ops = [n.op_type for n in qop.model.graph.node]
    assert ops.count("QLinearConv") == 8 and ops.count("Conv") == 1  # the 3-channel stem stays float
    _, held = calib_files["resnet_mini"]
    np.testing.assert_allclose(run_onnx(qop.model, held), run_onnx(qdq.model, held, optimize=True), atol=1e-5)
    with pytest.raises(OqError, match="needs an 8-bit Q/DQ target"):
        oq.quantize(model_paths["mlp"], "academic", calib_files["mlp"][0], progress=False, export_format="qoperator")


W4 = '''
name = "w4"
extends = "onnxruntime"
opset_min = 21
[specs.weight]
dtype = "int4"
granularity = "per_block"
block_size = 16
narrow_range = false
'''


def test_int4_per_block_weights(tmp_path, model_paths, calib_files):
    path = write(tmp_path, W4)
    result = oq.quantize(model_paths["transformer"], path, calib_files["transformer"][0], progress=False)
    onnx.checker.check_model(result.model, full_check=True)
    inits = {i.name: i for i in result.model.graph.initializer}
    dqs = [n for n in result.model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
           and inits[n.input[0]].data_type == onnx.TensorProto.INT4]
    assert dqs
    for n in dqs:
        attrs = {a.name: a.i for a in n.attribute}
        w = numpy_helper.to_array(inits[n.input[0]]).astype(np.int8)
        scale = numpy_helper.to_array(inits[n.input[1]])
        assert attrs["block_size"] == 16 and w.min() >= -8 and w.max() <= 7
        expect = list(w.shape)
        expect[attrs["axis"]] = -(-w.shape[attrs["axis"]] // 16)
        assert list(scale.shape) == expect
    _, held = calib_files["transformer"]
    from conftest import sqnr_db
    assert sqnr_db(run_onnx(model_paths["transformer"], held), run_onnx(result.model, held)) > 20


@pytest.mark.parametrize("text,key,reason", [
    ('name = "x"\nextends = "onnxruntime"\n[specs.weight]\ndtype = "int4"\n', "specs.weight.dtype",
     "int4 Q/DQ needs opset >= 21"),
    ('name = "x"\nextends = "onnxruntime"\nopset_min = 21\n[specs.weight]\ngranularity = "per_block"\n',
     "specs.weight", "per_block needs a block_size"),
    ('name = "x"\nextends = "onnxruntime"\nopset_min = 21\n[specs.activation]\ndtype = "uint4"\n',
     "specs.activation.dtype", "4-bit dtypes are for weights"),
    ('name = "x"\nextends = "onnxruntime"\n[specs.weight]\ngranularity = "per_block"\nblock_size = 32\n',
     "specs.weight.dtype", "per-block Q/DQ needs opset >= 21"),
])
def test_4bit_and_block_constraints_are_checked(tmp_path, text, key, reason):
    with pytest.raises(OqError) as err:
        load_target(write(tmp_path, text))
    assert f"key '{key}'" in str(err.value) and reason in str(err.value), str(err.value)


def test_output_layers_are_the_last_weighted_layers(model_paths):
    from oq.passes.annotate import output_layers

    decoder = oq.prepare(model_paths["decoder"]).graph
    assert output_layers(decoder) == {"/out/Conv"}
    transformer = oq.prepare(model_paths["transformer"]).graph
    found = output_layers(transformer)  # hidden = x + fc2(...), x = tokens + o(...): both reach the output
    assert len(found) == 2 and all(n.startswith(("/fc2/", "/attn/o/")) for n in found), found


def test_fp8_target_keeps_output_layers_float(model_paths, calib_files):
    result = oq.quantize(model_paths["decoder"], "tensorrt_fp8", calib_files["decoder"][0], progress=False)
    rec = result.report.node_status("/out/Conv")
    assert not rec.quantized and "output layer" in rec.reason
    assert result.report.node_status("/up2/ConvTranspose").quantized
    assert not oq.load_target("tensorrt").float_output_layers


def test_float_output_layers_must_be_a_bool(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text('name = "t"\nextends = "tensorrt"\nfloat_output_layers = "yes"\n')
    with pytest.raises(OqError, match="float_output_layers.*must be true or false"):
        load_target(f)
