"""oq.analyze: quantize as `oq run` would, then measure which quantized tensors and nodes cost accuracy."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..api import _load, run as quantize_run
from ..config import RunConfig, keyword_names
from ..data import model_inputs, open_calibration
from ..errors import OqError
from ..opinfo import weighted_op
from .floatweights import float_inputs, prepared_graph
from .hints import hint
from .channels import attach_channel_ranges
from .measure import graphwise, layerwise as measure_layerwise
from .parallel import check_jobs
from .quantizers import Quantizer, find_quantizers, refuse_unsupported
from .records import Analysis, NodeRecord, TensorRecord
from .stats import sqnr_db
from .variants import constant_values, float_twin

PLOTTED = 4  # tensors with a histogram, weighted nodes with channel ranges


def analyze(model, target="tensorrt", calib=None, eval=None, *, layerwise: bool = True, eval_size: int | None = None,
            jobs: int | None = None, **options) -> Analysis:
    """Quantize `model` for `target` with `calib` (any oq.quantize keyword in `options`), then measure on `eval`
    (same forms as `calib`; None: the calibration samples) the error of every quantized activation with the whole
    model quantized (graphwise), and with `layerwise` the model output error with one node quantized at a time, on
    `jobs` worker processes (None: one per usable CPU when the sweep is long enough to gain; 1: in this process;
    the numbers are the same)."""
    unknown = sorted(set(options) - set(keyword_names()))
    if unknown:
        raise OqError(f"oq.analyze: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
    config = RunConfig(target=target, calib=calib, **options)
    return analyze_config(model, config, eval, layerwise=layerwise, eval_size=eval_size, jobs=jobs)


def _open_eval(eval_data, config: RunConfig, proto: onnx.ModelProto, eval_size: int | None):
    specs = model_inputs(proto)
    if eval_data is None:
        return open_calibration(config.calib, specs, config.calib_size, config.preprocess)
    folder = isinstance(eval_data, (str, os.PathLike)) and Path(eval_data).is_dir()
    try:
        return open_calibration(eval_data, specs, eval_size, config.preprocess if folder else None)
    except OqError as exc:
        raise OqError(f"--eval: {str(exc).replace('calibration', 'evaluation')}") from None


def _float_values(quantizers, dequantized, config, target, proto, warnings) -> dict[str, np.ndarray]:
    """Quantizer output -> float weight, for the quantizers that store codes (the dequantized value where the
    float one cannot be found, with a warning)."""
    coded = [qz for qz in quantizers if qz.constant and qz.nodes[0].op_type == "DequantizeLinear"]
    if not coded:
        return {}
    found = float_inputs(prepared_graph(proto, config, target))
    out = {}
    for qz in coded:
        values = [found.get(c) for c in qz.consumers]
        if values and all(v is not None and v.shape == dequantized[qz.output].shape for v in values):
            out[qz.output] = values[0]
        else:
            warnings.append(f"no float value found for {qz.source}: its dequantized value stands in for it")
            out[qz.output] = dequantized[qz.output]
    return out


def analyze_config(model, config: RunConfig, eval_data=None, *, layerwise: bool = True,
                   eval_size: int | None = None, jobs: int | None = None) -> Analysis:
    jobs = check_jobs(jobs)
    if config.export_format != "qdq":
        raise OqError("oq analyze measures Q/DQ models: leave --format at qdq")
    proto, name, _ = _load(model)
    data = _open_eval(eval_data, config, proto, eval_size)
    result = quantize_run(model if not isinstance(model, onnx.ModelProto) else proto, config)
    quantized = result.model
    refuse_unsupported(quantized)
    quantizers = find_quantizers(quantized)
    warnings = list(result.report.warnings)
    if not quantizers:
        raise OqError(f"{name}: nothing was quantized for target {result.target.name}; nothing to analyze")
    dequantized = constant_values(quantized, quantizers)
    floats = _float_values(quantizers, dequantized, config, result.target, proto, warnings)
    twin = float_twin(quantized, quantizers, floats)
    inits = {i.name: i for i in quantized.graph.initializer}
    weights = {qz.output: floats[qz.output] if qz.output in floats else numpy_helper.to_array(inits[qz.source])
               for qz in quantizers if qz.constant}
    method = str(result.report.calibration.get("method") or config.calib_method or "target default")
    g = graphwise(proto, twin, quantized, quantizers, data, config.batch_size, config.progress)
    if g.samples == 0:
        raise OqError("the evaluation data holds no samples")
    tensors = _tensor_records(quantized, quantizers, g, method)
    nodes, weight_of = _node_records(quantized, quantizers, tensors, weights, dequantized)
    if layerwise:
        per_node = measure_layerwise(twin, quantized, quantizers, [n.name for n in nodes], data,
                                     config.batch_size, g.fp32, g.samples, config.progress, jobs)
        for n in nodes:
            n.layerwise_sqnr_db = per_node[n.name].sqnr_db
            n.noise_share = per_node[n.name].noise / g.overall.noise if g.overall.noise else 0.0
    for n in nodes:
        n.hint = hint(n, method)
    tensors.sort(key=lambda t: (t.sqnr_db, t.order))
    nodes.sort(key=lambda n: (n.layerwise_sqnr_db if layerwise else (n.input_sqnr_db if n.input_sqnr_db is not None
                                                                      else float("inf")), n.order))
    if g.reference.sqnr_db < 60:
        warnings.append(f"the float twin differs from the fp32 model ({g.reference.sqnr_db:.1f} dB): per-node "
                        f"numbers are approximate")
    analysis = Analysis(
        model=name, target=result.target.name, samples=g.samples,
        eval_source="calibration data" if eval_data is None else _describe(eval_data),
        on_calibration_data=eval_data is None, calib_method=method, output_sqnr_db=g.overall.sqnr_db,
        output_cosine=g.overall.cosine,
        outputs={k: {"sqnr_db": s.sqnr_db, "cosine": s.cosine} for k, s in g.outputs.items()},
        reference_sqnr_db=g.reference.sqnr_db, tensors=tensors, nodes=nodes, layerwise=layerwise,
        warnings=warnings, options=result.report.options)
    for t in tensors[:PLOTTED]:
        analysis.histograms[t.tensor] = g.tensors[t.dequantized].sample()
    attach_channel_ranges(analysis, quantized, weight_of, weights, PLOTTED)
    return analysis


def _describe(source) -> str:
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    if isinstance(source, dict):
        return "evaluation arrays"
    if isinstance(source, (list, tuple)):
        return "evaluation feeds"
    return getattr(source, "__name__", type(source).__name__)


def _tensor_records(quantized, quantizers, g, method: str) -> list[TensorRecord]:
    producer = {o: n for n in quantized.graph.node for o in n.output}
    op_of = {n.name: n.op_type for n in quantized.graph.node}
    out = []
    for qz in quantizers:
        if qz.constant:
            continue
        stats = g.tensors[qz.output]
        prod = producer.get(qz.source)
        lo, hi = qz.bounds(1)
        out.append(TensorRecord(
            tensor=qz.source, dequantized=qz.output, order=qz.order, producer=prod.name if prod else "",
            producer_op=prod.op_type if prod else "", consumers=[f"{c} ({op_of.get(c, '?')})" for c, _ in qz.consumers],
            shape=stats.shape or [], dtype=qz.dtype, scale=[float(s) for s in qz.scale.ravel()],
            zero_point=[float(z) for z in qz.zero_point.ravel()],
            range=[float(np.min(lo)), float(np.max(hi))], fp32_range=[stats.lo, stats.hi], calib_method=method,
            sqnr_db=stats.sqnr_db, cosine=stats.cosine, clip_ratio=stats.clip_ratio,
            clip_noise_share=stats.clip_noise_share))
    return out


def _node_records(quantized, quantizers, tensors, weights, dequantized
                  ) -> tuple[list[NodeRecord], dict[str, Quantizer]]:
    """One record per node reading a quantizer's output, and each weighted node's weight quantizer."""
    by_output = {t.dequantized: t for t in tensors}
    feeding: dict[str, list[tuple[int, Quantizer]]] = {}
    for qz in quantizers:
        for consumer, idx in qz.consumers:
            feeding.setdefault(consumer, []).append((idx, qz))
    out, weight_of = [], {}
    for order, node in enumerate(quantized.graph.node):
        if node.name not in feeding:
            continue
        info = weighted_op(node.op_type)
        acts = [by_output[qz.output] for _, qz in sorted(feeding[node.name], key=lambda p: p[0])
                if not qz.constant]
        consts = [(idx, qz) for idx, qz in feeding[node.name] if qz.constant]
        weight = next((qz for idx, qz in consts if info is None or idx == info.weight_input), None)
        clipped = max(acts, key=lambda t: t.clip_ratio, default=None)
        w_sqnr = None
        if weight is not None:
            weight_of[node.name] = weight
            ref = np.asarray(weights[weight.output], np.float64)
            w_sqnr = sqnr_db(float((ref ** 2).sum()), float(((ref - dequantized[weight.output]) ** 2).sum()))
        out.append(NodeRecord(
            name=node.name, op=node.op_type, order=order, inputs=[t.tensor for t in acts],
            weight=weight.source.removesuffix("_quantized") if weight is not None else None, layerwise_sqnr_db=None,
            input_sqnr_db=min((t.sqnr_db for t in acts), default=None),
            weight_sqnr_db=w_sqnr, clip_ratio=clipped.clip_ratio if clipped else 0.0,
            clip_noise_share=clipped.clip_noise_share if clipped else 0.0))
    return out, weight_of
