"""Every scale and zero-point oq writes, for every reference model x built-in target, against recorded values.

A refactor changes structure, not results: this test fails when any qparam moves. The tolerance (relative 1e-3 on
scales, 1 step on zero-points) covers the float rounding of onnxruntime's kernels on different CPUs during
calibration; weights come from committed fixtures, so the models are the same on every host.

Record anew after an intended change of results (and say why in the commit):
    python -m tests.test_golden --update
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import models
import oq
from oq.target import builtin_names

GOLDEN = Path(__file__).resolve().parent / "golden" / "qparams.json"
SCALE_RTOL = 1e-3


def qparams_of(model: onnx.ModelProto) -> dict[str, list]:
    """{quantized tensor: [scales, zero-points]} from every DequantizeLinear and FakeQuant node of the model."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear":
            scale, zp = node.input[1], node.input[2] if len(node.input) > 2 else ""
        elif node.op_type == "FakeQuant":
            scale, zp = node.input[1], node.input[2]
        else:
            continue
        s = inits[scale].astype(np.float64).reshape(-1)
        z = inits[zp].astype(np.float64).reshape(-1) if zp else np.zeros(1)
        out[node.input[0]] = [[float(f"{v:.7g}") for v in s], [float(v) for v in z]]
    return out


def record(name: str, target: str, calib: Path) -> dict[str, list]:
    result = oq.quantize(models.build(name), target, str(calib), progress=False)
    return qparams_of(result.model)


def _calib(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}.npz"
    np.savez(path, **models.make_inputs(name, 64, seed=0))
    return path


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", models.REFERENCE_MODELS)
def test_qparams_match_the_recorded_values(name, golden, calib_files):
    calib, _ = calib_files[name]
    mismatches = []
    for target in builtin_names():
        got, want = record(name, target, calib), golden[f"{name}/{target}"]
        assert sorted(got) == sorted(want), f"{name}/{target}: quantized tensors differ"
        for tensor, (scales, zps) in want.items():
            s, z = got[tensor]
            if len(s) != len(scales) or not np.allclose(s, scales, rtol=SCALE_RTOL, atol=0):
                worst = np.max(np.abs(np.asarray(s) / np.asarray(scales) - 1)) if len(s) == len(scales) else "shape"
                mismatches.append(f"{target} {tensor}: scale off by {worst}")
            if len(z) != len(zps) or np.max(np.abs(np.asarray(z) - zps), initial=0) > 1:
                mismatches.append(f"{target} {tensor}: zero-point {z[:4]} vs {zps[:4]}")
    assert not mismatches, "\n".join(mismatches[:20])


def main(argv: list[str]) -> int:
    import tempfile

    if argv != ["--update"]:
        print(__doc__)
        return 2
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models.REFERENCE_MODELS:
            calib = _calib(Path(tmp), name)
            for target in builtin_names():
                table[f"{name}/{target}"] = record(name, target, calib)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(table, sort_keys=True, separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size // 1024} KiB, {len(table)} model/target pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
