"""Streaming calibration: one onnxruntime session, each batch reduced into observers, nothing else kept."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from tqdm import tqdm

from . import ir
from .data import CalibrationData
from .errors import OqError
from .observers import Observer


def _session(model: onnx.ModelProto, workdir: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if ir.model_size(model) > ir.EXTERNAL_DATA_THRESHOLD:
        path = ir.save_model(model, workdir / "calibration.onnx", external_data=True)
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A shallow variant of the model that also returns the named tensors."""
    augmented = onnx.ModelProto()
    augmented.CopyFrom(model)
    present = {o.name for o in augmented.graph.output}
    known = {vi.name: vi.type.tensor_type.elem_type for vi in augmented.graph.value_info}
    for name in names:
        if name not in present:
            elem = known.get(name) or onnx.TensorProto.FLOAT
            augmented.graph.output.append(helper.make_tensor_value_info(name, elem, None))
    return augmented


def observe(model: onnx.ModelProto, observers: dict[str, Observer], data: CalibrationData, batch_size: int = 1,
            progress: bool = True) -> dict:
    """Stream `data` through the model once, updating observers[tensor] with every batch. Returns run statistics."""
    names = list(observers)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="oq-calib-") as workdir:
        try:
            session = _session(with_outputs(model, names), Path(workdir))
        except Exception as exc:
            raise OqError(f"onnxruntime cannot load the model for calibration: {str(exc).splitlines()[0][:300]}") from None
        bar = tqdm(total=len(data) or None, unit="sample", desc="calibrating", disable=not progress, leave=False)
        samples = 0
        for count, feed in data.batches(batch_size):
            try:
                outputs = session.run(names, feed)
            except Exception as exc:
                raise OqError(f"{data.where}: onnxruntime failed on samples {samples}..{samples + count - 1}: "
                              f"{str(exc).splitlines()[0][:300]}") from None
            for name, value in zip(names, outputs):
                observers[name].update(np.asarray(value))
            del outputs
            samples += count
            bar.update(count)
        bar.close()
    return {"samples": samples, "tensors": len(names), "seconds": time.perf_counter() - start}
