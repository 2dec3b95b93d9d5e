"""The calibration progress bar: only on a terminal unless asked for, and never junk in a log or a pipe."""
import io
import subprocess
import sys

import numpy as np
import pytest

import models
import oq
from oq.errors import OqError


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    calib = root / "calib.npz"
    np.savez(calib, **models.make_inputs("resnet_mini", 16))
    return models.build("resnet_mini"), calib


class Terminal(io.StringIO):
    def isatty(self):
        return True


def quantize_with_stderr(monkeypatch, resnet, stream, **kwargs):
    model, calib = resnet
    monkeypatch.setattr(sys, "stderr", stream)
    oq.quantize(model, calib=calib, batch_size=4, **kwargs)
    return stream.getvalue()


def assert_clean(text):
    assert "\r" not in text
    assert not any(line.strip() == "" and line for line in text.split("\n")), repr(text)


def test_cli_without_terminal_shows_no_bar(resnet, tmp_path):
    model, calib = resnet
    proc = subprocess.run([sys.executable, "-m", "oq.cli", "run", str(model), "--calib", str(calib),
                           "-o", str(tmp_path / "q.onnx")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "calibrating" not in proc.stderr
    assert_clean(proc.stderr)


@pytest.mark.parametrize("progress", [None, "auto", False])
def test_api_without_terminal_shows_no_bar(monkeypatch, resnet, progress):
    assert quantize_with_stderr(monkeypatch, resnet, io.StringIO(), progress=progress) == ""


def test_forced_progress_without_terminal_is_one_clean_line(monkeypatch, resnet):
    text = quantize_with_stderr(monkeypatch, resnet, io.StringIO(), progress=True)
    assert_clean(text)
    lines = text.splitlines()
    assert len(lines) == 1 and text.endswith("\n"), repr(text)
    assert lines[0].startswith("calibrating: 16 samples in ")


def test_forced_progress_one_line_per_streaming_pass(monkeypatch, resnet):
    # a tiny memory budget splits the observed tensors into several passes over the data
    text = quantize_with_stderr(monkeypatch, resnet, io.StringIO(), progress=True, max_memory_mb=1e-6)
    assert_clean(text)
    lines = text.splitlines()
    assert len(lines) > 1
    for k, line in enumerate(lines):
        assert line.startswith(f"calibrating {k + 1}/{len(lines)}: 16 samples in "), line


def test_terminal_gets_a_bar_that_is_cleared(monkeypatch, resnet):
    text = quantize_with_stderr(monkeypatch, resnet, Terminal(), progress=None)
    assert "calibrating" in text and "/16" in text
    assert text.endswith("\r")  # tqdm's leave=False wipes the line it drew
    assert quantize_with_stderr(monkeypatch, resnet, Terminal(), progress=False) == ""


def test_progress_rejects_other_values(resnet):
    model, calib = resnet
    with pytest.raises(OqError, match="progress must be"):
        oq.quantize(model, calib=calib, progress="sometimes")
