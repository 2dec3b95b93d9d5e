"""The pass contract: one typed configuration, two kinds of error, core independent of the passes, observers
registered from the command line, the README's API example runs as written."""
import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import models
import oq
from oq.cli import main
from oq.config import RunConfig
from oq.errors import InternalError, OqError, PassError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mlp(tmp_path_factory, model_paths):
    root = tmp_path_factory.mktemp("contract")
    calib = root / "calib.npz"
    np.savez(calib, **models.make_inputs("mlp", 16))
    return model_paths["mlp"], calib


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 0}, "--batch-size: must be >= 1, got 0"),
    ({"calib_size": -3}, "--calib-size: must be >= 1"),
    ({"weight_bits": 1}, "--weight-bits: must be between 2 and 16, got 1"),
    ({"act_bits": 17}, "--act-bits: must be between 2 and 16"),
    ({"percentile": 120.0}, "--percentile: must be between 50 and 100"),
    ({"max_memory_mb": 0}, "--max-memory (max_memory_mb): must be a positive number"),
    ({"max_memory_mb": -5}, "--max-memory (max_memory_mb): must be a positive number"),
    ({"cpu": "sparc"}, "--cpu: unknown cpu 'sparc'"),
    ({"export_format": "tflite"}, "--format (export_format): unknown export format 'tflite'"),
    ({"exclude": ["conv("]}, "--exclude: 'conv(' is not a valid regular expression"),
    ({"overrides": ["=dtype:int8"]}, "--override '=dtype:int8': no node name or op type before '='"),
    ({"overrides": ["Conv=bogus:1"]}, "unknown key 'bogus'"),
    ({"calib_method": "mine"}, "--calib-method: unknown method 'mine'"),
    ({"plugins": ["no_such_plugin_xyz"]}, "plugin: cannot import module 'no_such_plugin_xyz'"),
])
def test_config_validates_once_and_names_the_option(kwargs, message):
    with pytest.raises(OqError, match=re.escape(message)):
        RunConfig(**kwargs)


def test_config_is_frozen_and_normalises_sequences():
    cfg = RunConfig(exclude=["a", "b"], overrides="Conv=dtype:int8")
    assert cfg.exclude == ("a", "b") and cfg.overrides == ("Conv=dtype:int8",)
    with pytest.raises(Exception):
        cfg.batch_size = 4  # frozen
    assert cfg.as_dict()["exclude"] == ["a", "b"]


def test_quantize_keywords_are_the_config_fields(mlp):
    model, calib = mlp
    with pytest.raises(OqError, match=re.escape("--batch-size: must be >= 1")):
        oq.quantize(model, "tensorrt", calib, batch_size=0)
    via_kw = oq.quantize(model, "tensorrt", calib, calib_size=8, progress=False)
    via_cfg = oq.run(model, RunConfig(target="tensorrt", calib=calib, calib_size=8, progress=False))
    assert via_kw.model.SerializeToString() == via_cfg.model.SerializeToString()


def test_export_steps_are_passes_in_the_report(mlp):
    model, calib = mlp
    names = [p.name for p in oq.quantize(model, "tensorrt", calib, progress=False).report.passes]
    assert names[-5:] == ["export-graph", "pack-int4", "stamp-model", "attach-functions", "side-files"]
    names = [p.name for p in oq.quantize(model, "onnxruntime", calib, export_format="qoperator",
                                         progress=False).report.passes]
    assert names[-2:] == ["qoperator", "side-files"]


def test_a_bug_in_a_pass_is_an_internal_error_naming_it(mlp, tmp_path, monkeypatch, capsys):
    model, calib = mlp
    from oq.passes.finalize import Finalize

    def broken(self, ctx):
        raise ZeroDivisionError("division by zero in a pass")

    monkeypatch.setattr(Finalize, "run", broken)
    with pytest.raises(PassError) as info:
        oq.quantize(model, "tensorrt", calib, progress=False)
    assert isinstance(info.value, InternalError) and not isinstance(info.value, OqError)
    assert info.value.pass_name == "finalize"
    out = tmp_path / "q.onnx"
    assert main(["run", str(model), "--calib", str(calib), "-o", str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert "oq: internal error in pass 'finalize': pass 'finalize' failed: ZeroDivisionError" in err
    assert "bug in oq" in err and "--debug" in err and "Traceback" not in err and not out.exists()
    assert main(["--debug", "run", str(model), "--calib", str(calib), "-o", str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err and not out.exists()


def test_a_user_error_stays_one_line_exit_2(mlp, tmp_path, capsys):
    model, calib = mlp
    assert main(["run", str(model), "--calib", str(calib), "-o", str(tmp_path / "q.onnx"), "--batch-size", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["oq: error: --batch-size: must be >= 1, got 0"]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def test_core_never_imports_a_pass():
    offenders = {}
    for path in sorted((REPO / "oq").rglob("*.py")):
        bad = [n for n in _imports(path) if n.startswith("oq.passes") or re.match(r"^\.+passes\b", n)]
        if bad:
            offenders[str(path.relative_to(REPO))] = bad
    assert not offenders, offenders


def test_no_library_module_over_400_lines():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for root in ("oq", "passes", "backends") for p in (REPO / root).rglob("*.py")}
    assert {k: v for k, v in sizes.items() if v > 400} == {}


PLUGIN = '''
import numpy as np
import oq
from oq.observers import MinMaxObserver


class HalfRange(MinMaxObserver):
    """min/max, then keep half of it: an observer only this plugin knows."""

    def __init__(self, fraction=0.5, bits=8):
        super().__init__()
        self.fraction, self.bits = fraction, bits

    def range(self):
        lo, hi = super().range()
        return lo * self.fraction, hi * self.fraction


oq.register_observer("halfrange", HalfRange)
'''


def test_plugin_registers_an_observer_usable_from_the_cli(mlp, tmp_path):
    model, calib = mlp
    (tmp_path / "my_observers.py").write_text(PLUGIN)
    out = tmp_path / "q.onnx"
    cmd = [sys.executable, "-m", "oq.cli", "run", str(model), "--calib", str(calib), "-o", str(out), "-q",
           "--report", str(tmp_path / "r.json")]
    proc = subprocess.run(cmd + ["--calib-method", "halfrange"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "unknown method 'halfrange'" in proc.stderr
    proc = subprocess.run(cmd + ["--plugin", "my_observers", "--calib-method", "halfrange"], capture_output=True,
                          text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert '"method": "halfrange"' in (tmp_path / "r.json").read_text()


def test_readme_api_example_runs_as_written(mlp, tmp_path, monkeypatch):
    model, calib = mlp
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Python API", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    (tmp_path / "model.onnx").write_bytes(Path(model).read_bytes())
    (tmp_path / "calib.npz").write_bytes(Path(calib).read_bytes())
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(textwrap.dedent(block), "README.md", "exec"), namespace)
    assert (tmp_path / "model.trt.onnx").is_file()
