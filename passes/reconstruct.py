"""Learn each weight's rounding from calibration data (AdaRound) instead of rounding to the nearest grid point.

Runs after calibrate (and the saturation guard), before insert-qdq, only with `algo = "adaround"`. The scales and
zero-points stay as calibration made them; what changes is, per weight, whether it is rounded up or down. The
learned codes reach the output through the weight initializers: each quantized weight is replaced by its
dequantized grid points (q - z) * s, which insert-qdq's quantize_array (and FakeQuant's float32 division)
quantize back to exactly the learned codes; the pass checks that round trip for every value.

Layer inputs come from the float graph run in onnxruntime (optimisations off) on at most `max_samples` calibration
samples (default 256, fewer when --calib-size says so). Memory is bounded twice:
  - per layer, at most `max_rows` GEMM rows are kept (default 4096, spread evenly over the samples: a convolution
    contributes that many im2col patches at random output positions per sample, a MatMul/Gemm that many rows of
    its input), i.e. max_rows * K float32 values for a weight with K inputs per output channel;
  - the layers' cached rows together stay under `max_memory_mb` (default 256 MB): layers are processed in groups
    that fit, one onnxruntime pass over the samples per group.
The sampled positions depend on the sample's index only, not on the batching, and every group reads the float
model (weights are written back once all layers are done), so results do not depend on --batch-size or
--max-memory.

A layer keeps round-to-nearest when its learned rounding does not lower its output error on the cached rows, and
when the pass cannot handle it: FP8 grids, a weight read by several layers or also by a float node, a weight that is
not a float initializer, a MatMul weight with batch dimensions, a ConvTranspose with output_shape or auto_pad.

Measured (README, "Weight rounding: AdaRound"): held-out SQNR at 4-bit weights (academic target) +11.7 dB on
resnet_mini, +2.2 mobilenet_mini, +6.8 decoder, +2.3 mlp, +3.1 transformer; at W8A8 (tensorrt) +0.0 to +1.8 dB;
0.6 to 19 s per model on 2 CPU cores with the defaults.

The optimisation itself (oq.bridge.adaround) needs torch; it is imported only when this pass runs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from oq import ir
from oq.errors import OqError
from oq.gemm_rows import GemmLayer, gemm_layer
from oq.opinfo import weighted_op
from oq.passmanager import Context, Pass, PassResult, has_plan
from oq.plan import WeightQuant
from oq.saturation.runtime import capture
from oq.spec import QParams, quantize_array

DEFAULT_ITERS = 1000


@dataclass
class _Job:
    """One weight to reconstruct: its plan entry, the layer reading it, and how to cut that layer's input into rows."""

    wq: WeightQuant
    node: gs.Node
    w: np.ndarray
    x: str  # the layer's input tensor
    gemm: GemmLayer  # the layer as GEMMs on rows of its input
    rows: list  # collected [G, r, K] blocks


def _bytes(job: _Job, max_rows: int) -> int:
    return job.gemm.groups * max_rows * job.gemm.k * 4


class AdaRound(Pass):
    name = "adaround"
    requires = (has_plan,)

    def __init__(self, data, batch_size: int = 16, iters: int | None = None, device: str = "cpu",
                 max_samples: int = 256, max_rows: int = 4096, max_memory_mb: float | None = None, seed: int = 0,
                 **settings):
        self.data, self.batch_size, self.device = data, batch_size, device
        self.iters = DEFAULT_ITERS if iters is None else iters
        self.max_samples, self.max_rows, self.seed = max_samples, max_rows, seed
        self.max_memory_mb = 256.0 if max_memory_mb is None else max_memory_mb
        self.settings = settings  # further oq.bridge.adaround.Settings fields (lr, reg, batch_rows, ...)

    def run(self, ctx: Context) -> PassResult:
        from oq.bridge import require_torch

        require_torch()
        from oq.bridge import adaround

        settings = adaround.Settings(iters=self.iters, seed=self.seed, device=self.device, **self.settings)
        jobs, notes = self._jobs(ctx)
        record = {"algorithm": "adaround", "iterations": self.iters, "device": self.device, "layers": [],
                  "left_at_nearest": list(notes)}
        if ctx.report is not None:
            ctx.report.calibration["reconstruction"] = record
        if not jobs:
            return PassResult(False, notes + ["no layer to reconstruct"])
        tensors = ctx.graph.tensors()
        start, lines, learned = time.perf_counter(), [], {}
        budget = max(1, int(self.max_memory_mb * 2**20))
        model = ir.to_model(ctx.graph)  # the float model: every layer learns from float inputs
        for group in _groups(jobs, lambda j: _bytes(j, self.max_rows), budget):
            samples = self._collect(model, group)
            for job in group:
                rows = np.concatenate(job.rows, axis=1) if job.rows else None
                job.rows = []
                if rows is None or rows.shape[1] == 0:
                    notes.append(f"{job.node.name}: no input rows captured, left at round-to-nearest")
                    continue
                entry, line, value = self._learn(job, rows, settings, adaround)
                entry["samples"] = samples
                record["layers"].append(entry)
                lines.append(line)
                if value is not None:
                    learned[job.wq.tensor] = value
        for name, value in learned.items():
            tensors[name].values = value
        changed = len(learned)
        record["seconds"] = round(time.perf_counter() - start, 3)
        record["left_at_nearest"] = list(notes)
        head = (f"{len(record['layers'])} layers reconstructed ({changed} weight tensors rewritten), {self.iters} "
                f"iterations each on {self.device}, {record['seconds']:.1f}s")
        return PassResult(changed > 0, [head] + lines + notes)

    # -----------------------------------------------------------------------------------------------------------
    def _learn(self, job: _Job, rows: np.ndarray, settings, adaround):
        """Learn one weight's rounding: (report entry, note, new weight values or None to keep it)."""
        wq, qp = job.wq, job.wq.qparams
        w32 = job.w.astype(np.float32)
        nearest = quantize_array(w32, qp).astype(np.int64)
        scale, zp = qp.expanded(w32.shape)
        qmin, qmax = _nearest_range(nearest, qp)
        layer = adaround.Layer(w32, scale, zp, qmin, qmax, job.gemm.index, rows)
        start = time.perf_counter()
        out = adaround.learn(layer, settings, nearest)
        seconds = time.perf_counter() - start
        name = job.node.name
        entry = {"node": name, "op": job.node.op, "weight": wq.tensor, "weights": int(job.w.size),
                 "rows": int(rows.shape[1]), "mse_nearest": out.mse_nearest, "mse_learned": out.mse_learned,
                 "seconds": round(seconds, 3)}
        if not out.mse_learned < out.mse_nearest:
            entry.update(kept="nearest", changed_share=0.0)
            return entry, (f"{name}: kept round-to-nearest (learned rounding did not lower the output error, "
                           f"MSE {out.mse_nearest:.3g} -> {out.mse_learned:.3g})"), None
        value, codes, fallback = _grid_values(out.codes, qp, job.w.dtype, job.w)
        share = float(np.mean(codes != nearest))
        entry.update(kept="learned", changed_share=round(share, 6), round_trip_fallback=fallback)
        gain = 10 * math.log10(out.mse_nearest / out.mse_learned) if out.mse_learned > 0 else float("inf")
        extra = f"; {fallback} values kept at nearest (grid point not representable)" if fallback else ""
        return entry, (f"{name}: output MSE {out.mse_nearest:.3g} -> {out.mse_learned:.3g} ({gain:.1f} dB), "
                       f"{100 * share:.1f}% of {job.w.size} weights rounded away from nearest{extra}"), value

    def _jobs(self, ctx: Context) -> tuple[list[_Job], list[str]]:
        """The weights to reconstruct, in the graph's (topological) order, and notes on those left alone."""
        plan, graph = ctx.plan, ctx.graph
        tensors = graph.tensors()
        nodes = {n.name: n for n in graph.nodes}
        order = {n.name: i for i, n in enumerate(graph.nodes)}
        per_tensor: dict[str, int] = {}
        for wq in plan.weights.values():
            per_tensor[wq.tensor] = per_tensor.get(wq.tensor, 0) + 1
        jobs, notes = [], []
        entries = sorted(plan.weights.items(), key=lambda kv: min((order.get(c, 1 << 30) for c, _ in
                                                                   kv[1].consumers), default=1 << 30))
        for _, wq in entries:
            consumers = sorted(wq.consumers)
            where = consumers[0][0] if consumers else wq.tensor
            tensor = tensors.get(wq.tensor)
            why = None
            if wq.qparams is None:
                why = "not calibrated"
            elif wq.spec.is_float:
                why = f"{wq.spec.dtype} is a float grid"
            elif not isinstance(tensor, gs.Constant) or np.asarray(tensor.values).dtype.kind != "f":
                why = "weight is not a float initializer"
            elif len(consumers) != 1 or per_tensor[wq.tensor] > 1:
                why = "weight read by several layers"
            elif {(n.name, i) for n in tensor.outputs for i, t in enumerate(n.inputs) if t is tensor} \
                    != set(consumers):
                why = "weight also read by a float node"
            if why is None:
                node_name, idx = consumers[0]
                node = nodes.get(node_name)
                info = weighted_op(node) if node is not None else None
                w = np.asarray(tensor.values)
                gemm = None
                if info is None or idx != info.weight_input:
                    why = f"input {idx} of {node.op if node is not None else '?'} is not its weight"
                elif w.size == 0:
                    why = "empty weight"
                elif not isinstance(node.inputs[0], gs.Variable):
                    why = "the layer's input is a constant"
                else:
                    gemm = gemm_layer(node, w)
                    if isinstance(gemm, str):
                        why, gemm = gemm, None
                if gemm is not None:
                    jobs.append(_Job(wq, node, w, node.inputs[0].name, gemm, []))
                    continue
            notes.append(f"{where}: left at round-to-nearest ({why})")
        return jobs, notes

    def _collect(self, model, jobs: list[_Job]) -> int:
        """Sample GEMM rows of each job's input from the float graph on up to max_samples samples; returns how many
        samples were used."""
        used = 0
        for values, count, first, per_sample in sampled_captures(model, [j.x for j in jobs], self.data,
                                                                 self.batch_size, self.max_samples, self.max_rows,
                                                                 "layer inputs for weight reconstruction"):
            for job in jobs:
                x = np.asarray(values[job.x], np.float32)
                idx = _positions(job.gemm.row_count(x.shape), count, first, per_sample, self.seed)
                job.rows.append(job.gemm.rows(x, idx))
            used += count
        return used


def sampled_captures(model, names: list[str], data, batch_size: int, max_samples: int, max_rows: int, purpose: str):
    """(values of `names`, samples in the batch, index of its first sample, rows to keep per sample) for the
    calibration batches run through `model` in onnxruntime, at most max_samples samples and about max_rows rows in
    all; onnxruntime failing on the user's data is one OqError naming the `purpose`."""
    try:
        n = len(data)  # 0 when a function source does not know
    except (TypeError, NotImplementedError):
        n = 0
    n = min(n or max_samples, max_samples)
    per_sample = max(1, -(-max_rows // n))
    counts: list[int] = []

    def feeds():
        for take, feed in capped_batches(data, batch_size, max_samples):
            counts.append(take)
            yield feed

    first = 0
    for values in explained_capture(model, names, feeds(), data, f"collecting {purpose}"):
        count = counts[-1]
        yield values, count, first, per_sample
        first += count


def explained_capture(model, names: list[str], feeds, data, doing: str):
    """oq.saturation.runtime.capture, with onnxruntime failing on the user's data turned into one OqError line
    naming the data and what was being done; errors in the caller's own loop body pass as they are."""
    values_of = capture(model, names, feeds)
    while True:
        try:
            values = next(values_of)
        except StopIteration:
            return
        except OqError:
            raise
        except Exception as exc:  # onnxruntime failures on user data
            where = getattr(data, "where", "calibration data")
            raise OqError(f"{where}: onnxruntime failed while {doing}: {str(exc).splitlines()[0][:300]}") from None
        yield values


def capped_batches(data, batch_size: int, max_samples: int):
    """(samples, feed) for the calibration batches, cut so that no more than max_samples samples come in all."""
    used = 0
    for count, feed in data.batches(batch_size):
        take = min(count, max_samples - used)
        if take <= 0:
            return
        used += take
        yield take, (feed if take == count else {k: v[:take] for k, v in feed.items()})


def _positions(total: int, count: int, first: int, per_sample: int, seed: int) -> np.ndarray:
    """Row indices to keep from a feed of `count` samples (numbered from `first`) with `total` rows: per sample,
    `per_sample` rows drawn from its own contiguous block, with a generator seeded by the sample's number, so the
    choice does not depend on how samples were batched. Rows that do not split evenly are drawn from as one block."""
    blocks = count if count > 0 and total % count == 0 else 1
    size = total // blocks
    out = []
    for b in range(blocks):
        rng = np.random.default_rng([seed, first + b])
        k = min(size, per_sample * (1 if blocks == count else count))
        out.append(b * size + np.sort(rng.choice(size, size=k, replace=False)))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _nearest_range(nearest: np.ndarray, qp) -> tuple[np.ndarray, np.ndarray]:
    """Per value, the codes learning may choose from: the grid, narrowed to zero-point +- the largest |q - z| that
    rounding to nearest gives among the values sharing its scale. A bound on |q - z| that a step before relied on
    (the saturation guard's q = 64 rung: no int16 pair sum can overflow) still holds."""
    qmin, qmax = qp.spec.qrange
    scale, zp = qp.expanded(nearest.shape)
    zp = np.broadcast_to(np.asarray(zp, np.int64), nearest.shape)
    group = np.arange(np.asarray(qp.scale).size).reshape(np.shape(qp.scale))
    group = np.broadcast_to(QParams(group, group, qp.axis, qp.spec, qp.block_size).expanded(nearest.shape)[0],
                            nearest.shape).reshape(-1)
    largest = np.zeros(np.asarray(qp.scale).size, np.int64)
    np.maximum.at(largest, group, np.abs(nearest - zp).reshape(-1))
    reach = largest[group].reshape(nearest.shape)
    return np.maximum(zp - reach, qmin), np.minimum(zp + reach, qmax)


def _groups(items: list, size, budget: int) -> list[list]:
    """Consecutive items in groups whose sizes sum to at most `budget` (an item larger than it goes alone)."""
    groups, current, used = [], [], 0
    for item in items:
        s = size(item)
        if current and used + s > budget:
            groups.append(current)
            current, used = [], 0
        current.append(item)
        used += s
    return groups + ([current] if current else [])


def _grid_values(codes: np.ndarray, qp, dtype, original: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Weight values (in `dtype`) that quantize to `codes` through quantize_array: the dequantized grid points
    (q - z) * s. A grid point that does not survive the round trip (e.g. not representable in float16) keeps its
    original value, i.e. its round-to-nearest code. Returns (values, their codes, how many kept the original)."""
    scale, zp = qp.expanded(codes.shape)
    values = ((codes.astype(np.float32) - np.asarray(zp, np.float32)) * np.asarray(scale, np.float32))
    values = values.astype(np.float32).astype(dtype)
    back = quantize_array(values.astype(np.float32), qp).astype(np.int64)
    bad = back != codes
    if bad.any():
        values = np.where(bad, np.asarray(original, dtype), values).astype(dtype)
        back = quantize_array(values.astype(np.float32), qp).astype(np.int64)
    return values, back, int(bad.sum())
