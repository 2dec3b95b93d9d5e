"""u8 x s8 pair saturation (onnxruntime on x86 without VNNI): emulation, analysis, the guard pass, inspect.

Host-independent: everything is judged through the numpy emulation (oq.saturation), never through this CPU's
integer kernels (a VNNI machine does not saturate, an AVX2 one does). The one test that runs real AVX2 kernels does
so under `qemu-x86_64 -cpu Haswell` and is skipped where qemu is not installed.
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import models
import oq
from conftest import run_onnx, sqnr_db
from oq import saturation as sat
from oq.cli import main as cli_main
from oq.errors import OqError
from oq.target import load_target


# --- the arithmetic ------------------------------------------------------------------------------------------------

def test_pair_sums_saturates_a_hand_example():
    a = np.array([[255, 255, 10, 10, 200, 200]], np.uint8)
    w = np.array([[127, -128, 64], [127, -128, 64], [1, 1, 1], [-1, 1, 1], [100, 0, -100], [50, 0, 100]], np.int8)
    r = sat.pair_sums(a, w)
    # column 0: 255*254 = 64770 -> 32767; 10 - 10 = 0; 200*150 = 30000 fits
    # column 1: -255*256 = -65280 -> -32768; 20; 0
    # column 2: 255*128 = 32640 fits (the largest same-sign pair that never saturates); 20; 0 (opposite signs)
    np.testing.assert_array_equal(r.exact, [[64770 + 30000, -65280 + 20, 32640 + 20]])
    np.testing.assert_array_equal(r.saturated, [[32767 + 30000, -32768 + 20, 32640 + 20]])
    assert r.saturated_pairs == 2 and r.total_pairs == 3 * 3


def test_pair_sums_without_saturation_is_exact():
    a = np.full((4, 6), 255, np.uint8)
    w = np.array([[64], [64], [127], [-127], [-64], [-64]], np.int8)  # same-sign pairs at most 128 * 255
    r = sat.pair_sums(a, w)
    np.testing.assert_array_equal(r.saturated, r.exact)
    assert r.saturated_pairs == 0


def test_pair_sums_matches_brute_force_with_odd_k():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (37, 23)).astype(np.uint8)
    w = rng.integers(-128, 128, (23, 11)).astype(np.int8)
    r = sat.pair_sums(a, w)
    ap = np.pad(a.astype(np.int64), [(0, 0), (0, 1)])  # K padded with zeros, as MLAS does
    wp = np.pad(w.astype(np.int64), [(0, 1), (0, 0)])
    p = ap[:, 0::2, None] * wp[None, 0::2] + ap[:, 1::2, None] * wp[None, 1::2]
    np.testing.assert_array_equal(r.saturated, np.clip(p, -32768, 32767).sum(1))
    np.testing.assert_array_equal(r.exact, a.astype(np.int64) @ w.astype(np.int64))
    assert r.saturated_pairs == int((np.clip(p, -32768, 32767) != p).sum()) > 0


# --- analysis: onnxruntime pairs Conv K as (kh, kw, c_in) -----------------------------------------------------------

def _conv_layer(w, group=1, **attrs):
    w = np.asarray(w, np.int8)
    return sat.IntLayer("conv", "Conv", "x", "y", 0.01, 0, w, np.full(w.shape[0], 0.01, np.float32),
                        {"group": group, **attrs})


def test_analysis_flags_large_same_sign_pairs_of_neighbouring_input_channels():
    risky = np.zeros((2, 2, 1, 2), np.int8)
    risky[0, :, 0, 0] = 127  # channels 0 and 1 at the same tap: a pair in onnxruntime's order
    risky[1, :, 0, 0] = [127, -127]  # opposite signs: never saturates
    row = sat.analyze_layer(_conv_layer(risky))
    assert row.at_risk == 1 and row.worst > 1.9

    safe = np.zeros((1, 2, 1, 2), np.int8)
    safe[0, 0, 0, :] = 127  # same sign, but neighbours in memory order (kw), not in onnxruntime's K order
    safe[0, 1, 0, :] = -127
    row = sat.analyze_layer(_conv_layer(safe))
    assert row.at_risk == 0 and row.at_risk_any_order == 1  # the order-free bound stays conservative


def test_depthwise_conv_is_exact_in_onnxruntime():
    layer = _conv_layer(np.full((4, 1, 3, 3), 127), group=4)
    assert layer.exact_kernel and sat.analyze_layer(layer).at_risk == 0


def test_conv_rows_reproduce_the_convolution():
    rng = np.random.default_rng(1)
    w = rng.integers(-127, 128, (6, 2, 3, 2)).astype(np.int8)
    attrs = {"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 1], "dilations": [1, 2]}
    layer = sat.IntLayer("conv", "Conv", "x", "y", 1.0, 7, w, np.ones(6, np.float32), attrs)
    x = rng.integers(0, 256, (2, 4, 7, 6)).astype(np.uint8)
    got = layer.place(layer.exact(layer.rows(x)), x.shape)
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w.astype(np.float32), "w")])
    ref = run_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]),
                   {"x": x.astype(np.float32) - 7})  # padding reads the zero point, i.e. 0 after the shift
    np.testing.assert_allclose(got, ref, atol=1e-3)


def test_detect_cpu_from_flags(tmp_path):
    def cpu(flags, machine="x86_64"):
        p = tmp_path / "cpuinfo"
        p.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n")
        return sat.detect_cpu(p, machine)[0]

    assert cpu("avx2 avx512f avx512bw avx512_vnni") == "vnni"
    assert cpu("avx2 avx_vnni") == "vnni"
    assert cpu("avx2 avx512f avx512bw") == "avx512"
    assert cpu("avx2 fma") == "avx2"
    assert cpu("", machine="aarch64") == "arm64"
    assert sat.detect_cpu(tmp_path / "missing", "x86_64")[0] == "avx2"  # unknown x86: assume the unsafe case
    assert sat.resolve_cpu("avx2") == ("avx2", "given")
    with pytest.raises(ValueError):
        sat.resolve_cpu("sse9")


# --- the guard pass -------------------------------------------------------------------------------------------------

def _two_conv_model():
    """conv1: all-positive weights, so neighbouring input channels form large same-sign pairs (risky);
    conv2: input channels alternate in sign, so no pair can saturate (safe)."""
    rng = np.random.default_rng(0)
    w1 = rng.uniform(0.5, 1.0, (8, 4, 3, 3)).astype(np.float32)
    w2 = rng.uniform(0.5, 1.0, (4, 8, 1, 1)).astype(np.float32)
    w2[:, 1::2] *= -1
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="conv2")]
    g = helper.make_graph(nodes, "two_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 6, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 6, 6])],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(np.zeros(8, np.float32), "b1"),
                           numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(np.zeros(4, np.float32), "b2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def two_conv(tmp_path_factory):
    model = _two_conv_model()
    rng = np.random.default_rng(1)
    calib = {"x": rng.uniform(0, 1, (32, 4, 6, 6)).astype(np.float32)}
    path = tmp_path_factory.mktemp("sat") / "calib.npz"
    np.savez(path, **calib)
    results = {cpu: oq.quantize(model, "onnxruntime", path, cpu=cpu, progress=False) for cpu in ("avx2", "vnni")}
    held = {"x": np.random.default_rng(2).uniform(0, 1, (8, 4, 6, 6)).astype(np.float32)}
    return model, results, calib, held


def _weight_q(model, conv):
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    node = next(n for n in model.graph.node if n.name == conv)
    return inits[producer[node.input[1]].input[0]]


def test_guard_reduces_only_the_risky_layer(two_conv):
    _, results, _, _ = two_conv
    r = results["avx2"]
    w1, w2 = _weight_q(r.model, "conv1"), _weight_q(r.model, "conv2")
    per_channel_max = np.abs(w1.astype(int)).reshape(8, -1).max(1)
    assert (per_channel_max < 127).sum() >= 4, per_channel_max  # guarded channels: coarser scales
    assert (np.abs(w2.astype(int)).reshape(4, -1).max(1) == 127).all()  # safe layer: 8 bits
    rec = r.report.calibration["saturation"]
    assert rec["deployment_cpu"] == "avx2"
    assert [e["node"] for e in rec["layers_guarded"]] == ["conv1"]
    notes = next(p for p in r.report.passes if p.name == "guard-saturation").notes
    assert "deployment CPU avx2" in notes[0] and any(n.startswith("conv1:") for n in notes)
    assert not any("conv2" in n for n in notes)
    assert "deployment CPU avx2" in r.report.format_table()


def test_vnni_keeps_every_weight_at_8_bits(two_conv):
    _, results, _, _ = two_conv
    r = results["vnni"]
    for conv in ("conv1", "conv2"):
        w = _weight_q(r.model, conv)
        assert (np.abs(w.astype(int)).reshape(w.shape[0], -1).max(1) == 127).all()
    rec = r.report.calibration["saturation"]
    assert rec["deployment_cpu"] == "vnni" and rec["layers_guarded"] == []
    notes = next(p for p in r.report.passes if p.name == "guard-saturation").notes
    assert "exactly" in notes[0]


def test_guarded_layer_has_lower_emulated_error(two_conv):
    model, results, calib, held = two_conv
    checks = {cpu: {c.name: c for c in sat.check_model_saturation(r.model, calib)[0]} for cpu, r in results.items()}
    plain, guarded = checks["vnni"]["conv1"], checks["avx2"]["conv1"]
    assert plain.saturated_pairs > 0 and plain.max_rel_err > 0.01
    assert guarded.max_rel_err < plain.max_rel_err and guarded.sqnr_db > plain.sqnr_db
    assert checks["vnni"]["conv2"].saturated_pairs == 0
    # and on the whole model, as an AVX2 CPU would run it, on held-out inputs
    ref = run_onnx(model, held)
    assert sqnr_db(ref, sat.emulate(results["avx2"].model, held)[0]) > \
        sqnr_db(ref, sat.emulate(results["vnni"].model, held)[0]) + 3


def test_other_targets_and_bad_options(two_conv, tmp_path):
    model, _, calib, _ = two_conv
    path = tmp_path / "c.npz"
    np.savez(path, **calib)
    r = oq.quantize(model, "tensorrt", path, cpu="avx2", progress=False)
    assert "saturation" not in r.report.calibration
    assert "not needed" in next(p for p in r.report.passes if p.name == "guard-saturation").notes[0]
    with pytest.raises(OqError, match="unknown cpu"):
        oq.quantize(model, "onnxruntime", path, cpu="pentium", progress=False)
    bad = tmp_path / "t.toml"
    bad.write_text('extends = "onnxruntime"\nname = "x"\nu8s8_saturation = "maybe"\n')
    with pytest.raises(OqError, match="u8s8_saturation"):
        load_target(bad)


# --- checking other tools' QDQ models -------------------------------------------------------------------------------

def test_inspect_saturation_on_quantize_static_output(tmp_path, capsys):
    from benchmarks.common import ort_quantize_static as _ort_quantize_static

    path = models.build("resnet_mini")
    calib = models.make_inputs("resnet_mini", 8)
    q = tmp_path / "ortq.onnx"
    _ort_quantize_static(str(path), calib, str(q))
    np.savez(tmp_path / "feeds.npz", **models.make_inputs("resnet_mini", 4, seed=1))

    assert cli_main(["inspect", "--saturation", str(q), "--calib", str(tmp_path / "feeds.npz")]) == 0
    out = capsys.readouterr().out
    assert "emulated on the given inputs" in out
    stem = next(l for l in out.splitlines() if "/stem/stem.0/Conv" in l)
    assert "%" in stem  # fused u8 x s8 layer: a saturated-pairs percentage
    assert "not fused by onnxruntime" in out  # quantize_static leaves some Convs in float
    assert "whole model on the first feed" in out

    assert cli_main(["inspect", "--saturation", str(q)]) == 0
    out = capsys.readouterr().out
    assert "analytic worst case" in out and "/fc/Gemm" in out
    assert cli_main(["inspect", str(q), "--calib", str(tmp_path / "feeds.npz")]) == 2


_QEMU_SCRIPT = """
import sys, numpy as np, onnxruntime as ort
so = ort.SessionOptions(); so.log_severity_level = 3
y = ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"]).run(None, dict(np.load(sys.argv[2])))[0]
np.save(sys.argv[3], y)
"""


# .ci/run installs qemu-user and sets OQ_REQUIRE_QEMU when it succeeded: then this test must run and pass;
# without qemu it is skipped with its reason in pytest's summary (-ra).
IN_CI = bool(os.environ.get("OQ_REQUIRE_QEMU"))


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None and not IN_CI, reason="qemu-x86_64 not installed")
def test_emulation_matches_real_avx2_kernels_under_qemu(two_conv, tmp_path):
    """onnxruntime on a CPU without VNNI (qemu's Haswell) computes what the emulation says."""
    _, results, _, held = two_conv
    q = results["vnni"].model
    onnx.save(q, tmp_path / "q.onnx")
    np.savez(tmp_path / "feed.npz", **held)
    proc = subprocess.run(["qemu-x86_64", "-cpu", "Haswell", sys.executable, "-c", _QEMU_SCRIPT,
                           str(tmp_path / "q.onnx"), str(tmp_path / "feed.npz"), str(tmp_path / "y.npy")],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        message = f"python under qemu failed: {proc.stderr.strip().splitlines()[-1:]}"
        pytest.fail(message) if IN_CI else pytest.skip(message)
    real = np.load(tmp_path / "y.npy")
    emulated = sat.emulate(q, held)[0]
    exact = run_onnx(q, held)
    assert np.abs(real - exact).max() > 0.1  # the AVX2 kernels do saturate here
    np.testing.assert_allclose(real, emulated, atol=1e-3)
