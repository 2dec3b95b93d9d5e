"""SmoothQuant (Xiao et al. 2023): move activation outliers into the weights of the MatMul/Gemm that read them.

A few channels of a transformer's LayerNorm output are often far larger than the rest, so one per-tensor activation
scale wastes most of its grid on them. Per input channel j of a layer y = X W,
    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha),   X' = X / s,   W' = diag(s) W,
leaves y unchanged and evens the activation channels out at the weights' expense. All layers reading X share one s
(their weights' rows are pooled for max|W_j|).

X / s must cost nothing at run time, so s is folded into X's producer where that is exact: a LayerNormalization over
the last axis (gamma and beta divided by s) or a Mul by a constant (the constant divided by s). Where X has no such
producer the layers are left alone and the pass says so; with `insert_mul=True` (Python API) a Mul by 1 / s is
inserted instead. Only X whose every reader is a MatMul (2-D constant weight) or Gemm (transA = 0) that the target
quantizes (activation input 0, weight input 1) and that --exclude leaves alone take part.

It runs before fusion grouping, annotation and calibration, on the float graph, because every activation range
downstream of X changes. The channel maxima (and min/max for the activation range) come from one onnxruntime pass
over the calibration data (at most 256 samples); besides them only a bounded sample of X's rows is kept (at most
2048 rows per X, a fixed number per sample, so results do not depend on the batching).

alpha: given (0 < alpha < 1), it is used for every X. Not given, it is searched per X over 0.3, 0.4, ..., 0.8: the
criterion is the summed squared output error of X's layers on the sampled rows, with X / s quantized per tensor on
the target's activation grid (range: the smoothed min/max) and s W on its weight grid; alpha = 0 (no smoothing) takes
part, so an X whose error no alpha lowers stays as it was.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from oq import ir
from oq.errors import OqError
from oq.opinfo import weighted_op
from oq.overrides import matches
from oq.passmanager import Context, Pass, PassResult
from oq.spec import dequantize_array, qparams_from_range, quantize_array, weight_qparams

from .reconstruct import _positions, sampled_captures

ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
MAX_SCALE = 1e4  # s is clamped to [1 / MAX_SCALE, MAX_SCALE]


class _Group:
    """One smoothed activation: the tensor, the layers reading it, and its statistics."""

    def __init__(self, x: gs.Tensor, layers: list[gs.Node], channels: int):
        self.x, self.layers, self.channels = x, layers, channels
        self.lo = np.full(channels, np.inf)
        self.hi = np.full(channels, -np.inf)
        self.rows: list[np.ndarray] = []


def _candidate(x: gs.Tensor, uses: ir.UseIndex, target, exclude) -> tuple[list[gs.Node], int] | str:
    """The layers reading x and x's channel count, or why x is not smoothed."""
    readers = uses.consumers(x)
    if not readers or x.name in uses.graph_outputs:
        return "also a graph output" if readers else "no readers"
    layers, channels = [], None
    for use in readers:
        node = use.node
        info = weighted_op(node)
        if node.op not in ("MatMul", "Gemm") or use.index != 0:
            return f"also read by {node.op} '{node.name}'"
        if node.op == "Gemm" and node.attrs.get("transA", 0):
            return f"Gemm '{node.name}' with transA"
        w_t = node.inputs[info.weight_input] if len(node.inputs) > info.weight_input else None
        w = ir.constant_value(w_t) if w_t is not None else None
        if w is None or w.ndim != 2 or w.dtype.kind != "f":
            return f"'{node.name}' has no constant 2-D float weight"
        if len(uses.consumers(w_t)) != 1:
            return f"weight of '{node.name}' is shared"
        rule = target.ops.get(node.op) if target is not None else None
        if rule is None or rule.spec_name_for(0) is None or rule.spec_name_for(info.weight_input) is None:
            return f"the target does not quantize {node.op} '{node.name}'"
        if any(matches(node, p) for p in exclude):
            return f"'{node.name}' is excluded"
        k = info.input_channels(node, w.shape)
        if channels is not None and k != channels:
            return "readers disagree on the channel count"
        channels = k
        layers.append(node)
    if not x.shape or x.shape[-1] != channels:
        return "channel axis is not the last axis"
    return layers, channels


def _fold_site(x: gs.Tensor, uses: ir.UseIndex) -> tuple[gs.Node, list[int]] | None:
    """X's producer and the inputs that absorb 1 / s exactly: LayerNormalization's gamma and beta (last axis), or
    a Mul's constant. None where there is no such producer."""
    node = ir.producer(x)
    if node is None or not x.shape:
        return None

    def private(t):
        value = ir.constant_value(t)
        ok = value is not None and value.dtype.kind == "f" and len(uses.consumers(t)) == 1
        return ok and (value.ndim == 0 or (value.ndim <= len(x.shape) and all(d == 1 for d in value.shape[:-1])
                                          and value.shape[-1] in (1, x.shape[-1])))

    if node.op == "LayerNormalization":
        axis = int(node.attrs.get("axis", -1))
        if axis not in (-1, len(x.shape) - 1) or len(node.outputs) > 1 and any(o.outputs for o in node.outputs[1:]):
            return None
        idx = [i for i in (1, 2) if len(node.inputs) > i and node.inputs[i].name]
        return (node, idx) if all(private(node.inputs[i]) for i in idx) else None
    if node.op == "Mul":
        consts = [i for i, t in enumerate(node.inputs) if ir.constant_value(t) is not None]
        if len(consts) == 1 and private(node.inputs[consts[0]]):
            return node, consts
    return None


def _as_gemm(node: gs.Node, w: np.ndarray) -> np.ndarray:
    """The weight as [K, N] (input channels on rows)."""
    return weighted_op(node).gemm_weight(node, w)[0]


def _quantized_weight(node: gs.Node, w: np.ndarray, spec) -> np.ndarray:
    info = weighted_op(node)
    axis = {"per_channel": info.output_axis(node, w.ndim), "per_block": info.input_axis(node, w.ndim)}.get(
        spec.granularity)
    qp = weight_qparams(w, spec, axis)
    return dequantize_array(quantize_array(w.astype(np.float32), qp), qp)


def scales(amax_x: np.ndarray, amax_w: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), 1 where a channel is all zero, clamped."""
    s = np.ones_like(amax_x, dtype=np.float64)
    ok = (amax_x > 0) & (amax_w > 0)
    s[ok] = amax_x[ok] ** alpha / amax_w[ok] ** (1 - alpha)
    return np.clip(s, 1 / MAX_SCALE, MAX_SCALE)


def output_error(group: _Group, s: np.ndarray, target) -> float:
    """Squared error, summed over the group's layers and sampled rows, of the quantized smoothed layer against the
    float one."""
    rows = np.concatenate(group.rows).astype(np.float64)
    act = target.spec(target.ops[group.layers[0].op].spec_name_for(0))
    qp = qparams_from_range(float(np.min(group.lo / s)), float(np.max(group.hi / s)), act)
    xq = dequantize_array(quantize_array((rows / s).astype(np.float32), qp), qp).astype(np.float64)
    err = 0.0
    for node in group.layers:
        info = weighted_op(node)
        w = ir.constant_value(node.inputs[info.weight_input]).astype(np.float64)
        spec = target.spec(target.ops[node.op].spec_name_for(info.weight_input))
        wq = _quantized_weight(node, info.scale_input_channels(node, w, s), spec).astype(np.float64)
        err += float(((xq @ _as_gemm(node, wq) - rows @ _as_gemm(node, w)) ** 2).sum())
    return err


class SmoothQuant(Pass):
    name = "smoothquant"

    def __init__(self, data, target=None, exclude=(), alpha: float | None = None, batch_size: int = 16,
                 insert_mul: bool = False, max_samples: int = 256, max_rows: int = 2048, seed: int = 0):
        self.data, self.target, self.exclude, self.alpha = data, target, list(exclude), alpha
        self.batch_size, self.insert_mul = batch_size, insert_mul
        self.max_samples, self.max_rows, self.seed = max_samples, max_rows, seed

    def run(self, ctx: Context) -> PassResult:
        target = self.target if self.target is not None else ctx.target
        graph = ctx.graph
        uses = ir.UseIndex(graph)
        groups, notes = [], []
        seen = set()
        for node in graph.nodes:
            if node.op not in ("MatMul", "Gemm") or not node.inputs or node.inputs[0].name in seen:
                continue
            x = node.inputs[0]
            seen.add(x.name)
            if not isinstance(x, gs.Variable) or not ir.is_float(x):
                continue
            found = _candidate(x, uses, target, self.exclude)
            if isinstance(found, str):
                notes.append(f"'{x.name}': not smoothed ({found})")
                continue
            if _fold_site(x, uses) is None and not self.insert_mul:
                producer = ir.producer(x)
                what = f"{producer.op} '{producer.name}'" if producer is not None else "a graph input"
                notes.append(f"'{x.name}': not smoothed (produced by {what}, which cannot absorb the scales; "
                             f"a Mul would have to be inserted)")
                continue
            groups.append(_Group(x, *found))
        if not groups:
            return PassResult(False, notes + ["no activation to smooth"])
        samples = self._collect(ir.to_model(graph), groups)
        lines, done = [], 0
        for group in groups:
            amax_x = np.maximum(np.abs(group.lo), np.abs(group.hi))
            amax_w = np.zeros(group.channels)
            for node in group.layers:
                info = weighted_op(node)
                amax_w = np.maximum(amax_w, info.input_ranges(node, ir.constant_value(node.inputs[info.weight_input])))
            base = output_error(group, np.ones(group.channels), target)
            if self.alpha is not None:
                alpha, s = self.alpha, scales(amax_x, amax_w, self.alpha)
                err = output_error(group, s, target)
            else:
                tried = [(output_error(group, scales(amax_x, amax_w, a), target), a) for a in ALPHAS]
                err, alpha = min(tried)
                s = scales(amax_x, amax_w, alpha)
                if not err < base:
                    lines.append(f"'{group.x.name}': left as it was (no alpha lowers the output error, "
                                 f"{base:.3g} unsmoothed)")
                    continue
            how = self._apply(graph, uses, group, s)
            done += 1
            gain = 10 * np.log10(base / err) if err > 0 and base > 0 else float("inf")
            lines.append(f"'{group.x.name}' -> {', '.join(n.name for n in group.layers)}: alpha {alpha:g}, {how}, "
                         f"output error {base:.3g} -> {err:.3g} ({gain:+.1f} dB), channel max/median "
                         f"{amax_x.max() / max(np.median(amax_x), 1e-30):.1f} -> "
                         f"{(amax_x / s).max() / max(np.median(amax_x / s), 1e-30):.1f}")
        head = f"smoothed {done} of {len(groups)} activations on {samples} samples"
        return PassResult(done > 0, [head] + lines + notes)

    # -----------------------------------------------------------------------------------------------------------
    def _collect(self, model, groups: list[_Group]) -> int:
        """Channel min/max of every X over the calibration samples and a bounded sample of its rows."""
        used = 0
        for values, count, first, per_sample in sampled_captures(model, [g.x.name for g in groups], self.data,
                                                                 self.batch_size, self.max_samples, self.max_rows,
                                                                 "channel maxima for smoothquant"):
            for g in groups:
                x = np.asarray(values[g.x.name], np.float32).reshape(-1, g.channels)
                np.minimum(g.lo, x.min(axis=0), out=g.lo)
                np.maximum(g.hi, x.max(axis=0), out=g.hi)
                g.rows.append(x[_positions(x.shape[0], count, first, per_sample, self.seed)])
            used += count
        for g in groups:
            if not np.isfinite(g.lo).all() or not np.isfinite(g.hi).all():
                raise OqError(f"tensor '{g.x.name}' produced NaN or inf (or nothing) on the calibration data")
        return used

    def _apply(self, graph: gs.Graph, uses: ir.UseIndex, group: _Group, s: np.ndarray) -> str:
        """W' = diag(s) W for every reader; X' = X / s folded into the producer (or a Mul inserted)."""
        for node in group.layers:
            info = weighted_op(node)
            t = node.inputs[info.weight_input]
            w = ir.constant_value(t)
            node.inputs[info.weight_input] = gs.Constant(t.name, info.scale_input_channels(node, w, s).astype(w.dtype))
        site = _fold_site(group.x, uses)
        if site is None:
            namer = ir.Namer(graph)
            inv = gs.Constant(namer(f"{group.x.name}_smooth_scale"), (1 / s).astype(np.dtype(group.x.dtype)))
            out = gs.Variable(namer(f"{group.x.name}_smoothed"), dtype=group.x.dtype, shape=group.x.shape)
            for node in group.layers:
                node.inputs[0] = out
            graph.nodes.append(gs.Node("Mul", namer(f"{group.x.name}_smooth_Mul"), {}, [group.x, inv], [out]))
            ir.toposort(graph)
            return "Mul by 1/s inserted"
        producer, idx = site
        for i in idx:
            t = producer.inputs[i]
            value = ir.constant_value(t)
            maker = ir.producer(t)
            producer.inputs[i] = gs.Constant(t.name, (value.astype(np.float64) / s).astype(value.dtype))
            if maker is not None and maker.op == "Constant":  # the Constant node now feeds nothing
                graph.nodes.remove(maker)
        return f"folded into {producer.op} '{producer.name}'"
