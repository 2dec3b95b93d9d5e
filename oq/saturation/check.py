"""Per-layer checks of a QDQ model (the analytic worst case, and the kernel emulated on real activations) and the
whole model's outputs as an x86 CPU without VNNI computes them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from .layers import IntLayer, find_layers
from .pairs import INT16_MAX, exceeds_int16, largest, order_free_bounds, pair_bounds, pair_count
from .runtime import _session, _with_outputs, capture


@dataclass
class AnalyticRow:
    name: str
    op: str
    k: int
    channels: int
    at_risk: int  # channels with a pair that can saturate, onnxruntime's pairing
    at_risk_any_order: int  # same, for any pairing (conservative)
    worst: float  # worst |pair sum| / 32767, onnxruntime's pairing
    note: str = ""


def analyze_layer(layer: IntLayer, amax: int = 255) -> AnalyticRow:
    """Analytic worst case: every activation at `amax` (the largest u8 value it can take: with min/max
    calibration the calibrated maximum maps to 255)."""
    note = layer.exact_kernel or ""
    if note:
        return AnalyticRow(layer.name, layer.op, layer.k, layer.channels, 0, 0, 0.0, note)
    b = pair_bounds(layer.wg, amax)
    rows = np.moveaxis(layer.wg, 1, 2).reshape(layer.channels, layer.k)
    free = order_free_bounds(rows, amax)
    return AnalyticRow(layer.name, layer.op, layer.k, layer.channels, int(exceeds_int16(b).sum()),
                       int(exceeds_int16(free).sum()), float(b.max(initial=0) / INT16_MAX))


def analyze_model(model: onnx.ModelProto, amax: int = 255) -> tuple[list[AnalyticRow], list]:
    layers, skipped = find_layers(model)
    return [analyze_layer(l, amax) for l in layers], skipped


@dataclass
class LayerCheck:
    name: str
    op: str
    k: int
    channels: int
    rows: int  # GEMM rows (output positions) emulated
    amax: int  # largest u8 activation seen
    saturated_pairs: int
    total_pairs: int
    channels_saturating: int
    max_rel_err: float  # max |error| / max |exact output|, layer output before bias
    sqnr_db: float  # exact vs saturated layer output
    note: str = ""

    @property
    def saturated_fraction(self) -> float:
        return self.saturated_pairs / self.total_pairs if self.total_pairs else 0.0


def _sqnr(signal_energy: float, noise_energy: float) -> float:
    if noise_energy <= 0:
        return float("inf")
    if signal_energy <= 0:
        return float("-inf")
    return float(10 * np.log10(signal_energy / noise_energy))


def check_rows(layer: IntLayer, a: np.ndarray) -> LayerCheck:
    """Emulate one layer on GEMM rows a [G, R, K]."""
    r = a.shape[1]
    if layer.exact_kernel or r == 0:
        return LayerCheck(layer.name, layer.op, layer.k, layer.channels, r, largest(a), 0, 0, 0,
                          0.0, float("inf"), layer.exact_kernel or "no data")
    exact = layer.exact(a) * layer.out_scale
    e, count = layer.excess(a)
    err = e * layer.out_scale
    ymax = float(np.abs(exact).max())
    return LayerCheck(layer.name, layer.op, layer.k, layer.channels, r, int(a.max()), count,
                      pair_count(r, layer.k, layer.channels), int((e != 0).any(axis=0).sum()),
                      float(np.abs(err).max() / ymax) if ymax > 0 else 0.0,
                      _sqnr(float((exact ** 2).sum()), float((err ** 2).sum())))


def check_model_saturation(model: onnx.ModelProto, feeds, max_rows: int = 4096, seed: int = 0
                           ) -> tuple[list[LayerCheck], list]:
    """Emulate pair saturation for every u8 x s8 layer of a QDQ model on calibration feeds (a feed dict or an
    iterable of them). The u8 inputs are captured by running the model in onnxruntime with optimisations off
    (the graph's own semantics); at most `max_rows` output positions per layer are emulated (a random subset).
    Host-independent. Returns (per-layer checks, skipped layers)."""
    layers, skipped = find_layers(model)
    rng = np.random.default_rng(seed)
    collected: dict[int, list[np.ndarray]] = {i: [] for i in range(len(layers))}
    for values in capture(model, [l.x for l in layers], feeds):
        for i, layer in enumerate(layers):
            if layer.exact_kernel:
                continue
            x = values[layer.x]
            total = layer.row_count(x.shape)
            idx = np.sort(rng.choice(total, size=min(total, max_rows), replace=False))
            collected[i].append(layer.rows(x, idx))
    checks = []
    fused = fused_layers(model, [l for l in layers if not l.exact_kernel])
    for i, layer in enumerate(layers):
        parts = collected[i]
        a = np.concatenate(parts, axis=1) if parts else np.zeros((layer.groups, 0, layer.k), np.uint8)
        if a.shape[1] > max_rows:
            a = a[:, np.sort(rng.choice(a.shape[1], size=max_rows, replace=False))]
        check = check_rows(layer, a)
        if fused is not None and not check.note and layer.name not in fused:
            check.note = "not fused by onnxruntime: runs in float, cannot saturate"
        checks.append(check)
    return checks, skipped


FUSED_OPS = ("QLinearConv", "QLinearMatMul", "QGemm", "MatMulIntegerToFloat", "MatMulInteger", "ConvInteger")


def fused_layers(model: onnx.ModelProto, layers: list[IntLayer]) -> set[str] | None:
    """Names of the layers onnxruntime's CPU provider turns into integer kernels, found by letting it optimise the
    model (extended level, where the QDQ fusions run; the choice does not depend on the CPU's VNNI support). A
    layer that stays DQ -> Conv -> Q runs in float and cannot saturate (e.g. onnxruntime leaves a Conv unfused when
    its input's DequantizeLinear also feeds other nodes). None if onnxruntime cannot optimise the model."""
    from ..runtime import optimized as runtime_optimized

    already = {l.name for l in layers if any(n.op_type.startswith("QLinear") and (n.name or n.output[0]) == l.name
                                             for n in model.graph.node)}
    try:
        optimized = runtime_optimized(model, "extended")
    except Exception:  # noqa: BLE001 - the caller falls back to "every layer fuses"
        return None
    names, outputs = set(), set()
    for n in optimized.graph.node:
        if n.op_type in FUSED_OPS:
            names.add(n.name.split("_token_")[0])
            outputs.update(n.output)
    q_out = {}
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear":
            q_out.setdefault(n.input[0], []).append(n.output[0])
    return already | {l.name for l in layers
                      if l.name in names or l.y in outputs or any(o in outputs for o in q_out.get(l.y, []))}


def emulate(model: onnx.ModelProto, feeds: dict, layers: list[IntLayer] | None = None,
            max_rounds: int | None = None) -> list[np.ndarray]:
    """The model's outputs as onnxruntime's fused u8 x s8 kernels compute them on an x86 CPU without VNNI.

    The graph runs in onnxruntime with optimisations off (float Conv/MatMul on dequantized values = the exact
    integer result); the output of every u8 x s8 layer gets the saturation error its kernel would add, computed in
    numpy from the layer's actual u8 input. Corrections are fed back as extra inputs and the run repeated until
    they stop changing (at most one round per layer along the longest chain). Differs from the real kernels only
    in float rounding of the requantization."""
    if layers is None:
        layers = [l for l in find_layers(model)[0] if not l.exact_kernel]
        fused = fused_layers(model, layers)
        if fused:
            layers = [l for l in layers if l.name in fused]
    m = onnx.ModelProto()
    m.CopyFrom(model)
    n_out = len(m.graph.output)
    nodes_by_out = {n.output[0]: n for n in m.graph.node if n.output}
    corr_names = []
    adds = []
    for i, layer in enumerate(layers):
        node = nodes_by_out[layer.y]
        exact_name, corr = f"{layer.y}__oq_exact", f"{layer.y}__oq_saturation"
        node.output[0] = exact_name
        adds.append(helper.make_node("Add", [exact_name, corr], [layer.y], name=f"{layer.name}__oq_saturation"))
        m.graph.input.append(helper.make_tensor_value_info(corr, onnx.TensorProto.FLOAT, None))
        corr_names.append(corr)
    # put each Add right after its layer so the node list stays topologically sorted
    new_nodes = []
    add_for = {a.input[0]: a for a in adds}
    for n in m.graph.node:
        new_nodes.append(n)
        if n.output and n.output[0] in add_for:
            new_nodes.append(add_for[n.output[0]])
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    x_names = list(dict.fromkeys(l.x for l in layers))
    inputs = {i.name for i in model.graph.input}
    fetch = [o.name for o in m.graph.output] + [x for x in x_names if x not in inputs]
    sess = _session(_with_outputs(m, fetch))
    corr = {c: np.zeros((), np.float32) for c in corr_names}
    last_x: dict[str, np.ndarray] = {}
    rounds = (max_rounds or len(layers) + 1)
    res = None
    for _ in range(rounds + 1):
        res = dict(zip(fetch, sess.run(fetch, {**feeds, **corr})))
        res.update({x: feeds[x] for x in x_names if x in inputs})
        changed = False
        for layer, c in zip(layers, corr_names):
            x = res[layer.x]
            key = f"{layer.x}|{layer.name}"
            if key in last_x and np.array_equal(last_x[key], x):
                continue
            last_x[key] = x
            new = layer.correction(x)
            if not (new.shape == corr[c].shape and np.array_equal(new, corr[c])):
                changed = True
            corr[c] = new
        if not changed:
            break
    return [res[o.name] for o in m.graph.output[:n_out]]

