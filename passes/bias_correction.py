"""Empirical bias correction (Nagel et al. 2019, "Data-Free Quantization", empirical variant as in AIMET and NNCF).

Quantizing a layer's weights shifts the mean of its output channels: E[W_q x] != E[W x]. Per-tensor weight grids on
depthwise convolutions shift them most (a few large taps set the step of the whole tensor). The correction moves
each quantized Conv/ConvTranspose/Gemm (and MatMul followed by a constant Add) back onto the float model's output
mean, per output channel, through its bias.

What x is: the layer's input in the *quantized* model (weights on their grids, every planned activation
quantize-dequantized, upstream layers already corrected), so the correction
    b' = b - (E[y_quantized] - E[y_float])
also absorbs the mean error that reaches the layer from upstream. Layers are corrected in waves: a wave holds the
layers whose upstream quantized layers are all corrected, and one onnxruntime pass over the calibration data
measures a whole wave (a chain of L layers takes L passes; each pass runs only the graph up to that wave).

Two passes share the work, because a weight-rounding pass (AdaRound, BRECQ) overwrites the float weights:
`FloatOutputMeans` measures E[y_float] before the rounding passes, `BiasCorrection` runs after them (weights
final), before insert-qdq, so an int32 bias is quantized from the corrected value. Memory is bounded: the graph
reduces every measured output to per-channel means before it leaves onnxruntime; nothing else is kept.

A layer without a bias gets one (Conv, ConvTranspose, Gemm: a new bias input; also planned for int32 where the
target wants it). A MatMul has no bias input: its correction goes into a following Add of a constant, and a MatMul
without one is left alone and reported.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from oq import ir
from oq.opinfo import weighted_op
from oq.passmanager import Context, Pass, PassResult, has_plan
from oq.plan import ALL_CONSUMERS, BiasQuant
from oq.spec import dequantize_array, quantize_array

from .reconstruct import capped_batches, explained_capture

DEFAULT_MAX_SAMPLES = 512


@dataclass
class _Layer:
    """One layer to correct: its node, where its output channels sit, and where its bias is (or will be)."""

    node: str
    output: str  # the tensor measured: the node's own output (before any activation)
    axis: int  # channel axis of that tensor
    rank: int
    channels: int
    bias: str | None  # name of the constant bias tensor; None: the layer has none yet
    add: str | None = None  # MatMul: the Add node holding the bias constant
    beta: float = 1.0  # Gemm multiplies its bias by beta


def _private_constant(tensor: gs.Tensor, uses: ir.UseIndex) -> bool:
    return isinstance(tensor, gs.Constant) and len(uses.consumers(tensor)) == 1 and \
        np.asarray(tensor.values).dtype.kind == "f"


def _layer(node: gs.Node, uses: ir.UseIndex) -> _Layer | str:
    """The layer as something to correct, or why it cannot be."""
    info = weighted_op(node)
    y = node.outputs[0]
    rank = len(y.shape) if y.shape is not None else None
    if rank is None or rank < 1:
        return "output rank unknown"
    w = ir.constant_value(node.inputs[info.weight_input])
    if node.op in ("Conv", "ConvTranspose"):
        axis = 1
        channels = w.shape[0] if node.op == "Conv" else w.shape[1] * int(node.attrs.get("group", 1))
    else:
        axis = rank - 1
        channels = w.shape[-2] if node.op == "Gemm" and node.attrs.get("transB", 0) else w.shape[-1]
    if rank <= axis:
        return "output rank unknown"
    if node.op == "MatMul":
        add = uses.sole_consumer(y)
        if add is None or add.op != "Add":
            return "MatMul without a following Add to hold a bias"
        other = next((t for t in add.inputs if t is not y), None)
        if other is None or not _private_constant(other, uses):
            return "MatMul whose following Add has no private constant"
        c = np.asarray(other.values)
        if c.ndim > rank or (c.ndim and c.shape[-1] not in (1, channels)) or any(d != 1 for d in c.shape[:-1]):
            return "MatMul whose following Add constant is not a per-channel bias"
        return _Layer(node.name, y.name, axis, rank, channels, other.name, add=add.name)
    beta = float(node.attrs.get("beta", 1.0)) if node.op == "Gemm" else 1.0
    if beta == 0:
        return "Gemm with beta = 0"
    bidx = info.bias_input
    bias = node.inputs[bidx] if len(node.inputs) > bidx and node.inputs[bidx].name else None
    if bias is not None:
        if not _private_constant(bias, uses):
            return "bias is not a private float constant"
        b = np.asarray(bias.values)
        if node.op == "Gemm" and b.ndim and b.shape[-1] not in (1, channels):
            return "Gemm bias does not broadcast per output channel"
    return _Layer(node.name, y.name, axis, rank, channels, bias.name if bias is not None else None, beta=beta)


def correctable_layers(ctx: Context) -> tuple[list[_Layer], list[str]]:
    """The quantized weighted layers whose bias can take a correction, in graph order, and notes on the others."""
    plan, graph = ctx.plan, ctx.graph
    uses = ir.UseIndex(graph)
    weight_consumers = {c for wq in plan.weights.values() for c in wq.consumers}
    layers, notes = [], []
    for node in graph.nodes:
        info = weighted_op(node)
        if info is None or (node.name, info.weight_input) not in weight_consumers:
            continue
        if not plan.status.get(node.name, (False, ""))[0]:
            continue
        layer = _layer(node, uses)
        if isinstance(layer, str):
            notes.append(f"{node.name}: not corrected ({layer})")
        else:
            layers.append(layer)
    return layers, notes


def _reduce_axes(graph: gs.Graph, namer: ir.Namer, layer: _Layer, tensor: gs.Tensor) -> list[gs.Tensor]:
    """Nodes appended to `graph` giving the per-channel mean of `tensor` and its shape (to weigh the batches)."""
    axes = [a for a in range(layer.rank) if a != layer.axis]
    mean = gs.Variable(namer(f"{layer.node}_bc_mean"), dtype=np.float32)
    shape = gs.Variable(namer(f"{layer.node}_bc_shape"), dtype=np.int64)
    if graph.opset >= 18:
        inputs = [tensor, gs.Constant(namer(f"{layer.node}_bc_axes"), np.asarray(axes, np.int64))]
        attrs = {"keepdims": 0}
    else:
        inputs, attrs = [tensor], {"axes": axes, "keepdims": 0}
    cast = gs.Variable(namer(f"{layer.node}_bc_f32"), dtype=np.float32)
    graph.nodes += [gs.Node("Cast", namer(f"{layer.node}_bc_Cast"), {"to": 1}, [tensor], [cast]),
                    gs.Node("ReduceMean", namer(f"{layer.node}_bc_ReduceMean"), attrs, [cast] + inputs[1:], [mean]),
                    gs.Node("Shape", namer(f"{layer.node}_bc_Shape"), {}, [tensor], [shape])]
    return [mean, shape]


def output_means(graph: gs.Graph, layers: list[_Layer], data, batch_size: int, max_samples: int
                 ) -> dict[str, np.ndarray]:
    """Per layer, the mean of each output channel over the calibration samples (float64), measured in onnxruntime
    on a copy of `graph` cut after those layers; per batch only [C] means and a shape leave the session."""
    g = graph.copy()
    tensors, namer = g.tensors(), ir.Namer(g)
    outs = {layer.node: _reduce_axes(g, namer, layer, tensors[layer.output]) for layer in layers}
    g.outputs = [t for pair in outs.values() for t in pair]
    g.cleanup()
    model = ir.to_model(g)
    sums = {layer.node: np.zeros(layer.channels) for layer in layers}
    counts = dict.fromkeys(sums, 0)
    feeds = (feed for _, feed in capped_batches(data, batch_size, max_samples))
    for values in explained_capture(model, [t.name for t in g.outputs], feeds, data,
                                    "measuring layer outputs for bias correction"):
        for name, (mean, shape) in outs.items():
            n = int(np.prod(values[shape.name])) // sums[name].size
            sums[name] += np.asarray(values[mean.name], np.float64) * n
            counts[name] += n
    return {name: sums[name] / max(counts[name], 1) for name in sums}


def simulated(graph: gs.Graph, plan) -> gs.Graph:
    """A copy of `graph` computing what the quantized model will: weights on their grid points, every planned
    activation quantize-dequantized (standard ops, round half to even as QuantizeLinear) for its planned readers.
    Biases stay float (int32 bias rounding is below the measured shifts)."""
    g = graph.copy()
    tensors, namer = g.tensors(), ir.Namer(g)
    nodes = {n.name: n for n in g.nodes}
    for wq in plan.weights.values():
        value = ir.constant_value(tensors[wq.tensor])
        grid = dequantize_array(quantize_array(value.astype(np.float32), wq.qparams), wq.qparams).astype(value.dtype)
        const = gs.Constant(namer(f"{wq.tensor}_grid"), grid)
        for node_name, idx in wq.consumers:
            nodes[node_name].inputs[idx] = const
    for name, aq in plan.activations.items():
        x = tensors[name]
        readers = [(c, i) for c in list(x.outputs) for i, t in enumerate(c.inputs) if t is x]
        if aq.consumers is not ALL_CONSUMERS:
            readers = [(c, i) for c, i in readers if (c.name, i) in aq.consumers]
        if not readers:
            continue
        out = _fake_quant(g, namer, x, aq.qparams)
        for c, i in readers:
            c.inputs[i] = out
    ir.toposort(g)
    return g


def _fake_quant(g: gs.Graph, namer: ir.Namer, x: gs.Tensor, qp) -> gs.Tensor:
    dtype = np.dtype(x.dtype or np.float32)
    rank = len(x.shape) if x.shape is not None else 0
    scale, zp = qp.expanded((1,) * rank) if qp.axis is not None and rank else (qp.scale, qp.zero_point)
    qmin, qmax = qp.spec.qrange
    c = {k: gs.Constant(namer(f"{x.name}_sim_{k}"), np.asarray(v, dtype)) for k, v in
         (("scale", scale), ("zp", np.asarray(zp, np.float64)), ("qmin", qmin), ("qmax", qmax))}
    steps = [("Div", [c["scale"]]), ("Round", []), ("Add", [c["zp"]]), ("Clip", [c["qmin"], c["qmax"]]),
             ("Sub", [c["zp"]]), ("Mul", [c["scale"]])]
    t = x
    for op, extra in steps:
        out = gs.Variable(namer(f"{x.name}_sim_{op.lower()}"), dtype=dtype, shape=x.shape)
        g.nodes.append(gs.Node(op, namer(f"{x.name}_sim_{op}"), {}, [t, *extra], [out]))
        t = out
    return t


def waves(graph: gs.Graph, layers: list[_Layer]) -> list[list[_Layer]]:
    """Layers grouped by how many corrected layers lie upstream of them: each wave depends only on earlier ones."""
    by_node = {layer.node: layer for layer in layers}
    level: dict[str, int] = {}  # tensor name -> corrected layers upstream
    g = graph.copy()
    ir.toposort(g)
    out: dict[int, list[_Layer]] = {}
    for node in g.nodes:
        depth = max((level.get(t.name, 0) for t in node.inputs), default=0)
        if node.name in by_node:
            out.setdefault(depth, []).append(by_node[node.name])
            depth += 1
        for t in node.outputs:
            level[t.name] = depth
    return [out[k] for k in sorted(out)]


class FloatOutputMeans(Pass):
    """The float model's per-channel output means of the layers bias correction will correct; runs after
    calibration and before any weight-rounding pass (which overwrites the float weights)."""

    name = "bias-correction-reference"
    requires = (has_plan,)

    def __init__(self, data, batch_size: int = 16, max_samples: int = DEFAULT_MAX_SAMPLES):
        self.data, self.batch_size, self.max_samples = data, batch_size, max_samples
        self.layers: list[_Layer] = []
        self.notes: list[str] = []
        self.means: dict[str, np.ndarray] = {}

    def run(self, ctx: Context) -> PassResult:
        self.layers, self.notes = correctable_layers(ctx)
        if self.layers:
            self.means = output_means(ctx.graph, self.layers, self.data, self.batch_size, self.max_samples)
        return PassResult(False, [f"float output means of {len(self.layers)} layers"])


class BiasCorrection(Pass):
    """Move each quantized layer's output mean back onto the float model's (see the module docstring)."""

    name = "bias-correction"
    requires = (has_plan,)

    def __init__(self, reference: FloatOutputMeans):
        self.reference = reference

    def run(self, ctx: Context) -> PassResult:
        ref, plan = self.reference, ctx.plan
        record = {"layers": [], "skipped": list(ref.notes)}
        if ctx.report is not None:
            ctx.report.calibration["bias_correction"] = record
        if any(wq.spec.is_float for wq in plan.weights.values()) or \
                any(aq.spec.is_float for aq in plan.activations.values()):
            record["skipped"].append("FP8 grids are not simulated: no layer corrected")
            return PassResult(False, ["bias correction skipped: FP8 grids are not simulated"])
        if not ref.layers:
            return PassResult(False, ref.notes + ["no layer to correct"])
        start = time.perf_counter()
        sim = simulated(ctx.graph, plan)
        sim_tensors, sim_nodes = sim.tensors(), {n.name: n for n in sim.nodes}
        biases: dict[str, np.ndarray] = {}  # layer -> corrected bias values
        for layer in ref.layers:
            biases[layer.node] = self._bias(ctx.graph, layer)
            self._set_sim_bias(sim, sim_tensors, sim_nodes, layer, biases[layer.node])
        passes = 0
        for wave in waves(ctx.graph, ref.layers):
            quantized = output_means(sim, wave, ref.data, ref.batch_size, ref.max_samples)
            passes += 1
            for layer in wave:
                shift = quantized[layer.node] - ref.means[layer.node]
                new = (biases[layer.node].astype(np.float64) - shift / layer.beta).astype(biases[layer.node].dtype)
                biases[layer.node] = new
                self._set_sim_bias(sim, sim_tensors, sim_nodes, layer, new)
                record["layers"].append({"node": layer.node, "mean_abs_shift": float(np.abs(shift).mean()),
                                         "max_abs_shift": float(np.abs(shift).max()),
                                         "bias_added": layer.bias is None})
        added = self._write(ctx, ref.layers, biases)
        record["seconds"] = round(time.perf_counter() - start, 3)
        record["passes"] = passes
        worst = max(record["layers"], key=lambda e: e["max_abs_shift"])
        head = (f"{len(ref.layers)} layers corrected in {passes} passes over the data ({added} biases added), "
                f"largest channel shift {worst['max_abs_shift']:.3g} at {worst['node']}, {record['seconds']:.1f}s")
        return PassResult(True, [head] + ref.notes)

    # -----------------------------------------------------------------------------------------------------------
    @staticmethod
    def _bias(graph: gs.Graph, layer: _Layer) -> np.ndarray:
        """The layer's current bias as an array broadcasting per output channel (zeros where it has none)."""
        if layer.bias is None:
            node = next(n for n in graph.nodes if n.name == layer.node)
            w = ir.constant_value(node.inputs[weighted_op(node).weight_input])
            return np.zeros(layer.channels, w.dtype)
        b = np.asarray(graph.tensors()[layer.bias].values)
        shape = np.broadcast_shapes(b.shape, (layer.channels,))
        return np.array(np.broadcast_to(b, shape))

    @staticmethod
    def _set_sim_bias(sim, tensors, nodes, layer: _Layer, value: np.ndarray) -> None:
        if layer.bias is not None:
            tensors[layer.bias].values = value
            return
        node = nodes[layer.node]
        bidx = weighted_op(node).bias_input
        if len(node.inputs) > bidx and node.inputs[bidx].name:
            node.inputs[bidx].values = value
            return
        while len(node.inputs) < bidx:
            node.inputs.append(gs.Variable.empty())
        node.inputs.append(gs.Constant(f"{layer.node}_sim_bias", value))
        tensors[f"{layer.node}_sim_bias"] = node.inputs[bidx]

    @staticmethod
    def _write(ctx: Context, layers: list[_Layer], biases: dict[str, np.ndarray]) -> int:
        """Put the corrected biases into the graph (new bias inputs where a layer had none, planned for int32 where
        the target quantizes biases so); returns how many were added."""
        graph, plan, target = ctx.graph, ctx.plan, ctx.target
        tensors, nodes = graph.tensors(), {n.name: n for n in graph.nodes}
        namer = ir.Namer(graph)
        added = 0
        for layer in layers:
            value = biases[layer.node]
            if layer.bias is not None:
                tensors[layer.bias].values = value
                continue
            node = nodes[layer.node]
            info = weighted_op(node)
            bidx = info.bias_input
            while len(node.inputs) < bidx:
                node.inputs.append(gs.Variable.empty())
            node.inputs.append(gs.Constant(namer(f"{layer.node}_bias"), value))
            added += 1
            rule = target.ops.get(node.op) if target is not None else None
            mode = (rule.bias if rule is not None else None) or getattr(target, "bias", "float")
            x, w = node.inputs[0].name, node.inputs[info.weight_input].name
            wkey = next((k for k, wq in plan.weights.items()
                         if k[0] == w and (node.name, info.weight_input) in wq.consumers), None)
            if mode == "int32" and wkey is not None and x in plan.activations and \
                    wkey[1].granularity != "per_block":
                plan.biases.append(BiasQuant(node.name, x, wkey))
        return added
