"""The Python entry point: oq.quantize()."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from . import fakequant, ir
from .data import CalibrationData, RandomSource, model_inputs, open_calibration
from .errors import OqError
from .passmanager import Context, FixedPoint, PassManager
from .report import NodeRecord, Report
from .target import Target, load_target, with_bits


@dataclass
class Options:
    batch_size: int = 16
    calib_size: int | None = None
    calib_method: str | None = None
    exclude: list[str] = field(default_factory=list)
    progress: bool = True
    preprocess: str | None = None
    max_memory_mb: float | None = None
    percentile: float | None = None
    overrides: list[str] = field(default_factory=list)
    # deployment CPU for targets whose kernels depend on it (onnxruntime: u8 x s8 pair saturation without VNNI):
    # auto (this machine), vnni, avx2, avx512 (without VNNI), arm64. See oq/passes/saturation.py.
    cpu: str = "auto"
    # cross-layer equalization before quantizing; None: as the target says
    equalize: bool | None = None


@dataclass
class QuantResult:
    model: onnx.ModelProto
    report: Report
    target: Target
    # side files the target emits, keyed by the suffix appended to the output's stem (e.g. ".calib.cache")
    side_files: dict[str, bytes] = field(default_factory=dict)

    def save(self, path: "str | os.PathLike") -> Path:
        """Write the model (and the target's side files beside it), each file atomically."""
        path = ir.save_model(self.model, path)
        if ir.model_size(self.model) >= ir.EXTERNAL_DATA_THRESHOLD:
            # too big to check in memory before writing: check the written file (external data included)
            try:
                onnx.checker.check_model(str(path), full_check=True)
            except Exception as exc:
                raise OqError(f"internal error: {path} fails onnx.checker: {str(exc).splitlines()[0]}") from None
        for suffix, content in self.side_files.items():
            side = path.with_name(path.stem + suffix)
            ir.write_atomic(side, content)
            self.report.side_files.append(str(side))
        return path


def prepare_passes(min_opset: int = 13):
    """Graph clean-up every run starts with; the target only sets the minimum opset."""
    from .passes.canonicalize import Canonicalize
    from .passes.dead_code import RemoveDeadNodes
    from .passes.fold_bn import FoldBatchNorm
    from .passes.fold_constants import FoldConstants
    from .passes.shape_inference import InferShapes

    return [Canonicalize(min_opset), InferShapes(),
            FixedPoint("fold", [FoldConstants(), FoldBatchNorm(), RemoveDeadNodes()]),
            InferShapes()]


def quantize_passes(data: CalibrationData, options: Options, equalize: bool = False):
    from .passes.annotate import Annotate
    from .passes.calibrate import Calibrate
    from .passes.equalize import CrossLayerEqualization
    from .passes.finalize import Finalize
    from .passes.fuse_patterns import FusePatterns
    from .passes.insert_qdq import InsertQDQ
    from .passes.saturation import GuardSaturation
    from .passes.sink_activation import SinkActivationBelowMaxPool

    return [*([CrossLayerEqualization()] if equalize else []), FusePatterns(), Annotate(),
            Calibrate(data, options.batch_size, options.calib_method, options.progress, options.max_memory_mb,
                      {"percentile": options.percentile} if options.percentile is not None else {}),
            GuardSaturation(data, options.cpu, options.batch_size),
            InsertQDQ(), SinkActivationBelowMaxPool(), Finalize()]


def _load(model) -> tuple[onnx.ModelProto, str]:
    if isinstance(model, onnx.ModelProto):
        return model, model.graph.name or "<model>"
    return ir.load_model(model), str(model)


def prepare(model) -> Context:
    """Load and run the preparation passes (canonicalize, shapes, folding) without quantizing."""
    proto, name = _load(model)
    ctx = Context(graph=ir.to_graph(proto), report=Report(model=name))
    PassManager(prepare_passes()).run(ctx)
    return ctx


def quantize(model, target: "str | Target" = "tensorrt", calib=None, *, batch_size: int = 16,
             calib_size: int | None = None, calib_method: str | None = None, exclude=(), overrides=(),
             weight_bits: int | None = None, act_bits: int | None = None,
             progress: bool = True,
             preprocess: str | None = None, max_memory_mb: float | None = None, percentile: float | None = None,
             cpu: str = "auto", export_format: str = "qdq", equalize: bool | None = None,
             output: "str | os.PathLike | None" = None) -> QuantResult:
    """Quantize an ONNX model (path or ModelProto) for `target` with calibration data `calib`.

    calib: an .npz of stacked samples keyed by input name; a folder of .npz feeds (one complete feed each, shapes
    may vary) or of images (with `preprocess`, see oq.preprocess); "module:function" or a Python callable returning
    an iterable of feed dicts; "random" (noise, only on explicit request: the report warns); or a CalibrationData.
    weight_bits/act_bits: narrow the target's integer grids to N bits (2..16; beyond 8 bits needs 16-bit Q/DQ, or the
    academic target's FakeQuant). exclude: node names, op types or regexes kept in float. overrides: "NODE_OR_OP=[weight.|activation.]key:value"
    entries changing the spec on matching nodes (see oq.overrides); ones the target can't honour are reported.
    cpu: the deployment CPU (auto, vnni, avx2, avx512, arm64); for the onnxruntime target a CPU without VNNI gets
    the weight channels whose int16 product pairs saturate re-quantized (a model made for avx2 is safe everywhere).
    equalize: cross-layer equalization (rescaling channels between consecutive Conv/ConvTranspose/Gemm layers so
    per-tensor weight grids fit them); None leaves it to the target (on for vitis).
    Returns QuantResult(model, report, target); with `output`, the model is also written there atomically.
    """
    options = Options(batch_size, calib_size, calib_method, list(exclude), progress, preprocess, max_memory_mb,
                      percentile, list(overrides), cpu=cpu, equalize=equalize)
    if batch_size < 1:
        raise OqError(f"batch size must be >= 1, got {batch_size}")
    from .saturation import CPU_CHOICES
    if cpu not in CPU_CHOICES:
        raise OqError(f"unknown cpu {cpu!r}; choose from {', '.join(CPU_CHOICES)}")
    tgt = load_target(target)
    if weight_bits is not None or act_bits is not None:
        tgt = with_bits(tgt, weight_bits, act_bits)
    proto, name = _load(model)
    if calib is None:
        raise OqError("no calibration data given: pass an .npz, a folder of .npz feeds or images, "
                      "'module:function', or 'random' (not recommended)")
    already = sum(1 for n in proto.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear",
                                                                "DynamicQuantizeLinear") or n.op_type.startswith("QLinear"))
    if already:
        raise OqError(f"{name}: the model is already quantized ({already} quantization nodes); give oq the float "
                      f"model (oq inspect --saturation checks an existing Q/DQ model)")
    data = open_calibration(calib, model_inputs(proto), calib_size, preprocess)
    ctx = Context(graph=ir.to_graph(proto), target=tgt, options=options, report=Report(model=name, target=tgt.name))
    if isinstance(data, RandomSource):
        ctx.report.warnings.append("calibrated on random data: ranges do not reflect real inputs, expect poor "
                                   "accuracy")
    template = onnx.ModelProto(doc_string=proto.doc_string, model_version=proto.model_version, domain=proto.domain)
    template.metadata_props.extend(proto.metadata_props)
    template_inputs = list(proto.graph.input)
    del proto
    min_opset = tgt.opset_min
    if any(i.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
           for i in template_inputs) and min_opset < 19:
        min_opset = 19  # Q/DQ on float16/bfloat16 tensors exists from opset 19
        ctx.report.warnings.append("float16 model: output upgraded to opset 19 for float16 Q/DQ")
    equalize = tgt.cross_layer_equalization if options.equalize is None else options.equalize
    PassManager(prepare_passes(min_opset) + quantize_passes(data, options, equalize)).run(ctx)
    op_of = {n.name: n.op for n in ctx.graph.nodes}
    for node_name, (quantized, reason) in ctx.plan.status.items():
        ctx.report.nodes.append(NodeRecord(node_name, op_of.get(node_name, "?"), quantized, reason))
    result_model = ir.to_model(ctx.graph, template=template)
    ir.pack_4bit(result_model, ctx.facts.get("packed", {}))
    from . import __version__

    result_model.producer_name, result_model.producer_version = "oq", __version__
    onnx.helper.set_model_props(result_model, {**{p.key: p.value for p in result_model.metadata_props},
                                               "oq.target": tgt.name})
    fakequant.attach(result_model)
    if export_format == "qoperator":
        if tgt.format != "qdq" or tgt.activation.dtype not in ("uint8", "int8"):
            raise OqError(f"--format qoperator needs an 8-bit Q/DQ target such as onnxruntime; {tgt.name} is not")
        from .qoperator import to_qoperator

        result_model = to_qoperator(result_model)
        ctx.report.warnings.append("QOperator export: QGemm/QLinearAdd/... are onnxruntime contrib ops")
    elif export_format != "qdq":
        raise OqError(f"unknown export format {export_format!r}; choose qdq or qoperator")
    if ir.model_size(result_model) < ir.EXTERNAL_DATA_THRESHOLD:
        try:
            onnx.checker.check_model(result_model, full_check=True)
        except Exception as exc:
            raise OqError(f"internal error: the quantized model fails onnx.checker: {str(exc).splitlines()[0]}") from None
    from .emit import emit_side_files

    result = QuantResult(result_model, ctx.report, tgt, emit_side_files(tgt.side_files, ctx.plan))
    if output is not None:
        result.save(output)
    return result
