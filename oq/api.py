"""The Python entry points: oq.quantize() and oq.prepare().

A run is: load the model, build the context, run one pass pipeline, return the result. The pipeline comes from the
module named by RunConfig.pipeline (the built-in one is oq.passes.pipeline); core code never imports a pass.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from . import ir
from .config import RunConfig, keyword_names
from .data import RandomSource, model_inputs, open_calibration
from .errors import InternalError, OqError
from .emit import SIDE_FILE_SUFFIX
from .outputs import OutputPlan, calibration_files
from .passmanager import Context, PassManager
from .plugins import resolve
from .report import NodeRecord, Report
from .target import Target, load_target, with_bits

QUANTIZATION_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")


@dataclass
class QuantResult:
    model: onnx.ModelProto
    report: Report
    target: Target
    # side files the target emits, keyed by the suffix appended to the output's stem (e.g. ".calib.cache")
    side_files: dict[str, bytes] = field(default_factory=dict)
    # the files the run read (model, external data, calibration data): never to be written over
    inputs: list[Path] = field(default_factory=list)

    def output_plan(self, path: "str | os.PathLike", report: "str | os.PathLike | None" = None) -> OutputPlan:
        return OutputPlan(Path(path), self.inputs, list(self.side_files), Path(report) if report else None)

    def save(self, path: "str | os.PathLike", report: "str | os.PathLike | None" = None) -> Path:
        """Write the model, the target's side files beside it and (given a path) the report as JSON: all of them or
        none, never over an input file."""
        path = Path(path)

        def verify(staged: Path) -> None:
            if ir.model_size(self.model) >= ir.EXTERNAL_DATA_THRESHOLD:
                # too big to check in memory: check the written file (external data included) before it is placed
                try:
                    onnx.checker.check_model(str(staged), full_check=True)
                except Exception as exc:
                    raise InternalError(f"the quantized model fails onnx.checker: {str(exc).splitlines()[0]}")

        def report_bytes(side_paths: list[Path]) -> bytes:
            self.report.side_files = [str(p) for p in side_paths]
            return self.report.to_json().encode()

        side_paths = self.output_plan(path, report).commit(self.model, self.side_files, report_bytes, verify)
        self.report.side_files = [str(p) for p in side_paths]
        return path


def _load(model) -> tuple[onnx.ModelProto, str, list[Path]]:
    """The model, its name for messages, and the files it was read from."""
    if isinstance(model, onnx.ModelProto):
        ir.check_ir_version(model, model.graph.name or "<model>")
        return model, model.graph.name or "<model>", []
    proto, files = ir.load_model_and_files(model)
    return proto, str(model), files


def prepare(model, pipeline: str = RunConfig.pipeline) -> Context:
    """Load and run the preparation passes (canonicalize, shapes, folding) without quantizing."""
    proto, name, _ = _load(model)
    ctx = Context(graph=ir.to_graph(proto), report=Report(model=name))
    PassManager(resolve(f"{pipeline}:preparation", "pipeline")()).run(ctx)
    return ctx


def _refuse_quantized(proto: onnx.ModelProto, name: str) -> None:
    already = sum(1 for n in proto.graph.node if n.op_type in QUANTIZATION_OPS or n.op_type.startswith("QLinear"))
    if already:
        raise OqError(f"{name}: the model is already quantized ({already} quantization nodes); give oq the float "
                      f"model (oq inspect --saturation checks an existing Q/DQ model)")


def _resolve_target(config: RunConfig) -> Target:
    tgt = load_target(config.target)
    if config.weight_bits is not None or config.act_bits is not None:
        tgt = with_bits(tgt, config.weight_bits, config.act_bits)
    if config.export_format == "qoperator" and (tgt.format != "qdq" or tgt.activation.dtype not in ("uint8", "int8")):
        raise OqError(f"--format qoperator needs an 8-bit Q/DQ target such as onnxruntime; {tgt.name} is not")
    return tgt


def run(model, config: RunConfig, output: "str | os.PathLike | None" = None,
        report: "str | os.PathLike | None" = None) -> QuantResult:
    """Quantize `model` (a path or ModelProto) as `config` says. Given the `output` (and `report`) paths the result
    will be saved to, they are checked before any work (QuantResult.save writes them)."""
    tgt = _resolve_target(config)
    proto, name, model_files = _load(model)
    calib_files = calibration_files(config.calib)
    inputs = model_files + calib_files
    if output is not None:
        suffixes = [SIDE_FILE_SUFFIX[side] for side in tgt.side_files]
        OutputPlan(Path(output), inputs, suffixes, Path(report) if report else None).validate()
    if config.calib is None:
        raise OqError("no calibration data given: pass an .npz, a folder of .npz feeds or images, "
                      "'module:function', or 'random' (not recommended)")
    _refuse_quantized(proto, name)
    data = open_calibration(config.calib, model_inputs(proto), config.calib_size, config.preprocess)
    template = onnx.ModelProto(doc_string=proto.doc_string, model_version=proto.model_version, domain=proto.domain)
    template.metadata_props.extend(proto.metadata_props)
    ctx = Context(graph=ir.to_graph(proto), target=tgt, template=template, report=Report(model=name, target=tgt.name),
                  input_model=model)
    if isinstance(data, RandomSource):
        ctx.report.warnings.append("calibrated on random data: ranges do not reflect real inputs, expect poor "
                                   "accuracy")
    min_opset = tgt.opset_min
    if any(i.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
           for i in proto.graph.input) and min_opset < 19:
        min_opset = 19  # Q/DQ on float16/bfloat16 tensors exists from opset 19
        ctx.report.warnings.append("float16 model: output upgraded to opset 19 for float16 Q/DQ")
    del proto
    from . import __version__

    ctx.report.options = config.as_dict()
    passes = resolve(f"{config.pipeline}:quantization", "pipeline")(config, tgt, data, min_opset=min_opset,
                                                                     version=__version__, calib_files=calib_files)
    PassManager(passes).run(ctx)
    op_of = {n.name: n.op for n in ctx.graph.nodes}
    for node_name, (quantized, reason) in ctx.plan.status.items():
        ctx.report.nodes.append(NodeRecord(node_name, op_of.get(node_name, "?"), quantized, reason))
    return QuantResult(ctx.model, ctx.report, tgt, dict(ctx.side_files), inputs)


def quantize(model, target: "str | Target" = "tensorrt", calib=None, *, batch_size: int = 16,
             calib_size: int | None = None, calib_method: str | None = None, exclude=(), overrides=(),
             weight_bits: int | None = None, act_bits: int | None = None, progress: bool | None = None,
             preprocess: str | None = None, max_memory_mb: float | None = None, percentile: float | None = None,
             cpu: str = "auto", export_format: str = "qdq", equalize: bool | None = None, plugins=(),
             pipeline: str = RunConfig.pipeline, algo: str | None = None, device: str = "cpu",
             algo_iters: int | None = None, smoothquant_alpha: float | None = None,
             output: "str | os.PathLike | None" = None) -> QuantResult:
    """Quantize an ONNX model (path or ModelProto) for `target` with calibration data `calib`.

    calib: an .npz of stacked samples keyed by input name; a folder of .npz feeds (one complete feed each, shapes
    may vary) or of images (with `preprocess`, see oq.preprocess); "module:function" or a Python callable returning
    an iterable of feed dicts; "random" (noise, only on explicit request: the report warns); or a CalibrationData.
    weight_bits/act_bits: narrow the target's integer grids to N bits (2..16; beyond 8 bits needs 16-bit Q/DQ, or the
    academic target's FakeQuant). exclude: node names, op types or regexes kept in float. overrides:
    "NODE_OR_OP=[weight.|activation.]key:value" entries changing the spec on matching nodes (see oq.overrides); ones
    the target can't honour are reported. cpu: the deployment CPU (auto, vnni, avx2, avx512, arm64); for the
    onnxruntime target a CPU without VNNI gets the weight channels whose int16 product pairs saturate re-quantized (a
    model made for avx2 is safe everywhere). equalize: cross-layer equalization (rescaling channels between
    consecutive Conv/ConvTranspose/Gemm layers so per-tensor weight grids fit them); None leaves it to the target.
    progress: None shows a bar only when stderr is a terminal. plugins: modules to import first (they may register
    observers). pipeline: the module providing the pass lists. algo: weight rounding, None or "rtn" (to nearest) or
    "adaround" (learned per weight from the calibration data; needs torch), run on `device` ("cpu" or "cuda") for
    `algo_iters` steps per layer (default 1000); "smoothquant" and "bias-correction" combine with any of them, joined
    by "+" or "," (smoothquant_alpha: its fixed alpha, None searches it). Every keyword is a field of oq.RunConfig, validated before any work.
    Returns QuantResult(model, report, target, side_files); with `output`, the model is also written there atomically.
    """
    options = dict(locals())
    model, output = options.pop("model"), options.pop("output")
    assert set(options) <= set(keyword_names())
    result = run(model, RunConfig(**options), output)
    if output is not None:
        result.save(output)
    return result
