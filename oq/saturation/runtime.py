"""Running a model in onnxruntime for the checks: quiet sessions (optimisations off: the graph's own semantics),
intermediate tensors as extra outputs, and capturing their values on a stream of feeds."""
from __future__ import annotations

from typing import Iterable

import numpy as np
import onnx



def _session(model: onnx.ModelProto):
    """A CPU session with optimisations off; models past the protobuf limit go through external data."""
    from ..runtime import session

    return session(model, "disable")


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
