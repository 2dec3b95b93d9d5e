"""What a user reads: the target listing, the run's table, and the counts `oq run` and `oq inspect` print."""
import subprocess
import sys

import numpy as np
import onnx
import pytest

import models
import oq
from oq.cli import main
from oq.target import builtin_names, load_target


@pytest.fixture(scope="module")
def equalized(tmp_path_factory):
    """resnet_mini quantized for tensorrt with cross-layer equalization, saved, with its report."""
    root = tmp_path_factory.mktemp("ux")
    calib = root / "calib.npz"
    np.savez(calib, **models.make_inputs("resnet_mini", 16))
    result = oq.quantize(models.build("resnet_mini"), target="tensorrt", calib=calib, equalize=True, progress=False)
    out = root / "q.onnx"
    result.save(out)
    return result, out


def test_targets_listing_is_whole_sentences_and_aligned(capsys):
    assert main(["targets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(builtin_names())
    for name, line in zip(builtin_names(), lines):
        assert len(line) <= 100, line
        assert line.endswith((".", "…")), line
        summary = load_target(name).summary()
        assert line.index(summary) == 15 and line == f"{name:<14} {summary}", line  # one column for all
        if summary.endswith("…"):
            assert summary[:-1] == summary[:-1].rstrip(), line  # cut between words
            assert " ".join(load_target(name).description.split()).startswith(summary[:-1])


def test_report_table_columns_line_up(equalized):
    result, _ = equalized
    table = result.report.format_table()
    lines = table.splitlines()
    assert not [line for line in lines if line.endswith(" ")]
    header = next(line for line in lines if line.startswith("pass "))
    col = header.index("changed")
    names = [p.name for p in result.report.passes]
    assert "cross-layer-equalization" in names
    rows = [line for line in lines if line.split(" ", 1)[0] in names]
    assert len(rows) == len(names)
    for row, p in zip(rows, result.report.passes):
        assert row[:col].rstrip() == p.name and row[col - 1] == " ", row
        assert row[col:].split()[0] == ("yes" if p.modified else "no"), row
    # the time column ends where its header ends
    time_end = header.index("time") + len("time")
    for row in rows:
        assert row[:time_end].endswith("ms") and row[time_end] == " ", row


def test_run_and_inspect_name_what_they_count(equalized):
    result, path = equalized
    report = result.report
    run_phrase = (f"quantized {len(report.quantized_nodes)} of {len(report.nodes)} nodes "
                  f"(incl. ops fused into quantized kernels)")
    assert run_phrase in report.format_table()

    graph = onnx.load(str(path)).graph
    dq_outputs = set()
    for node in graph.node:
        if node.op_type == "DequantizeLinear":
            dq_outputs.update(node.output)
    readers = 0
    for node in graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") and dq_outputs.intersection(node.input):
            readers += 1
    assert 0 < readers < len(report.quantized_nodes)  # fused ReLUs read float tensors in the graph

    proc = subprocess.run([sys.executable, "-m", "oq.cli", "inspect", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"quantized: {readers} nodes read a DequantizeLinear output" in proc.stdout
    assert "run on quantized inputs" not in proc.stdout
