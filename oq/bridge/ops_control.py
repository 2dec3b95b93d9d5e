"""Control flow: If, with its condition evaluated eagerly (one branch runs, as in onnxruntime)."""
from __future__ import annotations

from .registry import NodeAttrs, op


@op("If")
def if_(attrs: NodeAttrs, inputs: list):
    condition = inputs[0]
    branch = attrs["then_branch"] if bool(condition.reshape(-1)[0]) else attrs["else_branch"]
    return tuple(branch())
