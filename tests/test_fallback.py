"""--min-sqnr: the search on a scripted SQNR table, then on resnet_mini (goal met as measured here, resume from a
state file, refusals) and through the CLI."""
import json

import numpy as np
import pytest

import oq
from oq.analysis import fallback
from oq.analysis.search import search
from oq.cli import main
from tests.conftest import run_onnx, sqnr_db


def scripted(noise: dict[str, float], floor: float = 1e-6):
    """An SQNR that adds up per-node noise (the ranking's order is by noise), and records what was asked."""
    asked = []

    def sqnr_of(excluded):
        asked.append(excluded)
        return float(10 * np.log10(1 / (floor + sum(v for k, v in noise.items() if k not in excluded))))

    return sqnr_of, asked


def test_search_prefix_then_pruning():
    noise = {"a": 1e-2, "b": 1e-3, "c": 1e-3, "d": 1e-5, "e": 1e-5}
    sqnr_of, asked = scripted(noise)
    out = search(list(noise), 28.0, sqnr_of)  # needs 'a' and one of 'b'/'c' in float
    assert out.naive == 2 and out.excluded == ["a", "b"] and out.sqnr_db >= 25.0
    assert len(asked) == len(set(asked)) == out.evaluations
    sqnr_of, asked = scripted(noise)
    out = search(list(noise), 10.0, sqnr_of)
    assert out.excluded == [] and out.evaluations == 1 and asked == [()]
    with pytest.raises(oq.OqError, match=r"^--min-sqnr 100: not reachable: with all 5 quantized nodes kept in float"):
        search(list(noise), 100.0, scripted(noise, floor=1e-5)[0])


def test_pruning_puts_back_what_the_ranking_overrated():
    """A node ranked bad whose noise cancels in the whole model: the prefix keeps it, pruning puts it back."""
    noise = {"a": 1e-2, "x": 0.0, "b": 1e-3, "c": 1e-6}
    sqnr_of, _ = scripted(noise)
    out = search(list(noise), 31.0, sqnr_of, max_pruning=8)
    assert out.naive == 3 and out.excluded == ["a", "b"]
    out = search(list(noise), 31.0, scripted(noise)[0], max_pruning=0)
    assert out.excluded == ["a", "x", "b"] and out.pruning_evaluations == 0


@pytest.fixture(scope="module")
def resnet(model_paths, calib_files):
    path, held_out = calib_files["resnet_mini"]
    return model_paths["resnet_mini"], path, held_out


def goal_run(resnet, goal, **kw):
    model, path, held_out = resnet
    return fallback.quantize_to_goal(model, goal, target="onnxruntime", calib=path, eval=held_out, progress=False,
                                     **kw)


def test_goal_below_default_excludes_nothing(resnet):
    g = goal_run(resnet, 30.0).report.goal
    assert g.float_nodes == [] and g.evaluations == 1 and g.achieved_db == g.quantized_db > 30.0
    assert g.quantized_before == g.quantized_after and "fp32" in g.latency_ms


def test_goal_met_with_fewer_nodes_than_the_naive_list(resnet, tmp_path):
    out = tmp_path / "goal.onnx"
    result = goal_run(resnet, 40.0, output=out)
    g = result.report.goal
    model, _, held_out = resnet
    measured = sqnr_db(run_onnx(model, held_out), run_onnx(out, held_out))
    assert measured >= 40.0 > g.quantized_db and measured == pytest.approx(g.achieved_db, abs=0.01)
    assert 1 <= len(g.float_nodes) <= g.naive_float_nodes and g.evaluations < g.ranked_nodes
    assert g.quantized_after < g.quantized_before
    float_ops = {r.name for r in result.report.nodes if not r.quantized and "--exclude" in r.reason}
    assert float_ops == {n.name for n in g.float_nodes}
    assert json.loads(result.report.to_json())["goal"]["float_nodes"][0]["name"] == g.float_nodes[0].name
    text = g.summary()
    assert "goal 40.00 dB met" in text and "measured on 32 samples of evaluation arrays" in text


def test_state_resumes_without_measuring_again(resnet, tmp_path, monkeypatch):
    state = tmp_path / "search.json"
    first = goal_run(resnet, 40.0, state=state).report.goal
    doc = json.loads(state.read_text())
    assert len(doc["results"]) == first.evaluations and len(doc["ranking"]) == first.ranked_nodes

    measured = []
    real = fallback._Session.measure
    monkeypatch.setattr(fallback._Session, "measure", lambda self, ex: measured.append(ex) or real(self, ex))
    monkeypatch.setattr(fallback, "analyze_config", lambda *a, **k: pytest.fail("ranked again"))
    again = goal_run(resnet, 40.0, state=state).report.goal
    assert measured == [] and again.reused == again.evaluations
    assert [n.name for n in again.float_nodes] == [n.name for n in first.float_nodes]
    assert again.achieved_db == first.achieved_db

    doc["results"] = doc["results"][:3]  # killed after three evaluations
    state.write_text(json.dumps(doc))
    resumed = goal_run(resnet, 40.0, state=state).report.goal
    assert len(measured) == first.evaluations - 3
    assert [n.name for n in resumed.float_nodes] == [n.name for n in first.float_nodes]
    assert resumed.achieved_db == first.achieved_db and resumed.evaluations == first.evaluations


def test_state_from_another_model_is_refused(resnet, model_paths, calib_files, tmp_path):
    state = tmp_path / "search.json"
    path, held_out = calib_files["mlp"]
    fallback.quantize_to_goal(model_paths["mlp"], 10.0, target="tensorrt", calib=path, eval=held_out, state=state,
                              progress=False)
    with pytest.raises(oq.OqError, match=r"^--state .*search.json: made for another model, options or data "
                                         r"\(state \w+, this run \w+\); give another path or delete it$"):
        goal_run(resnet, 40.0, state=state)
    state.write_text("{not json")
    with pytest.raises(oq.OqError, match="not an oq --min-sqnr state file"):
        goal_run(resnet, 40.0, state=state)


def test_only_the_float_model_meets_it_says_so(model_paths, calib_files):
    path, held_out = calib_files["mlp"]
    g = fallback.quantize_to_goal(model_paths["mlp"], 70.0, target="tensorrt", calib=path, eval=held_out,
                                  progress=False).report.goal
    assert g.only_float and g.quantized_after == 0
    assert g.achieved_db is None or g.achieved_db >= 70.0  # None: exact
    assert "only the float model meets the goal: nothing is left quantized" in g.summary()


def test_exclude_pattern_matches_one_node_only():
    from onnx_graphsurgeon import Node

    from oq.overrides import matches

    pattern = fallback.exclude_pattern("Relu")
    assert matches(Node(op="Relu", name="Relu"), pattern)
    assert not matches(Node(op="Relu", name="other"), pattern)
    assert not matches(Node(op="Conv", name="a/b.0"), fallback.exclude_pattern("a/bx0"))


def test_cli_goal_on_held_back_samples(resnet, tmp_path, capsys):
    model, path, _ = resnet
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    rc = main(["run", str(model), "--target", "tensorrt", "--calib", str(path), "--min-sqnr", "36", "-o", str(out),
               "--report", str(report), "-q"])
    stdout = capsys.readouterr().out
    assert rc == 0 and out.exists()
    assert "measured on 16 held-back calibration samples (the last quarter of 64; calibrated on the other 48)" in stdout
    assert "goal 36.00 dB met" in stdout and "kept in float" in stdout and "evaluations:" in stdout
    assert "latency: not measured: target tensorrt does not run in onnxruntime" in stdout
    goal = json.loads(report.read_text())["goal"]
    assert goal["goal_db"] == 36.0 and goal["achieved_db"] >= 36.0


@pytest.mark.parametrize("args, expect", [
    (["--min-sqnr", "-3"], "--min-sqnr: must be a number of dB above 0 (output SQNR against fp32), got '-3'"),
    (["--min-sqnr", "abc"], "--min-sqnr: must be a number of dB above 0 (output SQNR against fp32), got 'abc'"),
    (["--min-sqnr", "nan"], "--min-sqnr: must be a number of dB above 0"),
    (["--state", "s.json"], "--state goes with --min-sqnr"),
    (["--min-sqnr", "30", "--prune-evals", "-1"], "--prune-evals (max_pruning): must be an integer >= 0"),
])
def test_cli_bad_goal_is_one_line(args, expect, model_paths, calib_files, tmp_path, capsys):
    path, _ = calib_files["mlp"]
    out = tmp_path / "out.onnx"
    rc = main(["run", str(model_paths["mlp"]), "--calib", str(path), "-o", str(out), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("oq: error:") and expect in err[0], err
    assert not out.exists()
