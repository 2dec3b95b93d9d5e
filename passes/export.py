"""Export passes: the graph becomes the deployable ModelProto, then model-level steps finish it.

export-graph (ModelProto from the graph, the input's model-level fields kept) -> pack-int4 -> stamp-model
(producer, target) -> attach-functions (oq.FakeQuant) -> qoperator (only when asked) -> side-files (what the target
emits beside the model). attach-functions and qoperator ensure that the model passes onnx.checker.
"""
from __future__ import annotations

import onnx

from oq import fakequant, ir
from oq.errors import OqError
from oq.emit import emit_side_files
from oq.passmanager import Context, Pass, PassResult, has_model, has_plan, has_target
from oq.qoperator import to_qoperator


def checker_passes(ctx: Context) -> str | None:
    """The exported model passes onnx.checker's full check (models past the in-memory limit are checked on save)."""
    if ctx.model is None:
        return "no exported model"
    if ir.model_size(ctx.model) >= ir.EXTERNAL_DATA_THRESHOLD:
        return None
    try:
        onnx.checker.check_model(ctx.model, full_check=True)
    except Exception as exc:
        input_problem = ir.checker_problem(ctx.input_model) if ctx.input_model is not None else None
        if input_problem:  # the input's own defect, not a bug of a pass
            raise OqError(f"the input model fails onnx.checker ({input_problem}), and so does the "
                          f"quantized one; fix the input model") from None
        return f"the exported model fails onnx.checker: {str(exc).splitlines()[0]}"
    return None


class ExportGraph(Pass):
    name = "export-graph"

    def run(self, ctx: Context) -> PassResult:
        ctx.model = ir.to_model(ctx.graph, template=ctx.template)
        return PassResult(True)


class PackInt4(Pass):
    """4-bit initializers sit in 8-bit containers while the graph is edited; the file stores them packed."""

    name = "pack-int4"
    requires = (has_model, has_plan)

    def run(self, ctx: Context) -> PassResult:
        if not ctx.plan.packed:
            return PassResult(False)
        ir.pack_4bit(ctx.model, ctx.plan.packed)
        return PassResult(True, [f"{len(ctx.plan.packed)} initializers packed to 4 bits"])


class AttachFunctions(Pass):
    """The oq.FakeQuant function definition, for models that use it (any-bit-width targets)."""

    name = "attach-functions"
    requires = (has_model,)
    ensures = (checker_passes,)

    def run(self, ctx: Context) -> PassResult:
        before = len(ctx.model.functions)
        fakequant.attach(ctx.model)
        return PassResult(len(ctx.model.functions) != before)


class ToQOperator(Pass):
    name = "qoperator"
    requires = (has_model,)
    ensures = (checker_passes,)

    def run(self, ctx: Context) -> PassResult:
        ctx.model = to_qoperator(ctx.model)
        ctx.report.warnings.append("QOperator export: QGemm/QLinearAdd/... are onnxruntime contrib ops")
        return PassResult(True)


class StampModel(Pass):
    """Name oq as the producer and write the run record (oq.record) into the model's metadata and the report."""

    name = "stamp-model"
    requires = (has_model, has_target)

    def __init__(self, version: str, record: dict[str, str] | None = None):
        self.version = version
        self.record = dict(record or {"oq.target": ""})

    def run(self, ctx: Context) -> PassResult:
        model = ctx.model
        model.producer_name, model.producer_version = "oq", self.version
        record = {**self.record, "oq.target": ctx.target.name}
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, **record})
        ctx.report.run = record
        return PassResult(True)


class EmitSideFiles(Pass):
    name = "side-files"
    requires = (has_plan, has_target)

    def run(self, ctx: Context) -> PassResult:
        ctx.side_files = emit_side_files(ctx.target.side_files, ctx.plan)
        return PassResult(False, [f"{suffix}: {len(data)} bytes" for suffix, data in ctx.side_files.items()])
