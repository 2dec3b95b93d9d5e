"""The float values behind a quantized model's stored weight codes.

oq quantizes weights after its graph passes (BatchNorm folding, cross-layer equalization), so the float weight a
code stands for is in neither the input model nor the output. It is recomputed here by running the same pipeline's
graph passes, the ones before fusion grouping, on the input model: the layer reading a code in the output is the
layer of the same name there, reading its float weight at the same input.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .. import ir
from ..config import RunConfig
from ..passmanager import Context, PassManager
from ..plugins import resolve
from ..report import Report
from ..target import Target

# the first pass of the built-in pipeline that no longer rewrites weights (fusions, plan, calibration follow)
_FIRST_QUANTIZATION_PASS = "fuse-patterns"


def prepared_graph(model: onnx.ModelProto, config: RunConfig, target: Target) -> gs.Graph:
    """The graph as the run had it just before quantizing: prepared, and equalized when the run equalized."""
    passes = resolve(f"{config.pipeline}:quantization", "pipeline")(
        dataclasses.replace(config, calib=None), target, None, min_opset=target.opset_min, version="",
        calib_files=())
    head = list(itertools.takewhile(lambda p: p.name != _FIRST_QUANTIZATION_PASS, passes))
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    ctx = Context(graph=ir.to_graph(copy), target=target, report=Report())
    PassManager(head).run(ctx)
    return ctx.graph


def float_inputs(graph: gs.Graph) -> dict[tuple[str, int], np.ndarray]:
    """(node name, input index) -> the constant it reads, for every constant input of every named node."""
    out = {}
    for node in graph.nodes:
        for idx, t in enumerate(node.inputs):
            value = ir.constant_value(t) if t.name else None
            if value is not None:
                out[(node.name, idx)] = value
    return out
