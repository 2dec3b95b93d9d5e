"""AdaRound weight reconstruction (--algo adaround): the layers' GEMM form against onnxruntime, the hand-written
gradient against autograd, the exact round trip of the learned codes through insert-qdq, held-out accuracy against
round-to-nearest, an output identical in structure to round-to-nearest's, and the command line."""
import json
import re
import subprocess
import sys

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import models
import oq
import oq.bridge.adaround as adaround
from oq.cli import main
from oq.errors import OqError
from oq.gemm_rows import gemm_layer
from oq.passes.reconstruct import _grid_values, _nearest_range
from oq.spec import QParams, QuantSpec, quantize_array, weight_qparams

from conftest import run_onnx, sqnr_db

# ---------------------------------------------------------------------------------------------------------------
# the GEMM form of each supported layer is its output, exactly


def _ort(op, x, w, attrs):
    node = helper.make_node(op, ["x", "w"], ["y"], **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return run_onnx(model, {"x": x})


@pytest.mark.parametrize("op, x_shape, w_shape, attrs", [
    ("Conv", (2, 6, 9, 8), (4, 3, 3, 2), dict(group=2, strides=[2, 1], pads=[1, 0, 2, 1], dilations=[1, 2])),
    ("Conv", (2, 4, 7, 7), (4, 1, 3, 3), dict(group=4, pads=[1, 1, 1, 1])),  # depthwise
    ("Conv", (2, 3, 10), (5, 3, 3), dict(strides=[3], pads=[2, 0])),
    ("Conv", (1, 2, 7, 6), (3, 2, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    ("ConvTranspose", (2, 6, 5, 4), (6, 2, 4, 3),
     dict(group=3, strides=[2, 3], pads=[1, 0, 2, 1], output_padding=[1, 0], dilations=[1, 2])),
    ("ConvTranspose", (1, 3, 6, 6), (3, 2, 3, 3), dict(pads=[3, 3, 3, 3])),  # pads beyond the kernel: a crop
    ("Gemm", (5, 7), (3, 7), dict(transB=1)),
    ("Gemm", (7, 5), (7, 3), dict(transA=1)),
    ("MatMul", (2, 5, 7), (7, 3), {}),
])
def test_gemm_rows_reproduce_the_layer(op, x_shape, w_shape, attrs):
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=x_shape).astype(np.float32), rng.normal(size=w_shape).astype(np.float32)
    y = _ort(op, x, w, attrs)
    node = gs.Node(op, "n", attrs, [gs.Variable("x"), gs.Constant("w", w)], [gs.Variable("y")])
    layer = gemm_layer(node, w)
    assert not isinstance(layer, str), layer
    rows, wg = layer.rows(x), w.reshape(-1)[layer.index]
    out = np.concatenate([rows[g] @ wg[g] for g in range(layer.groups)], axis=1)
    ref = np.moveaxis(y, 1, -1).reshape(-1, y.shape[1]) if op.startswith("Conv") else y.reshape(-1, y.shape[-1])
    assert layer.row_count(x.shape) == ref.shape[0]
    np.testing.assert_allclose(out, ref, atol=1e-5)
    sub = np.array([0, ref.shape[0] - 1])
    np.testing.assert_array_equal(layer.rows(x, sub), rows[:, sub])


def test_unsupported_layers_say_why():
    w = np.zeros((2, 3, 4), np.float32)
    node = gs.Node("MatMul", "m", {}, [gs.Variable("x"), gs.Constant("w", w)], [gs.Variable("y")])
    assert gemm_layer(node, w) == "MatMul weight with batch dimensions"
    w = np.zeros((2, 2, 3, 3), np.float32)
    node = gs.Node("ConvTranspose", "t", {"output_shape": [8, 8]}, [gs.Variable("x"), gs.Constant("w", w)],
                   [gs.Variable("y")])
    assert "output_shape" in gemm_layer(node, w)


# ---------------------------------------------------------------------------------------------------------------
# the optimisation


def _layer(rng, k=12, n=5, bits=4, zp=1, rows=300):
    w = rng.normal(size=(n, k)).astype(np.float32) * 0.1
    qmax = 2 ** (bits - 1) - 1
    scale = (np.abs(w).max(1, keepdims=True) / qmax * 0.8).astype(np.float32)  # some weights clip
    index = np.arange(w.size).reshape(n, k).T[None]
    # correlated inputs: with uncorrelated ones (a diagonal Hessian) rounding to nearest is already optimal
    x = (rng.normal(size=(1, rows, 4)) @ rng.normal(size=(4, k)) + 0.3 * rng.normal(size=(1, rows, k)))
    x = x.astype(np.float32)
    return adaround.Layer(w, scale, np.full_like(scale, zp), -qmax, qmax, index, x)


@pytest.mark.parametrize("beta", [None, 20.0, 2.0])
def test_written_out_gradient_is_autograd_s(beta):
    p = adaround.Problem(_layer(np.random.default_rng(1)))
    v = (p.v0 + 2 * torch.randn(p.v0.shape, generator=torch.Generator().manual_seed(0))).requires_grad_()
    x = p.rows[:, :64]
    p.loss(v, x, 0.01, beta).backward()
    with torch.no_grad():
        mine = p.gradient(v, x, 0.01, beta)
    torch.testing.assert_close(mine, v.grad, rtol=1e-4, atol=1e-6 * float(v.grad.abs().max()))


def test_initial_soft_rounding_is_the_fraction_and_beta_anneals():
    frac = np.linspace(0, 0.999, 50)
    h = adaround.rectified_sigmoid(torch.as_tensor(adaround.initial_v(frac))).numpy()
    np.testing.assert_allclose(h, frac, atol=1e-9)
    s = adaround.Settings(iters=100)
    assert adaround.beta_at(19, s) is None and adaround.beta_at(20, s) == 20.0
    assert adaround.beta_at(99, s) == pytest.approx(2.0 + 18.0 / 80)
    assert adaround.effective_lr(adaround.Settings(iters=10000)) == pytest.approx(1e-3)


def test_learning_lowers_the_layer_error_and_stays_next_to_nearest():
    layer = _layer(np.random.default_rng(2), k=32, n=8, rows=2000)
    spec = QuantSpec("int8", symmetric=True, quant_min=-7, quant_max=7)
    nearest = quantize_array(layer.w, QParams(layer.scale.reshape(-1), np.ones(8, np.int8), 0, spec))
    out = adaround.learn(layer, adaround.Settings(iters=300), nearest)
    assert out.mse_learned < 0.8 * out.mse_nearest
    assert np.abs(out.codes - out.nearest).max() == 1 and 0 < out.changed < 0.5
    assert out.codes.min() >= -7 and out.codes.max() <= 7


# ---------------------------------------------------------------------------------------------------------------
# the write-back: quantize_array (and FakeQuant's float32 division) give back exactly the learned codes

@pytest.mark.parametrize("spec, axis", [
    (QuantSpec("int8", granularity="per_channel"), 0),
    (QuantSpec("int8", narrow_range=True, granularity="per_channel", quant_min=-7, quant_max=7), 0),
    (QuantSpec("uint8", symmetric=False), None),
    (QuantSpec("int4", granularity="per_block", block_size=4), 1),
    (QuantSpec("int16", granularity="per_channel"), 0),
    (QuantSpec("uint8", symmetric=False, granularity="per_channel", quant_min=0, quant_max=3), 0),
])
def test_learned_codes_survive_the_round_trip_exactly(spec, axis):
    rng = np.random.default_rng(3)
    w = (rng.standard_cauchy(size=(16, 24)) * 0.05).astype(np.float32)
    qp = weight_qparams(w, spec, axis)
    nearest = quantize_array(w, qp).astype(np.int64)
    qmin, qmax = spec.qrange
    codes = np.clip(nearest + rng.integers(-1, 2, size=w.shape), qmin, qmax)
    values, back, fallback = _grid_values(codes, qp, np.float32, w)
    assert fallback == 0 and values.dtype == np.float32
    np.testing.assert_array_equal(quantize_array(values, qp), codes)
    np.testing.assert_array_equal(back, codes)
    scale, zp = qp.expanded(w.shape)  # FakeQuant: Round(x / scale) in float32, then + zero_point
    fq = np.rint(values / scale.astype(np.float32)) + zp.astype(np.float32)
    np.testing.assert_array_equal(fq, codes)


def test_a_grid_point_float16_cannot_hold_keeps_its_nearest_code():
    spec = QuantSpec("int8", granularity="per_channel")
    w = np.array([[1e-6, 2e-6, -3e-7, 0.5]], np.float16)  # a grid with steps below float16's resolution
    qp = weight_qparams(w.astype(np.float32), spec, 0)
    nearest = quantize_array(w.astype(np.float32), qp).astype(np.int64)
    codes = np.clip(nearest + 1, -128, 127)
    values, back, fallback = _grid_values(codes, qp, np.float16, w)
    assert values.dtype == np.float16
    np.testing.assert_array_equal(quantize_array(values.astype(np.float32), qp), back)
    assert all(b in (c, n) for b, c, n in zip(back.ravel(), codes.ravel(), nearest.ravel()))
    assert fallback == int((back != codes).sum())


def test_learning_never_reaches_past_nearest_s_largest_magnitude():
    """Per scale group, |q - z| stays within what rounding to nearest gives (a saturation guard relies on it)."""
    spec = QuantSpec("uint8", symmetric=False, granularity="per_channel")
    qp = QParams(np.array([1.0, 1.0], np.float32), np.array([10, 100], np.uint8), 0, spec)
    nearest = np.array([[8, 13, 10], [100, 90, 255]])
    lo, hi = _nearest_range(nearest, qp)
    np.testing.assert_array_equal(lo, [[7, 7, 7], [0, 0, 0]])
    np.testing.assert_array_equal(hi, [[13, 13, 13], [255, 255, 255]])
    blocked = QuantSpec("int4", granularity="per_block", block_size=2)
    qp = QParams(np.ones((1, 2), np.float32), np.zeros((1, 2), np.int8), 1, blocked, 2)
    lo, hi = _nearest_range(np.array([[1, -3, 2, 0]]), qp)
    np.testing.assert_array_equal(hi, [[3, 3, 2, 2]])
    np.testing.assert_array_equal(lo, [[-3, -3, -2, -2]])


# ---------------------------------------------------------------------------------------------------------------
# a reference model end to end

@pytest.fixture(scope="module")
def resnet_w4(tmp_path_factory):
    """resnet_mini, academic target, 4-bit weights: (float model, held-out feed, round-to-nearest, adaround)."""
    path = models.build("resnet_mini")
    calib = tmp_path_factory.mktemp("adaround") / "calib.npz"
    np.savez(calib, **models.make_inputs("resnet_mini", 64))
    held = models.make_inputs("resnet_mini", 32, seed=1)
    kw = dict(target="academic", calib=calib, weight_bits=4, progress=False)
    return path, held, oq.quantize(path, **kw), oq.quantize(path, algo="adaround", **kw)


def _initializers(model):
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def _fakequant_weights(model):
    """weight initializer -> (its values, scale, zero point, qmin, qmax) for every FakeQuant reading an initializer."""
    inits = _initializers(model)
    return {n.input[0]: tuple(inits[i] for i in n.input[:5]) for n in model.graph.node
            if n.op_type == "FakeQuant" and n.input[0] in inits}


def test_adaround_beats_round_to_nearest_on_held_out_data(resnet_w4):
    # measured: 16.0 dB round-to-nearest, 27.7 dB adaround (24.5..27.7 dB over three row-sampling seeds)
    path, held, rtn, ada = resnet_w4
    ref = run_onnx(onnx.load(str(path)), held)
    s_rtn, s_ada = sqnr_db(ref, run_onnx(rtn.model, held)), sqnr_db(ref, run_onnx(ada.model, held))
    assert s_ada > s_rtn + 5.0, (s_rtn, s_ada)
    record = ada.report.calibration["reconstruction"]
    assert len(record["layers"]) == 10 and all(e["mse_learned"] < e["mse_nearest"] for e in record["layers"])
    notes = next(p.notes for p in ada.report.passes if p.name == "adaround")
    assert re.search(r"output MSE \S+ -> \S+ \(\d+\.\d dB\), \d+\.\d% of \d+ weights rounded away", "\n".join(notes))


def test_learned_codes_are_within_one_of_nearest(resnet_w4):
    _, _, rtn, ada = resnet_w4
    near, learned = _fakequant_weights(rtn.model), _fakequant_weights(ada.model)
    assert near.keys() == learned.keys() and len(near) == 10
    changed = 0
    for name, (w, scale, zp, qmin, qmax) in near.items():
        lw, lscale, lzp, _, _ = learned[name]
        np.testing.assert_array_equal(scale, lscale)
        np.testing.assert_array_equal(zp, lzp)
        q_near = np.clip(np.rint(w / scale) + zp, qmin, qmax)  # what FakeQuant computes, in float32
        q_learned = np.rint(lw / scale) + zp
        assert q_learned.min() >= qmin and q_learned.max() <= qmax
        np.testing.assert_array_equal((q_learned - zp) * scale, lw)  # the weight sits on its grid point exactly
        assert np.abs(q_learned - q_near).max() <= 1
        changed += int((q_learned != q_near).sum())
    assert changed > 0


def test_output_is_valid_and_shaped_as_round_to_nearest(resnet_w4):
    _, _, rtn, ada = resnet_w4
    onnx.checker.check_model(ada.model, full_check=True)
    sig = [(n.op_type, n.domain, n.name, list(n.input), list(n.output)) for n in rtn.model.graph.node]
    assert sig == [(n.op_type, n.domain, n.name, list(n.input), list(n.output)) for n in ada.model.graph.node]
    a, b = _initializers(rtn.model), _initializers(ada.model)
    assert a.keys() == b.keys()
    weights = set(_fakequant_weights(rtn.model))
    assert {k for k in a if not np.array_equal(a[k], b[k])} == weights  # scales, zero points, biases: untouched


def test_qdq_codes_are_exactly_the_learned_ones(tmp_path, monkeypatch):
    """tensorrt (int8 Q/DQ): the int8 initializers insert-qdq writes are the codes the optimisation returned, and
    every Q/DQ node and scale is the same as with round-to-nearest."""
    path = models.build("resnet_mini")
    calib = tmp_path / "calib.npz"
    np.savez(calib, **models.make_inputs("resnet_mini", 16))
    outcomes = []
    learn = adaround.learn

    def spy(layer, settings, nearest):
        outcomes.append(learn(layer, settings, nearest))
        return outcomes[-1]
    monkeypatch.setattr(adaround, "learn", spy)
    rtn = oq.quantize(path, "tensorrt", calib, progress=False)
    ada = oq.quantize(path, "tensorrt", calib, progress=False, algo="adaround", algo_iters=200)
    layers = ada.report.calibration["reconstruction"]["layers"]
    assert len(outcomes) == len(layers) == 10
    a, b = _initializers(rtn.model), _initializers(ada.model)
    assert [n.op_type for n in rtn.model.graph.node] == [n.op_type for n in ada.model.graph.node]
    assert {k for k in a if not np.array_equal(a[k], b[k])} == \
        {f"{e['weight']}_quantized" for e in layers if e["kept"] == "learned"}
    for entry, out in zip(layers, outcomes):
        q = b[f"{entry['weight']}_quantized"]
        assert q.dtype == np.int8
        np.testing.assert_array_equal(q, out.codes if entry["kept"] == "learned" else out.nearest)
        np.testing.assert_array_equal(a[f"{entry['weight']}_quantized"], out.nearest)
        assert np.abs(q.astype(int) - out.nearest).max() <= 1
        per_channel = np.abs(out.nearest).reshape(len(q), -1).max(1)
        assert (np.abs(q.astype(int)).reshape(len(q), -1).max(1) <= per_channel).all()


def test_result_does_not_depend_on_batching_or_memory_bound(tmp_path):
    path = models.build("mobilenet_mini")
    calib = tmp_path / "calib.npz"
    np.savez(calib, **models.make_inputs("mobilenet_mini", 12))
    kw = dict(target="academic", calib=calib, weight_bits=4, algo="adaround", algo_iters=20, progress=False)
    first = oq.quantize(path, **kw).model.SerializeToString()
    assert oq.quantize(path, batch_size=5, max_memory_mb=0.05, **kw).model.SerializeToString() == first


def test_rtn_is_the_default_whichever_way_it_is_asked(tmp_path):
    path = models.build("mlp")
    calib = tmp_path / "calib.npz"
    np.savez(calib, **models.make_inputs("mlp", 16))
    default = oq.quantize(path, "tensorrt", calib, progress=False)
    assert [p.name for p in default.report.passes].count("adaround") == 0
    assert oq.quantize(path, "tensorrt", calib, progress=False, algo="rtn", device="cuda",
                       algo_iters=5).model.SerializeToString() == default.model.SerializeToString()


# ---------------------------------------------------------------------------------------------------------------
# options and the command line

@pytest.mark.parametrize("kwargs, message", [
    ({"algo": "bogus"}, "--algo: unknown algorithm 'bogus'; choose rtn, adaround, brecq, qdrop"),
    ({"algo": "adaround", "device": "tpu"}, "--device: unknown device 'tpu'"),
    ({"algo": "adaround", "algo_iters": 0}, "--algo-iters: must be >= 1, got 0"),
])
def test_options_are_validated(kwargs, message):
    with pytest.raises(OqError, match=re.escape(message)):
        oq.RunConfig(**kwargs)


@pytest.fixture(scope="module")
def mlp_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaround_cli")
    np.savez(root / "calib.npz", **models.make_inputs("mlp", 32))
    return models.build("mlp"), root / "calib.npz", root


def test_cli_runs_adaround(mlp_files, capsys):
    model, calib, root = mlp_files
    out, report = root / "q.onnx", root / "r.json"
    assert main(["run", str(model), "--calib", str(calib), "-o", str(out), "--report", str(report), "--algo",
                 "adaround", "--algo-iters", "50", "--quiet"]) == 0
    onnx.checker.check_model(onnx.load(str(out)))
    saved = json.loads(report.read_text())
    assert saved["calibration"]["reconstruction"]["iterations"] == 50
    assert json.loads(next(p.value for p in onnx.load(str(out)).metadata_props if p.key == "oq.options"))["algo"] \
        == "adaround"
    assert any(p["name"] == "adaround" and p["modified"] for p in saved["passes"])


@pytest.mark.parametrize("extra, message", [
    (["--algo", "bogus"], "oq: error: --algo: unknown algorithm 'bogus'; choose rtn, adaround, brecq, qdrop"),
    (["--algo", "adaround", "--device", "cuda"], "oq: error: --device: cuda asked for but torch sees no CUDA device"),
])
def test_cli_refuses_in_one_line(mlp_files, capsys, monkeypatch, extra, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, calib, root = mlp_files
    assert main(["run", str(model), "--calib", str(calib), "-o", str(root / "x.onnx"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
    assert not (root / "x.onnx").exists()


def test_without_torch_adaround_says_how_to_install_it_and_nothing_imports_it(mlp_files):
    model, calib, root = mlp_files
    code = (f"import sys; sys.modules['torch'] = None\n"
            f"from oq.cli import main\n"
            f"assert main(['run', {str(model)!r}, '--calib', {str(calib)!r}, '-o', {str(root / 'n.onnx')!r}, "
            f"'--quiet']) == 0\n"
            f"sys.exit(main(['run', {str(model)!r}, '--calib', {str(calib)!r}, '-o', {str(root / 'y.onnx')!r}, "
            f"'--algo', 'adaround']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr == "oq: error: --algo: adaround needs torch: pip install 'oq-quant[torch]'\n"


def test_pipeline_places_adaround_after_calibration(mlp_files):
    model, calib, _ = mlp_files
    names = [p.name for p in oq.quantize(model, "onnxruntime", calib, progress=False, algo="adaround",
                                         algo_iters=5).report.passes]
    assert names.index("calibrate") < names.index("guard-saturation") < names.index("adaround") \
        < names.index("insert-qdq")


def test_quantize_keywords_are_the_config_fields():
    import inspect

    params = [p for p in inspect.signature(oq.quantize).parameters if p not in ("model", "output")]
    assert sorted(params) == sorted(oq.config.keyword_names())
