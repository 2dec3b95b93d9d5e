"""Running a model in onnxruntime for the checks: quiet sessions (optimisations off: the graph's own semantics),
intermediate tensors as extra outputs, and capturing their values on a stream of feeds."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import onnx

from .. import ir


def _options(level: str = "ORT_DISABLE_ALL"):
    """Quiet onnxruntime session options at a graph optimisation level (a GraphOptimizationLevel name)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    return so


def _session(model: onnx.ModelProto):
    """A CPU session with optimisations off; models past the protobuf limit go through external data."""
    import tempfile

    import onnxruntime as ort

    so = _options()
    if ir.model_size(model) > ir.EXTERNAL_DATA_THRESHOLD:
        with tempfile.TemporaryDirectory(prefix="oq-saturation-") as tmp:
            path = ir.save_model(model, Path(tmp) / "model.onnx", external_data=True)
            return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _with_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of the model that also returns the named tensors (not already inputs or outputs), typed from its
    value_info or shape inference where known, else left for onnxruntime to infer."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    present = {o.name for o in m.graph.output} | {i.name for i in m.graph.input}
    wanted = [n for n in dict.fromkeys(names) if n not in present]
    if not wanted:
        return m
    known = {vi.name: vi for vi in m.graph.value_info}
    if any(n not in known for n in wanted):
        try:
            inferred = onnx.shape_inference.infer_shapes(m)
            known.update({vi.name: vi for vi in inferred.graph.value_info})
        except Exception:  # noqa: BLE001 - types are a convenience here; onnxruntime infers them too
            pass
    for n in wanted:
        vi = onnx.ValueInfoProto()
        vi.name = n
        if n in known and known[n].type.tensor_type.elem_type:
            vi.type.tensor_type.elem_type = known[n].type.tensor_type.elem_type
        m.graph.output.append(vi)
    return m


def _feeds_iter(feeds) -> Iterable[dict]:
    return [feeds] if isinstance(feeds, dict) else feeds


def capture(model: onnx.ModelProto, names: list[str], feeds) -> Iterable[dict[str, np.ndarray]]:
    """Run the model (onnxruntime, optimisations off) on each feed and yield {name: value} for `names`."""
    inputs = {i.name for i in model.graph.input}
    run_names = [n for n in dict.fromkeys(names) if n not in inputs]
    sess = _session(_with_outputs(model, run_names))
    for feed in _feeds_iter(feeds):
        values = dict(zip(run_names, sess.run(run_names, feed))) if run_names else {}
        values.update({n: feed[n] for n in names if n in inputs})
        yield values
