"""Outputs: every path checked before any work, inputs never written over (symlinks followed), the model, its side
files and the report committed together, killed runs' temporaries cleaned, reproducible bytes and a run record."""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import models
import oq
from oq.errors import OqError


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def oq_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "oq.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd)


@pytest.fixture()
def work(tmp_path, model_paths):
    model = tmp_path / "mlp.onnx"
    model.write_bytes(model_paths["mlp"].read_bytes())
    calib = tmp_path / "calib.npz"
    np.savez(calib, **models.make_inputs("mlp", 16))
    return tmp_path, model, calib


def assert_one_line_error(proc, *phrases):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("oq: error:"), proc.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def snapshot(folder):
    return {p.name: sha(p) for p in folder.iterdir() if p.is_file()}


@pytest.mark.parametrize("case", ["out_is_dir", "parent_is_file", "report_missing_folder", "report_is_dir",
                                  "out_is_calib", "out_is_model_symlink", "side_file_is_model", "out_is_ext_data"])
def test_bad_output_paths_fail_before_any_work(work, case):
    root, model, calib = work
    out, extra = root / "q.onnx", []
    if case == "out_is_dir":
        out.mkdir()
        phrase = "is a directory"
    elif case == "parent_is_file":
        out = model / "q.onnx"
        phrase = "is not a folder"
    elif case == "report_missing_folder":
        extra, phrase = ["--report", root / "nowhere" / "r.json"], "does not exist"
    elif case == "report_is_dir":
        (root / "r").mkdir()
        extra, phrase = ["--report", root / "r"], "is a directory"
    elif case == "out_is_calib":
        out, phrase = calib, "is the input file"
    elif case == "out_is_model_symlink":
        out = root / "link.onnx"
        out.symlink_to(model)
        phrase = "is the input file"
    elif case == "side_file_is_model":  # tensorrt writes <stem>.calib.cache beside the output
        renamed = root / "m.calib.cache"
        model.rename(renamed)
        model, out, phrase = renamed, root / "m.onnx", "side file .calib.cache"
    else:  # the input keeps its weights in external data, and -o names that data file
        proto = onnx.load(str(model))
        model = root / "ext.onnx"
        onnx.save_model(proto, str(model), save_as_external_data=True, location="ext.weights", size_threshold=0)
        out, phrase = root / "ext.weights", "is the input file"
    before = snapshot(root)
    proc = oq_cli("run", model, "--calib", calib, "-o", out, "-q", *extra)
    assert_one_line_error(proc, phrase)
    assert snapshot(root) == before  # nothing written, no input changed
    assert not [p for p in root.iterdir() if p.name.startswith(".oq-tmp-")]


def test_model_side_files_and_report_are_written_together(work):
    root, model, calib = work
    out, report = root / "q.onnx", root / "r.json"
    proc = oq_cli("run", model, "--calib", calib, "-o", out, "--report", report, "-q")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    assert sorted(data["side_files"]) == sorted(str(root / f"q{s}") for s in (".calib.cache", ".ranges.json"))
    assert all(os.path.isfile(p) for p in data["side_files"])
    assert data["run"]["oq.target"] == "tensorrt" and data["options"]["batch_size"] == 16
    assert not [p for p in root.iterdir() if p.name.startswith(".oq-tmp-")]


def test_killed_runs_temporaries_are_removed(work):
    root, model, calib = work
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = root / f".oq-tmp-{int(dead.stdout)}-abc"
    stale.mkdir()
    (stale / "q.onnx").write_bytes(b"partial")
    oq.quantize(model, "tensorrt", calib, progress=False).save(root / "q.onnx")
    assert not stale.exists()


def test_files_get_the_mode_of_a_plain_write(tmp_path, model_paths):
    from oq import ir

    proto = onnx.load(str(model_paths["mlp"]))
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    path = ir.save_model(proto, tmp_path / "big.onnx", external_data=True)
    data = tmp_path / "big.onnx.data"
    assert data.is_file()
    mode = plain.stat().st_mode & 0o777
    assert path.stat().st_mode & 0o777 == mode and data.stat().st_mode & 0o777 == mode


def test_reruns_are_byte_identical_whatever_the_batch_size_and_carry_a_run_record(work):
    root, model, calib = work
    outputs = []
    for batch in (1, 16):
        result = oq.quantize(model, "tensorrt", calib, batch_size=batch, progress=False)
        out = result.save(root / f"b{batch}.onnx")
        outputs.append((out.read_bytes(), result.side_files))
    assert outputs[0] == outputs[1]
    props = {p.key: p.value for p in onnx.load(str(root / "b1.onnx")).metadata_props}
    assert props["oq.version"] == oq.__version__ and props["oq.target"] == "tensorrt"
    assert len(props["oq.target_sha256"]) == 16 and props["oq.calibration_sha256"] == hashlib.sha256(
        b"calib.npz\0" + calib.read_bytes()).hexdigest()[:16]
    assert props["oq.passes"].startswith("canonicalize,") and "insert-qdq" in props["oq.passes"]
    assert "batch_size" not in json.loads(props["oq.options"])


def _conv_model(opset, tensor_name="act"):
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 3, 3], np.random.default_rng(0).normal(size=108))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], [tensor_name], name="relu"),
             helper.make_node("Conv", [tensor_name, "w2"], ["y"], name="conv2")]
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [2, 4, 1, 1], np.random.default_rng(1).normal(size=8))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_a_model_at_the_newest_opset_is_emitted_at_one_onnxruntime_runs(tmp_path):
    from oq.runtime import max_qdq_opset

    newest = onnx.defs.onnx_opset_version()
    model = _conv_model(newest)
    feeds = [{"x": np.random.default_rng(i).normal(size=(1, 3, 8, 8)).astype(np.float32)} for i in range(4)]
    result = oq.quantize(model, "tensorrt", lambda: feeds, progress=False)
    opset = next(o.version for o in result.model.opset_import if o.domain in ("", "ai.onnx"))
    assert opset == min(newest, max_qdq_opset())
    sess = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert sess.run(None, feeds[0])[0].shape == (1, 2, 8, 8)


def test_a_tensor_name_with_a_line_break_cannot_forge_calibration_cache_lines(tmp_path):
    model = _conv_model(17, tensor_name="act\nforged: 3f800000")
    feeds = [{"x": np.ones((1, 3, 8, 8), np.float32)}]
    with pytest.raises(OqError, match="contains a line break, which a TensorRT calibration cache cannot carry"):
        oq.quantize(model, "tensorrt", lambda: feeds, progress=False)


def test_a_run_killed_while_placing_its_files_is_completed_by_the_next(work):
    """The killed run had staged everything and written its commit record, then placed one file of three."""
    root, model, calib = work
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stage = root / f".oq-tmp-{int(dead.stdout)}-xyz"
    stage.mkdir()
    (root / "q.calib.cache").write_bytes(b"new cache")  # already placed by the killed run
    (stage / "q.ranges.json").write_bytes(b"new ranges")
    (stage / "q.onnx").write_bytes(b"new model")
    (root / "q.onnx").write_bytes(b"old model")
    (root / "q.ranges.json").write_bytes(b"old ranges")
    moves = [[str(stage / "q.calib.cache"), str(root / "q.calib.cache")],
             [str(stage / "q.ranges.json"), str(root / "q.ranges.json")], [str(stage / "q.onnx"), str(root / "q.onnx")]]
    (stage / "commit.json").write_text(json.dumps(moves))
    proc = oq_cli("run", model, "--calib", calib, "-o", root / "other.onnx", "-q")
    assert proc.returncode == 0, proc.stderr
    assert [(root / n).read_bytes() for n in ("q.onnx", "q.ranges.json", "q.calib.cache")] == [
        b"new model", b"new ranges", b"new cache"]
    assert not stage.exists()
