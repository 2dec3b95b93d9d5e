"""Data the annotate, calibrate and insert passes hand to each other."""
from __future__ import annotations

from dataclasses import dataclass, field

import onnx_graphsurgeon as gs

from .spec import QParams, QuantSpec

ALL_CONSUMERS = "all"


@dataclass
class FusionGroup:
    """Nodes a backend runs as one kernel: no Q/DQ may stand between them."""

    pattern: str
    nodes: list[gs.Node]
    # (node, input index) pairs that enter the group from outside other than the anchor's inputs, e.g. the skip
    # input of a fused residual Add.
    side_inputs: list[tuple[gs.Node, int]] = field(default_factory=list)

    @property
    def anchor(self) -> gs.Node:
        return self.nodes[0]

    @property
    def output(self) -> gs.Tensor:
        return self.nodes[-1].outputs[0]


@dataclass
class ActivationQuant:
    """One Q/DQ pair on a tensor; `consumers` are the (node name, input index) pairs that read the DQ output."""

    tensor: str
    spec: QuantSpec
    consumers: set | str = field(default_factory=set)
    qparams: QParams | None = None


@dataclass
class WeightQuant:
    tensor: str
    spec: QuantSpec
    axis: int | None
    consumers: set = field(default_factory=set)
    qparams: QParams | None = None


@dataclass
class BiasQuant:
    node: str
    input_tensor: str  # activation feeding the op
    weight_key: tuple  # key of the WeightQuant in the plan


class UnionFind:
    def __init__(self):
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra

    def groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for x in list(self.parent):
            out.setdefault(self.find(x), []).append(x)
        return out


@dataclass
class QuantPlan:
    activations: dict[str, ActivationQuant] = field(default_factory=dict)
    weights: dict[tuple, WeightQuant] = field(default_factory=dict)
    biases: list[BiasQuant] = field(default_factory=list)
    shared: UnionFind = field(default_factory=UnionFind)
    # node name -> (quantized, reason)
    status: dict[str, tuple[bool, str]] = field(default_factory=dict)
    # initializer name -> 4-bit dtype, for 4-bit values held in 8-bit containers until the export packs them
    packed: dict[str, str] = field(default_factory=dict)

    def observed_groups(self) -> dict[str, list[str]]:
        """Scale-sharing groups of activation tensors, each to be calibrated as one."""
        for name in self.activations:
            self.shared.find(name)
        return {root: members for root, members in self.shared.groups().items()
                if any(m in self.activations for m in members)}
