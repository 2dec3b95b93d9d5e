"""Side files a target emits next to the quantized model (e.g. TensorRT's calibration cache).

Each writer takes the calibrated plan and returns (suffix, bytes); the file is `<output stem><suffix>`.
"""
from __future__ import annotations

import json
import struct
from typing import Callable

import numpy as np

from .errors import OqError
from .plan import QuantPlan


def _amax(plan: QuantPlan) -> dict[str, float]:
    """Per activation tensor: the absolute range its grid covers (scale * qmax for symmetric specs, so that
    amax / 127 gives back the int8 scale)."""
    out = {}
    for name, aq in sorted(plan.activations.items()):
        qp = aq.qparams
        if qp is None:
            continue
        qmin, qmax = qp.spec.qrange
        zp = float(np.asarray(qp.zero_point).reshape(-1)[0])
        scale = float(np.asarray(qp.scale).reshape(-1)[0])
        if qp.spec.symmetric:
            out[name] = (qmax - zp) * scale
        else:
            out[name] = max(abs((qmin - zp) * scale), abs((qmax - zp) * scale))
    return out


def tensorrt_calibration_cache(plan: QuantPlan) -> tuple[str, bytes]:
    """The text cache `trtexec --int8 --calib=FILE` reads: a header, then `tensor: <float32 scale as hex>` lines,
    with scale = amax / 127 (TensorRT's symmetric int8)."""
    lines = ["TRT-8600-EntropyCalibration2"]
    for name, amax in _amax(plan).items():
        if any(c in name for c in "\r\n"):  # one line per tensor: such a name would forge lines of its own
            raise OqError(f"tensor name {name!r} contains a line break, which a TensorRT calibration cache cannot "
                          f"carry; rename the tensor in the model")
        scale = np.float32(amax / 127.0)
        lines.append(f"{name}: {struct.unpack('>I', struct.pack('>f', scale))[0]:08x}")
    return ".calib.cache", ("\n".join(lines) + "\n").encode()


def dynamic_ranges_json(plan: QuantPlan) -> tuple[str, bytes]:
    """{tensor: amax} for APIs that take per-tensor dynamic ranges (ITensor.set_dynamic_range(-amax, amax))."""
    return ".ranges.json", json.dumps(_amax(plan), indent=1, sort_keys=True).encode()


SIDE_FILES: dict[str, Callable[[QuantPlan], tuple[str, bytes]]] = {
    "tensorrt_calibration_cache": tensorrt_calibration_cache,
    "dynamic_ranges_json": dynamic_ranges_json,
}


# side file -> the suffix appended to the output's stem, known before anything runs (output paths are checked first)
SIDE_FILE_SUFFIX = {"tensorrt_calibration_cache": ".calib.cache", "dynamic_ranges_json": ".ranges.json"}
assert set(SIDE_FILE_SUFFIX) == set(SIDE_FILES)


def emit_side_files(names: list[str], plan: QuantPlan) -> dict[str, bytes]:
    """suffix -> content for each side file the target asks for."""
    return dict(SIDE_FILES[n](plan) for n in names)
