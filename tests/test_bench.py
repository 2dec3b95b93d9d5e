"""The benchmark commands run end to end (their numbers are for people to read, not for tests to time)."""
import numpy as np

import models
from benchmarks import calibration


def test_calibration_benchmark_on_user_model_and_data(capsys, tmp_path):
    path = models.build("mlp")
    np.savez(tmp_path / "d.npz", **models.make_inputs("mlp", 12))
    calibration.main(["--model", str(path), "--calib", str(tmp_path / "d.npz"), "--samples", "8", "40",
                      "--repeats", "1", "--methods", "minmax", "mse"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    # 40 is capped at the 12 samples the file holds
    assert {r[0] for r in rows} == {"8", "12"}
    for n in ("8", "12"):
        mine = {" ".join(r[1:3]): r for r in rows if r[0] == n}
        assert {"fp32 pass", "oq minmax", "ort minmax", "oq mse"} <= set(mine), out
        assert float(mine["oq minmax"][3]) > 0 and float(mine["ort minmax"][3]) > 0
        assert "no matching method" in out  # onnxruntime has no MSE calibrator
