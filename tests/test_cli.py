"""The oq command: happy paths and one-line errors with exit code 2, input untouched, output atomic."""
import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

import models
from oq.cli import main


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def mlp(tmp_path_factory, model_paths):
    root = tmp_path_factory.mktemp("cli")
    model = root / "mlp.onnx"
    model.write_bytes(model_paths["mlp"].read_bytes())
    calib = root / "calib.npz"
    np.savez(calib, **models.make_inputs("mlp", 16))
    return root, model, calib


def oq_cli(*args):
    """Run the installed console entry point in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "oq.cli", *map(str, args)], capture_output=True, text=True)


def test_run_writes_model_and_report(mlp, tmp_path):
    root, model, calib = mlp
    before = sha(model)
    out, report = tmp_path / "q.onnx", tmp_path / "r.json"
    proc = oq_cli("run", model, "--target", "tensorrt", "--calib", calib, "-o", out, "--report", report)
    assert proc.returncode == 0, proc.stderr
    assert "quantized" in proc.stdout and "fold" in proc.stdout
    data = json.loads(report.read_text())
    assert data["target"] == "tensorrt" and any(n["quantized"] for n in data["nodes"])
    assert sha(model) == before
    proc = oq_cli("inspect", out)
    assert proc.returncode == 0 and "quantized: 3 nodes" in proc.stdout and "Gemm" in proc.stdout


def test_targets_listing():
    proc = oq_cli("targets")
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and {l.split()[0] for l in lines} >= {"tensorrt", "onnxruntime"}
    proc = oq_cli("targets", "show", "onnxruntime")
    assert proc.returncode == 0 and "uint8" in proc.stdout and "int32" in proc.stdout


def bad_npz(tmp_path, **arrays):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("case,expect", [
    ("missing_model", "no such file"),
    ("not_onnx", "not a readable ONNX model"),
    ("wrong_name", "has no array for input 'input'; it has: 'pixel_values'"),
    ("wrong_rank", "has rank 4"),
    ("wrong_dtype", "has dtype float64, the model expects float32"),
    ("wrong_dim", "axis 1 differs"),
    ("nan", "input 'input' has NaN or inf in sample 5"),
    ("unknown_target", "unknown target 'nope'"),
    ("missing_calib", "calibration data not found"),
])
def test_bad_input_is_one_line_exit_2(case, expect, mlp, tmp_path, capsys):
    root, model, calib = mlp
    good = models.make_inputs("mlp", 8)["input"]
    target = "tensorrt"
    if case == "missing_model":
        model = tmp_path / "nope.onnx"
    elif case == "not_onnx":
        model = tmp_path / "junk.onnx"
        model.write_bytes(b"\x00garbage\xff" * 10)
    elif case == "wrong_name":
        calib = bad_npz(tmp_path, pixel_values=good)
    elif case == "wrong_rank":
        calib = bad_npz(tmp_path, input=good[None, None])
    elif case == "wrong_dtype":
        calib = bad_npz(tmp_path, input=good.astype(np.float64))
    elif case == "wrong_dim":
        calib = bad_npz(tmp_path, input=good[:, :10])
    elif case == "nan":
        bad = good.copy()
        bad[5, 3] = np.nan
        calib = bad_npz(tmp_path, input=bad)
    elif case == "unknown_target":
        target = "nope"
    elif case == "missing_calib":
        calib = tmp_path / "none.npz"
    out = tmp_path / "out.onnx"
    code = main(["run", str(model), "--target", target, "--calib", str(calib), "-o", str(out), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("oq: error: ") and expect in err[0], err
    assert not out.exists(), "no partial output on failure"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.onnx")], "no temp leftovers"


def test_output_over_input_is_refused(mlp, capsys):
    root, model, calib = mlp
    assert main(["run", str(model), "--calib", str(calib), "-o", str(model), "-q"]) == 2
    assert "never overwrites its input" in capsys.readouterr().err


def test_npz_folder_with_varying_shapes(tmp_path, model_paths):
    feeds = tmp_path / "feeds"
    feeds.mkdir()
    for i, seq in enumerate([5, 9, 13, 9]):
        np.savez(feeds / f"{i}.npz", **models.make_inputs("transformer", 1, seed=i, seq_len=seq))
    out = tmp_path / "q.onnx"
    assert main(["run", str(model_paths["transformer"]), "--calib", str(feeds), "-o", str(out), "-q"]) == 0
    assert out.exists()


def test_already_quantized_model_is_refused(mlp, tmp_path, capsys):
    root, model, calib = mlp
    first = tmp_path / "q.onnx"
    assert main(["run", str(model), "--calib", str(calib), "-o", str(first), "-q"]) == 0
    assert main(["run", str(first), "--calib", str(calib), "-o", str(tmp_path / "qq.onnx"), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already quantized" in err[0] and "give oq the float model" in err[0]
