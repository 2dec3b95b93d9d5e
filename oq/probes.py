"""In-graph probes: reduce observed tensors inside onnxruntime so that only small summaries leave the session.

Fetching whole activations costs a copy per tensor per batch (and, at onnxruntime's default optimisation level, a
reorder out of its blocked NCHWc layout), which can cost more than the inference itself. A probe computes in the
graph what the tensor's observer reads (`Observer.probe`):

- "extent" (minmax, ema): GlobalMaxPool of the tensor, a max per sample and channel that runs on the blocked
  layout directly, and ReduceMin unless the graph proves the tensor non-negative (Relu, Clip at >= 0, Sigmoid,
  ... and shape/pooling ops of those). A proven non-negative tensor reports 0 as its minimum: qparams always
  include 0 in the range, so the result is the same.
- "sample" (the histogram observers): the extent as above, plus a fixed subset of each sample holding at most
  `sample_limit` values, each standing for the same number of values. Rank >= 4 (NCHW...): MaxPool(kernel 1,
  stride s) over the spatial axes, every channel at a regular grid of positions, pooled on the blocked layout.
  Rank 3, whose layout is ambiguous ([N, C, L] audio or [N, tokens, features]): every s-th value of the flattened
  sample, which with an odd s cycles through every feature index (a strided last axis would see the same few
  features of every token and miss a transformer's outlier channels).
- "full": the tensor itself. Used for tensors of rank < 3, non-float tensors, sample probes whose per-sample shape
  is not static or whose axis 0 is not the batch, and for observers that declare no probe (a user's observer gets
  every value, as before).

onnxruntime's pooling and reductions skip NaN; calibration feeds are checked for NaN/inf before they run, and an
infinite value inside the graph still shows up in the extent.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import ir
from .observers import Observer

# Ops whose output is >= 0 whatever their input; and ops whose output is non-negative when their (data) inputs are.
_NONNEGATIVE_OPS = {"Relu", "Sigmoid", "Softmax", "Abs", "Exp", "HardSigmoid", "Softplus", "ReduceL1", "ReduceL2",
                    "ReduceSumSquare"}
_PRESERVING_OPS = {"MaxPool", "GlobalMaxPool", "AveragePool", "GlobalAveragePool", "Reshape", "Flatten", "Transpose",
                   "Squeeze", "Unsqueeze", "Identity", "Slice", "Gather", "Expand", "Tile",
                   "DepthToSpace", "SpaceToDepth", "ReduceMax", "ReduceMin", "ReduceMean", "Split", "Concat", "Mul",
                   "Add", "Max", "Min"}
_ALL_INPUTS = {"Concat", "Mul", "Add", "Min"}  # non-negative when every input is; Max needs one; others the first


@dataclass
class Probe:
    tensor: str
    kind: str  # "extent", "sample" or "full"
    nonnegative: bool = False
    hi: str | None = None  # fetched: GlobalMaxPool output
    lo: str | None = None  # fetched: ReduceMin output (absent for non-negative tensors)
    sample: str | None = None  # fetched: the sub-grid (or the tensor itself when it is small)
    stride: int = 1  # of the sub-sample: over each spatial axis (rank >= 4) or the flattened sample (rank 3)
    weight: int = 1  # values of the sample each sub-sampled value stands for
    per_sample: int | None = None  # elements of one sample, when static
    fetch_per_sample: int | None = None  # elements fetched for one sample, when static
    fetch: list[str] = field(default_factory=list)


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    out = {t.name: t for t in model.graph.initializer}
    values = {}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    for name, t in out.items():
        if t.data_location != onnx.TensorProto.EXTERNAL and np.prod(t.dims, dtype=np.int64) <= 16:
            values[name] = numpy_helper.to_array(t)
    return values


def nonnegative_tensors(model: onnx.ModelProto) -> set[str]:
    """Tensors that are >= 0 for any input, by the ops that produce them (nodes in topological order)."""
    consts = _constants(model)
    known: set[str] = {name for name, v in consts.items() if v.size and np.all(v >= 0)}
    for node in model.graph.node:
        op, ins = node.op_type, [i for i in node.input]
        if op in _NONNEGATIVE_OPS:
            ok = True
        elif op == "Clip":
            lo = None
            if len(ins) > 1 and ins[1]:
                lo = consts.get(ins[1])
            else:
                lo = next((np.asarray(a.f) for a in node.attribute if a.name == "min"), None)
            ok = lo is not None and lo.size == 1 and float(lo) >= 0.0
        elif op in ("Resize", "Upsample"):  # cubic interpolation overshoots below 0
            mode = next((a.s.decode() for a in node.attribute if a.name == "mode"), "nearest")
            ok = mode != "cubic" and bool(ins) and ins[0] in known
        elif op == "Max":
            ok = any(i in known for i in ins if i)
        elif op in _ALL_INPUTS:
            ok = all(i in known for i in ins if i)
        elif op in _PRESERVING_OPS:
            ok = bool(ins) and ins[0] in known
        else:
            ok = False
        if ok:
            known.update(o for o in node.output if o)
    return known


def _tensor_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto.Tensor]:
    g = model.graph
    return {vi.name: vi.type.tensor_type for vi in list(g.value_info) + list(g.input) + list(g.output)}


def _static_tail(tt: onnx.TypeProto.Tensor) -> list[int] | None:
    dims = tt.shape.dim[1:]
    if not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
        return None
    return [d.dim_value for d in dims]


def _stride(tail: list[int], limit: int) -> int:
    """Smallest odd stride s over the spatial axes with C * prod(ceil(d / s)) <= limit (or the coarsest grid).
    Odd, so that the sub-grid visits every phase of the 2-periodic patterns that stride-2 convolutions and 2x
    upsampling leave in activations."""
    channels, spatial = tail[0], tail[1:]
    s = 1
    while channels * int(np.prod([-(-d // s) for d in spatial])) > limit and s < max(spatial):
        s += 2
    return s


def plan_probes(model: onnx.ModelProto, observers: dict[str, Observer]) -> dict[str, Probe]:
    types = _tensor_types(model)
    nonneg = nonnegative_tensors(model)
    probes = {}
    for name, obs in observers.items():
        kind = getattr(obs, "probe", "full")
        tt = types.get(name)
        rank = len(tt.shape.dim) if tt is not None and tt.HasField("shape") else 0
        if tt is None or tt.elem_type != onnx.TensorProto.FLOAT or rank < 3:
            kind = "full"
        tail = _static_tail(tt) if kind != "full" else None
        probe = Probe(name, kind, nonnegative=name in nonneg)
        if tail is not None:
            probe.per_sample = int(np.prod(tail))
            probe.fetch_per_sample = tail[0] + 1  # a max per channel and a min
        if kind == "sample":
            limit = getattr(obs, "sample_limit", None)
            if tail is None or not getattr(obs, "rows_are_samples", False) or not limit:
                probe.kind = "full"
            elif rank == 3:
                n = int(np.prod(tail))
                s = 1
                while -(-n // s) > limit:
                    s += 2
                probe.stride, probe.weight, probe.fetch_per_sample = s, s, -(-n // s)
            else:
                s = _stride(tail, limit)
                probe.stride, probe.weight = s, s ** (rank - 2)
                probe.fetch_per_sample = tail[0] * int(np.prod([-(-d // s) for d in tail[1:]]))
        probes[name] = probe
    return probes


def add_probes(model: onnx.ModelProto, probes: dict[str, Probe]) -> onnx.ModelProto:
    """A copy of the model that computes every probe and returns what it fetches (and the full tensors)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    present = {o.name for o in g.output}
    types = _tensor_types(model)
    fresh = ir.Namer.of_model(model)

    def fetch(name: str, elem: int = onnx.TensorProto.FLOAT) -> str:
        if name not in present:
            g.output.append(helper.make_tensor_value_info(name, elem, None))
            present.add(name)
        return name

    for k, probe in enumerate(probes.values()):
        t = probe.tensor
        if probe.kind == "full":
            tt = types.get(t)
            probe.fetch = [fetch(t, (tt.elem_type if tt is not None and tt.elem_type else onnx.TensorProto.FLOAT))]
            continue
        probe.hi = fresh(f"oq_probe{k}_max")
        g.node.append(helper.make_node("GlobalMaxPool", [t], [probe.hi], name=fresh(f"oq_probe{k}_max_node")))
        probe.fetch = [fetch(probe.hi)]
        if not probe.nonnegative:
            probe.lo = fresh(f"oq_probe{k}_min")
            g.node.append(helper.make_node("ReduceMin", [t], [probe.lo], keepdims=0,
                                           name=fresh(f"oq_probe{k}_min_node")))
            probe.fetch.append(fetch(probe.lo))
        if probe.kind == "sample":
            rank, stride = len(types[t].shape.dim), probe.stride
            if stride == 1:
                probe.sample = t
            elif rank == 3:
                flat, step = fresh(f"oq_probe{k}_flat"), fresh(f"oq_probe{k}_step")
                bounds = [fresh(f"oq_probe{k}_{b}") for b in ("start", "end", "axis")]
                for name, value in zip([*bounds, step], [0, np.iinfo(np.int64).max, 1, stride]):
                    g.initializer.append(numpy_helper.from_array(np.array([value], np.int64), name))
                probe.sample = fresh(f"oq_probe{k}_grid")
                g.node.append(helper.make_node("Flatten", [t], [flat], axis=1, name=fresh(f"oq_probe{k}_flat_node")))
                g.node.append(helper.make_node("Slice", [flat, *bounds, step], [probe.sample],
                                               name=fresh(f"oq_probe{k}_grid_node")))
            else:
                probe.sample = fresh(f"oq_probe{k}_grid")
                g.node.append(helper.make_node("MaxPool", [t], [probe.sample], kernel_shape=[1] * (rank - 2),
                                               strides=[stride] * (rank - 2), name=fresh(f"oq_probe{k}_grid_node")))
            probe.fetch.append(fetch(probe.sample))
    return out


def deliver(observer: Observer, probe: Probe, outputs: dict[str, np.ndarray]) -> None:
    """Hand one batch's fetched values to the observer, in the form its probe asked for."""
    if probe.kind == "full":
        observer.update(np.asarray(outputs[probe.tensor]))
        return
    hi_part = outputs[probe.hi]
    if hi_part.size == 0:
        return
    hi = float(hi_part.max())
    lo = 0.0 if probe.nonnegative else float(outputs[probe.lo])
    if not (np.isfinite(lo) and np.isfinite(hi)):
        observer.nonfinite = True
        return
    lo = min(lo, hi)  # an all-positive, proven non-negative tensor: 0 stands for its minimum
    if probe.kind == "extent":
        count = hi_part.shape[0] * (probe.per_sample or int(np.prod(hi_part.shape[1:])))
        observer.update_extent(lo, hi, count)
    else:
        observer.update_sample(lo, hi, outputs[probe.sample], probe.weight)
