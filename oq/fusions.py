"""The fusion-pattern registry: op chains a backend runs as one kernel, declared as patterns with reasons.

Core data: the target loader validates `fusions = [...]` against it and the fuse-patterns pass matches it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_graphsurgeon as gs

from . import ir
from .plan import FusionGroup

Predicate = Callable[[gs.Node], bool]


def _relu_like_clip(node: gs.Node) -> bool:
    """Clip whose lower bound is 0 (ReLU6 and friends)."""
    if node.op != "Clip":
        return False
    if len(node.inputs) > 1 and node.inputs[1].name:
        lo = ir.constant_value(node.inputs[1])
        return lo is not None and float(np.asarray(lo).reshape(-1)[0]) == 0.0
    return node.attrs.get("min", None) == 0.0


def _op(*ops: str) -> Predicate:
    return lambda n: n.op in ops


ACTIVATION: Predicate = lambda n: n.op == "Relu" or _relu_like_clip(n)
CONV: Predicate = _op("Conv", "ConvTranspose")
LINEAR: Predicate = lambda n: n.op == "Gemm" or (n.op == "MatMul" and ir.constant_value(n.inputs[1]) is not None)
BIAS_ADD: Predicate = lambda n: n.op == "Add" and any(ir.constant_value(t) is not None for t in n.inputs)
ADD: Predicate = lambda n: n.op == "Add" and all(ir.constant_value(t) is None for t in n.inputs)


@dataclass(frozen=True)
class Pattern:
    """A chain of ops, each the sole consumer of the previous one's first output."""

    name: str
    steps: tuple[tuple[str, Predicate], ...]  # (description, predicate)
    side_input_steps: tuple[int, ...] = ()  # steps whose other input enters from outside (residual Add)

    def match(self, start: gs.Node, uses: ir.UseIndex, taken: set[str]) -> tuple[list[gs.Node] | None, str]:
        """The matched nodes, or None and why the chain broke (empty when the first op does not match)."""
        if start.name in taken or not self.steps[0][1](start):
            return None, ""
        chain = [start]
        for desc, pred in self.steps[1:]:
            out = chain[-1].outputs[0]
            nxt = uses.sole_consumer(out)
            if nxt is None:
                n = len(uses.consumers(out))
                return None, f"output of {chain[-1].name} is read by {n} nodes" if n > 1 else "no next op"
            if not pred(nxt):
                return None, f"{nxt.name} ({nxt.op}) is not {desc}"
            if nxt.name in taken:
                return None, f"{nxt.name} already in another fusion"
            chain.append(nxt)
        return chain, ""


PATTERNS: dict[str, Pattern] = {p.name: p for p in [
    Pattern("conv_bn_relu", (("Conv", CONV), ("BatchNormalization", _op("BatchNormalization")),
                             ("ReLU/ReLU6", ACTIVATION))),
    Pattern("conv_add_relu", (("Conv", CONV), ("Add", ADD), ("ReLU/ReLU6", ACTIVATION)), side_input_steps=(1,)),
    Pattern("conv_bn", (("Conv", CONV), ("BatchNormalization", _op("BatchNormalization")))),
    Pattern("conv_add", (("Conv", CONV), ("Add", ADD)), side_input_steps=(1,)),
    Pattern("conv_relu", (("Conv", CONV), ("ReLU/ReLU6", ACTIVATION))),
    Pattern("linear_bias_relu", (("MatMul with constant weight", LINEAR), ("bias Add", BIAS_ADD),
                                 ("ReLU/ReLU6", ACTIVATION))),
    Pattern("linear_bias", (("MatMul with constant weight", LINEAR), ("bias Add", BIAS_ADD))),
    Pattern("linear_relu", (("Gemm/MatMul", LINEAR), ("ReLU/ReLU6", ACTIVATION))),
    Pattern("add_relu", (("Add", ADD), ("ReLU/ReLU6", ACTIVATION))),
]}


def find_fusions(graph: gs.Graph, names: list[str]) -> tuple[list[FusionGroup], list[str]]:
    patterns = sorted((PATTERNS[n] for n in names), key=lambda p: -len(p.steps))
    uses = ir.UseIndex(graph)
    taken: set[str] = set()
    groups, notes = [], []
    for node in graph.nodes:
        misses = []
        for pattern in patterns:
            chain, why = pattern.match(node, uses, taken)
            if chain is None:
                if "read by" in why or "already in" in why:  # structural near-misses only
                    misses.append(f"{pattern.name} at {node.name}: {why}")
                continue
            side = []
            for step in pattern.side_input_steps:
                member, prev = chain[step], chain[step - 1]
                side += [(member, i) for i, t in enumerate(member.inputs) if t is not prev.outputs[0]]
            groups.append(FusionGroup(pattern.name, chain, side))
            taken.update(n.name for n in chain)
            misses = []
            break
        notes += misses[:1]
    return groups, notes
