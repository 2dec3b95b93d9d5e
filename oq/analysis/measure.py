"""The model runs of an analysis: fp32, the float twin and the quantized model side by side (graphwise), then one
run per quantized node with only that node quantized (layerwise). Everything runs with graph optimisation off, so
onnxruntime computes the Q/DQ graph as written."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import onnx

from ..calibration import progress_reporter
from ..runtime import session
from . import parallel
from .quantizers import Quantizer
from .stats import ErrorStats, TensorStats
from .variants import single_node, with_outputs

AUTO_PARALLEL_S = 5.0  # jobs None: serial work left, in seconds, above which workers are started


@dataclass
class Graphwise:
    tensors: dict[str, TensorStats]  # per activation quantizer output
    outputs: dict[str, ErrorStats]  # per model output, quantized vs fp32
    overall: ErrorStats  # all model outputs together
    reference: ErrorStats  # the float twin vs fp32
    fp32: list[dict[str, np.ndarray]] = field(default_factory=list)  # fp32 outputs per batch, for layerwise
    samples: int = 0


def _float_outputs(model: onnx.ModelProto) -> list[str]:
    return [o.name for o in model.graph.output
            if o.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16)]


def graphwise(fp32: onnx.ModelProto, twin: onnx.ModelProto, quantized: onnx.ModelProto,
              quantizers: list[Quantizer], data, batch_size: int, progress) -> Graphwise:
    acts = [qz for qz in quantizers if not qz.constant]
    names = [qz.output for qz in acts]
    types = {qz.output: qz.elem_type for qz in acts}
    outputs = _float_outputs(fp32)
    ref_session = session(fp32, "disable")
    twin_session = session(with_outputs(twin, names, types), "disable")
    q_session = session(with_outputs(quantized, names, types), "disable")
    result = Graphwise({n: TensorStats() for n in names}, {o: ErrorStats() for o in outputs}, ErrorStats(),
                       ErrorStats())
    bar = progress_reporter(progress, "analyze: graphwise", len(data) or None)
    try:
        for count, feed in data.batches(batch_size):
            ref = dict(zip(outputs, ref_session.run(outputs, feed)))
            twin_values = dict(zip(outputs + names, twin_session.run(outputs + names, feed)))
            q_values = dict(zip(outputs + names, q_session.run(outputs + names, feed)))
            for name in outputs:
                result.outputs[name].add(ref[name], q_values[name])
                result.overall.add(ref[name], q_values[name])
                result.reference.add(ref[name], twin_values[name])
            for qz in acts:
                value = twin_values[qz.output]
                lo, hi = qz.bounds(value.ndim)
                result.tensors[qz.output].add_clipped(value, q_values[qz.output], lo, hi)
            result.fp32.append(ref)
            result.samples += count
            bar.update(count)
    finally:
        bar.close()
    return result


def node_stats(variant, batches: list, fp32: list[dict[str, np.ndarray]], on_batch=None) -> ErrorStats:
    """The model outputs of one single-node variant vs fp32, over the batches in order: the one reduction the serial
    and the parallel sweep share, so both give the same floats."""
    stats = ErrorStats()
    for (count, feed), ref in zip(batches, fp32):
        for name, value in zip(ref, variant.run(list(ref), feed)):
            stats.add(ref[name], value)
        if on_batch is not None:
            on_batch(count)
    return stats


def layerwise(twin: onnx.ModelProto, quantized: onnx.ModelProto, quantizers: list[Quantizer], nodes: list[str],
              data, batch_size: int, fp32: list[dict[str, np.ndarray]], samples: int, progress,
              jobs: int | None = 1) -> dict[str, ErrorStats]:
    """Per node: the model outputs (all together) with only that node's quantizers, vs fp32; with jobs > 1 on that
    many worker processes (oq.analysis.parallel), the same numbers. jobs None: the first node runs here, and the
    rest go to one worker per usable CPU only when they would take over AUTO_PARALLEL_S here (starting a worker
    costs about a second: small sweeps are faster without)."""
    out: dict[str, ErrorStats] = {}
    pending = list(nodes)
    bar = progress_reporter(progress, f"analyze: layerwise ({len(nodes)} nodes)", len(nodes) * samples or None)
    try:
        if jobs is None:
            start = time.perf_counter()
            if pending:
                out.update(_serial(twin, quantized, quantizers, pending[:1], data, batch_size, fp32, bar))
                pending = pending[1:]
            per_node = time.perf_counter() - start
            jobs = parallel.usable_cpus() if per_node * len(pending) > AUTO_PARALLEL_S else 1
        if jobs > 1 and len(pending) > 1:
            out.update(parallel.sweep(twin, quantized, quantizers, pending, list(data.batches(batch_size)), fp32, jobs,
                             lambda node: bar.update(samples)))
        else:
            out.update(_serial(twin, quantized, quantizers, pending, data, batch_size, fp32, bar))
    finally:
        bar.close()
    return {node: out[node] for node in nodes}


def _serial(twin, quantized, quantizers, nodes, data, batch_size, fp32, bar) -> dict[str, ErrorStats]:
    return {node: node_stats(session(single_node(twin, quantized, node, quantizers), "disable"),
                             data.batches(batch_size), fp32, bar.update) for node in nodes}
