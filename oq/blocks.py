"""Cut a graph into reconstruction blocks: contiguous runs of nodes whose output error is minimised together.

A block boundary is a place in the (topological) node order where as few tensors as possible cross it: in a
residual network the skip connection keeps two tensors alive inside a residual block and one between blocks, in a
transformer the residual stream does the same around attention and the MLP. So boundaries are the positions where
the number of live float tensors reaches its minimum over the span of the weighted layers; tensors that are not
float (shapes, token ids, boolean masks) and graph inputs read all along (an attention mask) do not decide where a
block ends because they count the same everywhere. Between two boundaries lies a segment; consecutive segments are
packed into blocks of up to `block_layers` weighted layers (a chain of single convolutions becomes blocks of a few
layers, as an inverted-residual block would be), and a segment with more than `max_layers` weighted layers (a
U-Net's long skips keep everything alive) is split again where the fewest tensors cross it.

Nodes before the first and after the last weighted layer belong to no block: they are not quantized weights'
business, and the first block's inputs are taken from the float model as they arrive.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

FLOAT_KINDS = "f"


@dataclass
class Block:
    nodes: list[gs.Node]
    layers: list[str]  # names of the weighted nodes in the block
    inputs: list[str] = field(default_factory=list)  # tensors read from outside the block (graph inputs included)
    outputs: list[str] = field(default_factory=list)  # tensors produced here and read later (or graph outputs)

    @property
    def name(self) -> str:
        return f"{self.nodes[0].name} .. {self.nodes[-1].name}" if len(self.nodes) > 1 else self.nodes[0].name


def reads(node: gs.Node) -> list[gs.Tensor]:
    """Tensors a node reads: its inputs, and what its subgraphs take from the enclosing scope."""
    out = [t for t in node.inputs if t is not None and t.name]
    for value in node.attrs.values():
        if isinstance(value, gs.Graph):
            inner = {t.name for n in value.nodes for t in n.outputs} | {t.name for t in value.inputs}
            out += [t for n in value.nodes for t in reads(n) if t.name not in inner and not isinstance(t, gs.Constant)]
    return out


def _is_float(t: gs.Tensor) -> bool:
    if t.dtype is None:
        return True
    try:
        return np.dtype(t.dtype).kind == FLOAT_KINDS
    except TypeError:  # an onnx type gs cannot name as numpy (bfloat16, float8): float enough here
        return True


def live_counts(nodes: list[gs.Node], graph_inputs: list[gs.Tensor]) -> np.ndarray:
    """For each boundary i (after node i), how many float tensors made at or before it are read after it."""
    n = len(nodes)
    made = {t.name: -1 for t in graph_inputs}
    for i, node in enumerate(nodes):
        for t in node.outputs:
            made[t.name] = i
    last: dict[str, int] = {}
    floats: dict[str, bool] = {}
    for i, node in enumerate(nodes):
        for t in reads(node):
            if t.name in made and not isinstance(t, gs.Constant):
                last[t.name] = i
                floats[t.name] = _is_float(t)
    diff = np.zeros(n + 1, np.int64)
    for name, end in last.items():
        if floats[name]:
            start = max(made[name], 0)
            diff[start] += 1
            diff[end] -= 1
    return np.cumsum(diff)[:n]


def partition(graph: gs.Graph, weighted: set[str], block_layers: int = 4, max_layers: int = 12) -> list[Block]:
    """Blocks covering every node from the first to the last weighted node of `graph` (in its node order, which
    must be topological), each with at least one weighted node."""
    nodes = list(graph.nodes)
    where = [i for i, node in enumerate(nodes) if node.name in weighted]
    if not where:
        return []
    first, last = where[0], where[-1]
    counts = live_counts(nodes, list(graph.inputs))
    span = counts[first:last]
    cuts = [first + i for i, c in enumerate(span) if c == span.min()] if len(span) else []
    segments, start = [], first
    for cut in cuts:
        segments.append((start, cut + 1))
        start = cut + 1
    segments.append((start, last + 1))
    is_w = np.array([node.name in weighted for node in nodes])
    packed: list[tuple[int, int]] = []
    for a, b in segments:
        w = int(is_w[a:b].sum())
        if packed and (w == 0 or int(is_w[packed[-1][0]:packed[-1][1]].sum()) + w <= block_layers):
            packed[-1] = (packed[-1][0], b)
        else:
            packed.append((a, b))
    spans: list[tuple[int, int]] = []
    for a, b in packed:
        spans += _split(a, b, is_w, counts, max_layers)
    blocks = [Block(nodes[a:b], [n.name for n in nodes[a:b] if n.name in weighted]) for a, b in spans]
    _wire(blocks, graph)
    return blocks


def _split(a: int, b: int, is_w: np.ndarray, counts: np.ndarray, max_layers: int) -> list[tuple[int, int]]:
    """[a, b) as is, or cut where the fewest tensors cross (ties: the most even split) until no piece has more than
    max_layers weighted nodes."""
    total = int(is_w[a:b].sum())
    if total <= max_layers:
        return [(a, b)]
    before = np.cumsum(is_w[a:b])
    best = None
    for i in range(a, b - 1):
        left = int(before[i - a])
        if 0 < left < total:
            key = (int(counts[i]), abs(2 * left - total))
            if best is None or key < best[0]:
                best = (key, i)
    if best is None:
        return [(a, b)]
    cut = best[1] + 1
    return _split(a, cut, is_w, counts, max_layers) + _split(cut, b, is_w, counts, max_layers)


def _wire(blocks: list[Block], graph: gs.Graph) -> None:
    """Fill in each block's inputs and outputs."""
    block_of: dict[int, int] = {}
    for k, block in enumerate(blocks):
        for node in block.nodes:
            block_of[id(node)] = k
    produced_in: dict[str, int] = {}
    for k, block in enumerate(blocks):
        for node in block.nodes:
            for t in node.outputs:
                produced_in[t.name] = k
    graph_outputs = {t.name for t in graph.outputs}
    read_after: dict[str, int] = {}  # tensor -> last block (or len(blocks) for nodes after every block) reading it
    for node in graph.nodes:
        k = block_of.get(id(node), len(blocks))
        for t in reads(node):
            read_after[t.name] = max(read_after.get(t.name, -1), k)
    for k, block in enumerate(blocks):
        seen: set[str] = set()
        for node in block.nodes:
            for t in reads(node):
                if isinstance(t, gs.Constant) or t.name in seen:
                    continue
                if produced_in.get(t.name) != k:
                    seen.add(t.name)
                    block.inputs.append(t.name)
            for t in node.outputs:
                if t.name and (t.name in graph_outputs or read_after.get(t.name, -1) > k):
                    block.outputs.append(t.name)


__all__ = ["Block", "partition", "live_counts", "reads"]
