"""oq analyze: graphwise and layerwise numbers checked against onnxruntime runs made here, reports, CLI errors."""
import builtins
import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import oq
from oq.cli import main
from tests.conftest import run_onnx, sqnr_db


def outputs(model, feed, names):
    """The named tensors of `model` (graph optimisation off), added as graph outputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model if isinstance(model, onnx.ModelProto) else onnx.load(str(model)))
    present = {o.name for o in m.graph.output}
    m.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                          for n in names if n not in present)
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip(names, sess.run(names, feed)))


@pytest.fixture(scope="module")
def resnet(model_paths, calib_files):
    """resnet_mini for tensorrt, measured on held-out data, with one Conv kept in float."""
    path, held_out = calib_files["resnet_mini"]
    kw = dict(target="tensorrt", calib=path, exclude=["/block1/conv2/Conv"], progress=False)
    analysis = oq.analyze(model_paths["resnet_mini"], eval=held_out, **kw)
    quantized = oq.quantize(model_paths["resnet_mini"], **kw).model
    return analysis, quantized, held_out


def test_graphwise_sqnr_and_clipping_match_numpy(resnet, model_paths):
    a, quantized, held_out = resnet
    picked = a.tensors[:2] + a.tensors[-1:]
    ref = outputs(model_paths["resnet_mini"], held_out, [t.tensor for t in picked if t.tensor != "input"])
    ref["input"] = held_out["input"]
    got = outputs(quantized, held_out, [t.dequantized for t in picked])
    inits = {i.name: numpy_helper.to_array(i) for i in quantized.graph.initializer}
    dq = {n.output[0]: n for n in quantized.graph.node if n.op_type == "DequantizeLinear"}
    for t in picked:
        x, q = ref[t.tensor].astype(np.float64), got[t.dequantized].astype(np.float64)
        assert t.sqnr_db == pytest.approx(sqnr_db(x, q), abs=0.01)
        assert t.cosine == pytest.approx((x * q).sum() / np.sqrt((x * x).sum() * (q * q).sum()), abs=1e-6)
        node = dq[t.dequantized]
        scale, zp = inits[node.input[1]].astype(np.float64), inits[node.input[2]].astype(np.float64)
        lo, hi = (-128 - zp) * scale, (127 - zp) * scale
        assert t.clip_ratio == pytest.approx(np.mean((x < lo) | (x > hi)), abs=1e-6)
        assert t.range == pytest.approx([lo, hi])
    assert [t.sqnr_db for t in a.tensors] == sorted(t.sqnr_db for t in a.tensors)


def test_output_sqnr_and_excluded_node(resnet, model_paths):
    a, quantized, held_out = resnet
    direct = sqnr_db(run_onnx(model_paths["resnet_mini"], held_out), run_onnx(quantized, held_out))
    assert a.output_sqnr_db == pytest.approx(direct, abs=1e-6)
    assert not a.on_calibration_data and a.samples == 32
    names = [n.name for n in a.nodes]
    assert "/block1/conv2/Conv" not in names and "/fc/Gemm" in names
    layerwise = [n.layerwise_sqnr_db for n in a.nodes]
    assert layerwise == sorted(layerwise)
    assert all(n.hint for n in a.nodes)


def test_layerwise_equals_a_model_quantized_at_one_node(model_paths, calib_files):
    """The Gemm quantized alone (every other node excluded): the same Q/DQ on its inputs, the same output SQNR."""
    path, held_out = calib_files["transformer"]
    a = oq.analyze(model_paths["transformer"], target="tensorrt", calib=path, eval=held_out, progress=False)
    node = next(n for n in a.nodes if n.name == "/fc2/MatMul")
    others = [n.name for n in a.nodes if n.name != node.name] + ["/fc2/Add"]
    alone = oq.quantize(model_paths["transformer"], target="tensorrt", calib=path, progress=False,
                        exclude=[f"^{name}$" for name in others]).model
    assert sum(n.op_type == "QuantizeLinear" for n in alone.graph.node) == 1
    direct = sqnr_db(run_onnx(model_paths["transformer"], held_out), run_onnx(alone, held_out))
    assert node.layerwise_sqnr_db == pytest.approx(direct, abs=0.01)


def test_reports_hold_the_same_numbers(resnet, tmp_path):
    a = resnet[0]
    html, js = tmp_path / "r.html", tmp_path / "r.json"
    a.to_html(html)
    a.to_json(js)
    page = html.read_text()
    assert page.count('<img src="data:image/png;base64,') >= 3 and a.nodes[0].name in page
    data = json.loads(js.read_text())
    assert data["output_sqnr_db"] == pytest.approx(a.output_sqnr_db)
    assert [n["name"] for n in data["nodes"]] == [n.name for n in a.nodes]
    assert [t["sqnr_db"] for t in data["tensors"]] == pytest.approx([t.sqnr_db for t in a.tensors])
    assert data["measured_on"] == "measured on evaluation arrays"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".oq-tmp-")]


def test_without_matplotlib_html_is_one_line_error(resnet, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(oq.OqError, match=r"^the HTML report needs matplotlib: pip install 'oq-quant\[report\]'$"):
        resnet[0].to_html(tmp_path / "r.html")
    resnet[0].to_json(tmp_path / "r.json")  # JSON still works
    assert not (tmp_path / "r.html").exists() and (tmp_path / "r.json").exists()


def test_cli_prints_summary_and_writes_reports(model_paths, calib_files, tmp_path, capsys):
    path, _ = calib_files["mlp"]
    out, js = tmp_path / "a.html", tmp_path / "a.json"
    rc = main(["analyze", str(model_paths["mlp"]), "--calib", str(path), "-o", str(out), "--json", str(js),
               "--top", "3", "--act-bits", "6", "-q"])
    stdout = capsys.readouterr().out
    assert rc == 0
    assert "model output SQNR" in stdout and "measured on calibration data" in stdout and "worst nodes" in stdout
    assert out.exists() and json.loads(js.read_text())["on_calibration_data"] is True


@pytest.mark.parametrize("args, expect", [
    (["missing.onnx"], "no such file"),
    (["MODEL", "--eval", "EVAL"], "--eval:"),
    (["MODEL", "--json", "MODEL"], "never overwrites its inputs"),
])
def test_cli_bad_input_is_one_line(args, expect, model_paths, calib_files, tmp_path, capsys):
    path, _ = calib_files["mlp"]
    bad = tmp_path / "bad.npz"
    np.savez(bad, wrong=np.zeros((2, 3), np.float32))
    model = tmp_path / "mlp.onnx"
    model.write_bytes(model_paths["mlp"].read_bytes())
    args = [{"MODEL": str(model), "EVAL": str(bad)}.get(a, a) for a in args]
    rc = main(["analyze", *args, "--calib", str(path), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("oq: error:") and expect in err[0], err


def test_cli_without_matplotlib(model_paths, calib_files, tmp_path, capsys, monkeypatch):
    import oq.analysis.plots as plots

    def missing():
        raise oq.OqError(plots.MATPLOTLIB_HINT)

    monkeypatch.setattr(plots, "pyplot", missing)
    path, _ = calib_files["mlp"]
    rc = main(["analyze", str(model_paths["mlp"]), "--calib", str(path), "-o", str(tmp_path / "a.html"), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["oq: error: the HTML report needs matplotlib: pip install 'oq-quant[report]'"]
