"""Broken calibration data and broken weights: one OqError line through the API, `oq: error:` and exit 2 through
the CLI, no output written, inputs untouched. Covers damaged and pickled .npz files, --preprocess on sources it
does not apply to, endless and exiting calibration functions, all-zero data and NaN/inf weights."""
import hashlib
import io
import os
import pickle
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import models
import oq
import oq.data
from oq.errors import OqError

REPO = Path(__file__).resolve().parents[1]

FEEDS_MODULE = textwrap.dedent('''
    import sys

    import numpy as np

    closed = []


    def _feed(rng):
        return {"input": rng.standard_normal((1, 64)).astype(np.float32)}


    def endless():
        rng = np.random.default_rng(0)
        try:
            while True:
                yield _feed(rng)
        finally:
            closed.append(True)


    def exactly(n):
        def feeds():
            rng = np.random.default_rng(0)
            return [_feed(rng) for _ in range(n)]
        return feeds


    five, six = exactly(5), exactly(6)


    def exits():
        sys.exit(3)


    def exits_later():
        rng = np.random.default_rng(0)
        yield _feed(rng)
        raise SystemExit(3)


    def interrupted():
        raise KeyboardInterrupt
''')


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def mlp(tmp_path):
    """A private copy of the mlp reference model and good calibration data for it."""
    model = tmp_path / "mlp.onnx"
    model.write_bytes(Path(models.build("mlp")).read_bytes())
    good = tmp_path / "good.npz"
    np.savez(good, **models.make_inputs("mlp", 16))
    return model, good


@pytest.fixture
def feeds_module(tmp_path, monkeypatch):
    """A `module:function` calibration module on the path, for the API (sys.path) and the CLI (its cwd)."""
    name = "oq_bad_feeds"
    (tmp_path / f"{name}.py").write_text(FEEDS_MODULE)
    (tmp_path / "exits_on_import.py").write_text("raise SystemExit(4)\n\ndef feeds():\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in (name, "exits_on_import"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    yield name
    for mod in (name, "exits_on_import"):
        sys.modules.pop(mod, None)


def oq_cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "oq.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def cli_error(tmp_path, *args) -> str:
    """Run `oq ARGS` in tmp_path; it must fail with exactly one `oq: error:` line and exit code 2, writing nothing
    and changing no file there. Returns the line."""
    before = {p: sha(p) for p in tmp_path.rglob("*") if p.is_file()}
    proc = oq_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("oq: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    after = {p: sha(p) for p in tmp_path.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert after == {p: h for p, h in before.items() if "__pycache__" not in p.parts}, "files written or modified"
    return lines[0]


def cli_run_error(tmp_path, model, calib, *extra) -> str:
    return cli_error(tmp_path, "run", model, "--calib", calib, "-o", tmp_path / "out.onnx", "--report",
                     tmp_path / "report.json", "-q", *extra)


# -- damaged .npz files ----------------------------------------------------------------------------------------------

def _member_data_offset(path: Path, member: str) -> int:
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(member)
    raw = path.read_bytes()
    name_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    return info.header_offset + 30 + name_len + extra_len


def bad_crc(good: Path, path: Path) -> None:
    raw = bytearray(good.read_bytes())
    start = _member_data_offset(good, "input.npy") + 200  # past the .npy header, inside the array's bytes
    raw[start:start + 64] = b"\xa5" * 64
    path.write_bytes(bytes(raw))


def truncated(good: Path, path: Path) -> None:
    raw = good.read_bytes()
    path.write_bytes(raw[:len(raw) // 2])


def future_format(good: Path, path: Path) -> None:
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            data = bytearray(src.read(info))
            data[6] = 9  # .npy format version 9.0
            dst.writestr(info.filename, bytes(data))


def object_array(good: Path, path: Path) -> None:
    np.savez(path, input=np.array([{}, None], dtype=object))


def pickled(good: Path, path: Path) -> None:
    path.write_bytes(pickle.dumps({"input": np.zeros((4, 64), np.float32)}))


def not_a_zip(good: Path, path: Path) -> None:
    path.write_bytes(b"this is no zip archive\n" * 8)


def single_npy(good: Path, path: Path) -> None:
    buf = io.BytesIO()
    np.save(buf, np.zeros((4, 64), np.float32))
    path.write_bytes(buf.getvalue())


BAD_NPZ = [(bad_crc, r"bad\.npz: member 'input' is corrupt \(BadZipFile: Bad CRC-32"),
           (truncated, r"bad\.npz: not a readable \.npz file \(BadZipFile"),
           (future_format, r"bad\.npz: member 'input' is not a readable array \(ValueError: .*format version"),
           (object_array, r"bad\.npz: member 'input' holds a Python object array; oq reads \.npz without pickle"),
           (pickled, r"bad\.npz: holds pickled Python data; oq reads \.npz without pickle"),
           (not_a_zip, r"bad\.npz: not a readable \.npz file \(neither a zip archive nor an \.npy array\)"),
           (single_npy, r"bad\.npz: is a single \.npy array, not an \.npz archive")]


@pytest.mark.parametrize("make,msg", BAD_NPZ, ids=[m.__name__ for m, _ in BAD_NPZ])
def test_damaged_npz_is_one_error_naming_file_and_member(make, msg, mlp, tmp_path):
    model, good = mlp
    bad = tmp_path / "bad.npz"
    make(good, bad)
    with pytest.raises(OqError, match=msg):
        oq.quantize(model, "tensorrt", bad, progress=False)
    line = cli_run_error(tmp_path, model, bad)
    assert "bad.npz" in line


@pytest.mark.parametrize("make,msg", BAD_NPZ[:4], ids=[m.__name__ for m, _ in BAD_NPZ[:4]])
def test_damaged_npz_in_a_folder_of_feeds(make, msg, mlp, tmp_path):
    model, good = mlp
    folder = tmp_path / "feeds"
    folder.mkdir()
    np.savez(folder / "a.npz", **models.make_inputs("mlp", 1))
    make(good, folder / "bad.npz")
    with pytest.raises(OqError, match=msg):
        oq.quantize(model, "tensorrt", folder, progress=False)


def test_object_array_through_inspect_saturation(mlp, tmp_path):
    model, good = mlp
    quantized = tmp_path / "q.onnx"
    oq.quantize(model, "onnxruntime", good, progress=False, output=quantized)
    bad = tmp_path / "bad.npz"
    object_array(good, bad)
    line = cli_error(tmp_path, "inspect", "--saturation", quantized, "--calib", bad)
    assert "bad.npz: member 'input' holds a Python object array" in line


# -- --preprocess where it does not apply ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["npz", "npz folder", "random", "function"])
def test_preprocess_applies_to_image_folders_only(kind, mlp, tmp_path, feeds_module):
    model, good = mlp
    if kind == "npz folder":
        calib = tmp_path / "feeds"
        calib.mkdir()
        np.savez(calib / "a.npz", **models.make_inputs("mlp", 1))
    else:
        calib = {"npz": good, "random": "random", "function": f"{feeds_module}:five"}[kind]
    msg = r"--preprocess: applies to image folders only"
    with pytest.raises(OqError, match=msg):
        oq.quantize(model, "tensorrt", calib, progress=False, preprocess="scale=1/255")
    if kind in ("npz", "random", "function"):
        assert "--preprocess: applies to image folders only" in cli_run_error(tmp_path, model, calib, "--preprocess",
                                                                             "scale=1/255")


def test_preprocess_with_a_python_callable(mlp):
    model, _ = mlp

    def feeds():
        return [models.make_inputs("mlp", 1)]

    with pytest.raises(OqError, match="--preprocess: applies to image folders only; .* the function feeds"):
        oq.quantize(model, "tensorrt", feeds, progress=False, preprocess="scale=1/255")


# -- endless and exiting calibration functions -----------------------------------------------------------------------

def test_endless_function_source_is_capped_and_reported(mlp, feeds_module):
    model, _ = mlp
    cap = oq.data.CALLABLE_DEFAULT_CAP
    result = oq.quantize(model, "tensorrt", f"{feeds_module}:endless", progress=False)
    assert result.report.calibration["samples"] == cap
    notes = [w for w in result.report.warnings if f"yields more than {cap} samples" in w]
    assert len(notes) == 1 and "--calib-size" in notes[0] and feeds_module in notes[0]
    assert sys.modules[feeds_module].closed  # the generator was closed, so its clean-up ran
    result = oq.quantize(model, "tensorrt", f"{feeds_module}:endless", progress=False, calib_size=10)
    assert result.report.calibration["samples"] == 10
    assert not any("yields more than" in w for w in result.report.warnings)


def test_function_source_at_the_cap_is_not_reported(mlp, feeds_module, monkeypatch):
    model, _ = mlp
    monkeypatch.setattr(oq.data, "CALLABLE_DEFAULT_CAP", 5)
    result = oq.quantize(model, "tensorrt", f"{feeds_module}:five", progress=False)
    assert result.report.calibration["samples"] == 5 and not result.report.warnings
    result = oq.quantize(model, "tensorrt", f"{feeds_module}:six", progress=False)
    assert result.report.calibration["samples"] == 5
    assert any("yields more than 5 samples" in w for w in result.report.warnings)


def test_endless_function_source_through_the_cli(mlp, tmp_path, feeds_module):
    model, _ = mlp
    out = tmp_path / "out.onnx"
    proc = oq_cli("run", model, "--calib", f"{feeds_module}:endless", "-o", out, "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert out.exists()
    assert proc.stderr.splitlines() == [line for line in proc.stderr.splitlines() if line.startswith("oq: warning:")]
    assert any(f"yields more than {oq.data.CALLABLE_DEFAULT_CAP} samples" in line for line in proc.stderr.splitlines())


@pytest.mark.parametrize("ref,msg", [
    ("oq_bad_feeds:exits", r"calibration source oq_bad_feeds:exits raised SystemExit\(3\)"),
    ("oq_bad_feeds:exits_later", r"calibration source oq_bad_feeds:exits_later raised SystemExit\(3\) at sample 1"),
    ("exits_on_import:feeds", r"calibration source 'exits_on_import': importing it raised SystemExit\(4\)"),
])
def test_system_exit_in_a_calibration_source(ref, msg, mlp, tmp_path, feeds_module):
    model, _ = mlp
    with pytest.raises(OqError, match=msg):
        oq.quantize(model, "tensorrt", ref, progress=False)
    line = cli_run_error(tmp_path, model, ref)
    assert "SystemExit(" in line


def test_keyboard_interrupt_in_a_calibration_source_is_not_swallowed(mlp, feeds_module):
    model, _ = mlp
    with pytest.raises(KeyboardInterrupt):
        oq.quantize(model, "tensorrt", f"{feeds_module}:interrupted", progress=False)


# -- data that gives no range ----------------------------------------------------------------------------------------

def test_all_zero_calibration_data_is_reported(mlp, tmp_path):
    """Biases give every tensor past the first layer a range even on all-zero inputs, so the run goes through; the
    report (and the CLI's warnings) say the inputs were all zero, and name the input activation without a range."""
    model, _ = mlp
    zeros = tmp_path / "zeros.npz"
    np.savez(zeros, input=np.zeros((16, 64), np.float32))
    result = oq.quantize(model, "tensorrt", zeros, progress=False)
    warnings = result.report.warnings
    assert any("zeros.npz: input 'input' is 0 in every sample (all-zero inputs?)" in w for w in warnings), warnings
    assert any(w.startswith("activation 'input': no range on the calibration data") for w in warnings), warnings
    proc = oq_cli("run", model, "--calib", zeros, "-o", tmp_path / "out.onnx", "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert any("is 0 in every sample" in line and line.startswith("oq: warning:") for line in proc.stderr.splitlines())


def _relu_chain(first_relu: bool) -> onnx.ModelProto:
    """x -> [Relu ->] MatMul(-1) -> Relu -> MatMul -> y, without biases: on positive data the second Relu's output is
    0 everywhere; with the first Relu and negative data, every MatMul input is."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(-np.ones((8, 8), np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w2")
    nodes = [helper.make_node("Relu", ["x"], ["r0"], name="relu0")] if first_relu else []
    nodes += [helper.make_node("MatMul", ["r0" if first_relu else "x", "w1"], ["a"], name="mm1"),
              helper.make_node("Relu", ["a"], ["r1"], name="relu1"),
              helper.make_node("MatMul", ["r1", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], [w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_tensor_without_range_is_warned_by_name(tmp_path):
    data = tmp_path / "pos.npz"
    np.savez(data, x=np.random.default_rng(0).uniform(0.1, 1.0, (16, 8)).astype(np.float32))
    result = oq.quantize(_relu_chain(first_relu=False), "tensorrt", data, progress=False)
    warnings = [w for w in result.report.warnings if "no range" in w]
    assert len(warnings) == 1 and "activation 'r1'" in warnings[0], result.report.warnings


def test_most_activations_without_range_is_an_error(tmp_path):
    data = tmp_path / "neg.npz"
    np.savez(data, x=-np.random.default_rng(0).uniform(0.1, 1.0, (16, 8)).astype(np.float32))
    model = tmp_path / "chain.onnx"
    onnx.save(_relu_chain(first_relu=True), str(model))
    msg = r"neg\.npz gives no range for 2 of 2 activations \(all-zero inputs\?\): every observed value of .*'r1'"
    with pytest.raises(OqError, match=msg):
        oq.quantize(model, "tensorrt", data, progress=False)
    assert "gives no range for 2 of 2 activations" in cli_run_error(tmp_path, model, data)


@pytest.mark.parametrize("target", ["tensorrt", "onnxruntime", "qnn"])
def test_reference_models_have_a_range_everywhere(target, model_paths, calib_files):
    for name in models.REFERENCE_MODELS:
        result = oq.quantize(model_paths[name], target, calib_files[name][0], progress=False)
        assert not [w for w in result.report.warnings if "no range" in w], (name, result.report.warnings)


# -- broken weights --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("initializer,value,msg", [
    ("fc1.weight", np.nan, r"weight initializer 'fc1\.weight' of node '/fc1/Gemm' holds 1 NaN among its 8192"),
    ("fc2.weight", np.inf, r"weight initializer 'fc2\.weight' of node '/fc2/Gemm' holds 1 inf"),
    # a BatchNorm folded into fc1 carries its NaN into fc1's weight
    ("bn1.running_var", np.nan, r"weight initializer 'fc1\.weight' .* holds 64 NaN .*after folding any BatchNorm"),
])
def test_nan_or_inf_weights_name_the_initializer(initializer, value, msg, mlp, tmp_path):
    model, good = mlp
    proto = onnx.load(str(model))
    init = next(i for i in proto.graph.initializer if i.name == initializer)
    array = numpy_helper.to_array(init).copy()
    array.flat[3] = value
    init.CopyFrom(numpy_helper.from_array(array, initializer))
    broken = tmp_path / "broken.onnx"
    onnx.save(proto, str(broken))
    with pytest.raises(OqError, match=msg):
        oq.quantize(broken, "tensorrt", good, progress=False)
    assert "weight initializer" in cli_run_error(tmp_path, broken, good)
