"""Guard onnxruntime's u8 x s8 kernels against int16 pair saturation on x86 CPUs without VNNI.

Runs after calibrate and before insert-qdq, only for targets with `u8s8_saturation = "guard"` (onnxruntime) and a
deployment CPU without VNNI (option `cpu`: auto = this machine, vnni, avx2, avx512, arm64). See oq/saturation.py
for what the kernels do.

Why the decision is empirical, per channel. The analytic worst case (every activation at its largest u8 value) is
useless with 8-bit per-channel weights: every channel holds a +-127, and with activations calibrated by min/max
the largest value is 255, so any same-sign neighbour with |w| >= 2 "can" overflow; on the reference models it flags
80-90% of all channels (202 of 226 in resnet_mini, 528 of 666 in mobilenet_mini, 393 of 448 in the
transformer; 100% with the order-free bound), and re-quantizing all of them to 7 bits is close to what
onnxruntime's global `reduce_range` does (it costs accuracy everywhere, on VNNI too). Real activations rarely put
two large u8 values in front of two large same-sign weights: 0.001-0.5% of the pairs saturate on calibration data.
So the analytic bound is only a pre-filter (layers where no pair can overflow are skipped without looking at data),
and for the others the pass emulates the kernel on calibration data (the float graph run on the first 32 samples,
activations quantized with the plan's qparams, 256 random output positions per sample), and for every output
channel that saturates there compares the squared error of the layer output, against the same layer with float
weights on the same quantized activations, for

    the plan's 8-bit scale, with the pair saturation the AVX2 kernel adds,   and   coarser scales max|w| / q,
    q in 120, 112, ..., 72, 64 (64: no pair can saturate whatever the input, 255 * (64 + 64) = 32640)

and keeps the smallest. There is no tuned threshold: the price of the alternative is the threshold. Per channel
because output channels are independent (each has its own scale, the kernels take per-channel scales for free, and
the layer's squared error is the sum of the channels'); with per-tensor weight scales one scale is chosen for the
layer. Why a ladder and not 7 bits straight away: on resnet_mini the stem conv (27 weights per channel) costs
~2 dB of output SQNR at q = 64 and nothing measurable at q ~ 100 (weights forced to each q, on a VNNI machine).
Among the rungs, the emulated error also picks the one whose rounding suits the channel best (an activation-aware
scale search), so a guarded layer can even come out slightly more accurate than its 8-bit version.

Measured on the reference models (SQNR vs fp32, mean over 4 held-out input sets; "AVX2" is the numpy emulation of
the fused kernels, which matches onnxruntime run on AVX2 under qemu; "VNNI" is onnxruntime's exact kernels):

    model           unguarded VNNI / AVX2   ladder (default)   7 bits only       analytic rule, 7 bits
    resnet_mini     35.2 / 4.1              34.9 / 34.8  (18)  33.1 / 33.1 (15)  33.1 / 33.1 (202 channels)
    mobilenet_mini  34.0 / 20.6             35.1 / 35.0 (161)  33.7 / 33.7 (113) 33.8 / 33.8 (528)
    transformer     29.1 / 28.0             29.1 / 29.1  (42)  29.1 / 29.1 (27)  29.0 / 29.0 (393)

Differences of ~1 dB between guards are at the level of weight-rounding luck on models this small (forcing the
resnet_mini stem to q = 120 instead of 127 moves it by +1.2 dB); the robust findings are: unguarded AVX2 is
catastrophic, every guard fixes it, the empirical guard touches ~10x fewer channels than the analytic rule, and
q = 64 alone costs ~2 dB where few weights feed a channel.

The decision depends on the calibration data: a channel that does not saturate on it keeps 8 bits, and a channel
kept above q = 64 may still saturate, rarely, on other inputs (held-out: AVX2 within 0.2 dB of VNNI above). A
model guarded for `avx2` runs everywhere: on VNNI and ARM the reduced channels only cost their coarser rounding.
"""
from __future__ import annotations

import math

import numpy as np

from oq import ir
from oq.errors import OqError
from oq.opinfo import weighted_op
from oq.passmanager import Context, Pass, PassResult, has_plan
from oq.plan import ALL_CONSUMERS
from oq.saturation import (CPU_WORDS, SATURATING_CPUS, IntLayer, analyze_layer, capture, guard_decision,
                           resolve_cpu)
from oq.spec import QParams, quantize_array


def _finite(x: float):
    return round(float(x), 2) if math.isfinite(x) else None


def _db(x: float) -> str:
    return f"{x:.1f}" if math.isfinite(x) else "inf"


class GuardSaturation(Pass):
    name = "guard-saturation"
    requires = (has_plan,)

    def __init__(self, data, cpu: str = "auto", batch_size: int = 16, max_samples: int = 32,
                 max_rows: int = 8192, seed: int = 0):
        self.data, self.cpu, self.batch_size = data, cpu, batch_size
        self.max_samples, self.max_rows, self.seed = max_samples, max_rows, seed

    def run(self, ctx: Context) -> PassResult:
        target = ctx.target
        if getattr(target, "u8s8_saturation", "ignore") != "guard":
            return PassResult(False, [f"not needed: target {target.name} does not run u8 x s8 kernels that saturate"])
        try:
            cpu, how = resolve_cpu(self.cpu)
        except ValueError as exc:
            raise OqError(str(exc)) from None
        record = {"deployment_cpu": cpu, "cpu_option": self.cpu, "how": how, "kernels": CPU_WORDS[cpu],
                  "layers_checked": 0, "layers_guarded": []}
        if ctx.report is not None:
            ctx.report.calibration["saturation"] = record
        head = f"deployment CPU {cpu} ({how})"
        if cpu not in SATURATING_CPUS:
            return PassResult(False, [f"{head}: u8 x s8 kernels accumulate exactly; all weights stay 8-bit",
                                      "for a model that is safe on every x86 CPU, quantize with cpu=avx2"])

        layers = self._layers(ctx)
        record["layers_checked"] = len(layers)
        candidates = [(l, key, w) for l, key, w in layers if analyze_layer(l).at_risk]
        record["layers_that_can_overflow"] = len(candidates)
        if not candidates:
            return PassResult(False, [f"{head}: {len(layers)} u8 x s8 layers, no weight pair can overflow int16"])

        rows = self._sample_rows(ctx, [l for l, _, _ in candidates])
        # a weight read by several layers gets, per channel, the coarsest scale any of them chose
        chosen: dict[tuple, np.ndarray] = {}
        per_layer = []
        for (layer, key, w), a in zip(candidates, rows):
            if a.shape[1] == 0:
                continue
            wq = ctx.plan.weights[key]
            d = guard_decision(layer, w, a, per_channel=wq.qparams.axis is not None)
            base = chosen.get(key, layer.w_scale.astype(np.float32))
            chosen[key] = np.where(d.reduced, np.maximum(base, d.scale), base).astype(np.float32)
            per_layer.append((layer, d))

        changed = 0
        for key, scales in chosen.items():
            wq = ctx.plan.weights[key]
            qp = wq.qparams
            old = np.broadcast_to(np.asarray(qp.scale, np.float32).reshape(-1), scales.shape)
            if np.array_equal(old, scales):
                continue
            scale = scales if qp.axis is not None and np.ndim(qp.scale) else np.asarray(scales.max(), np.float32)
            wq.qparams = QParams(scale, qp.zero_point, qp.axis, qp.spec)
            changed += 1

        notes, kept = [], []
        for layer, d in per_layer:
            q = d.qmax[d.reduced]
            entry = {"node": layer.name, "op": layer.op, "channels": layer.channels,
                     "channels_reduced": int(d.reduced.sum()), "channels_7bit": int((q == 64).sum()),
                     "qmax_min": int(q.min()) if q.size else 127, "qmax_max": int(q.max()) if q.size else 127,
                     "channels_saturating": d.channels_saturating,
                     "saturated_pairs_percent": round(100 * d.saturated_pairs / max(d.total_pairs, 1), 4),
                     "sqnr_8bit_db": _finite(d.sqnr8_db), "sqnr_guarded_db": _finite(d.sqnr_guarded_db),
                     "sqnr_8bit_on_vnni_db": _finite(d.sqnr8_exact_db)}
            if d.reduced.any():
                record["layers_guarded"].append(entry)
                span = (f"max |q| {entry['qmax_min']}" if entry["qmax_min"] == entry["qmax_max"]
                        else f"max |q| {entry['qmax_min']}..{entry['qmax_max']}")
                notes.append(f"{layer.name}: {entry['channels_reduced']}/{layer.channels} channels reduced ({span}; "
                             f"{entry['saturated_pairs_percent']:.3f}% of pairs saturate on calibration data; "
                             f"layer SQNR {_db(d.sqnr8_db)} -> {_db(d.sqnr_guarded_db)} dB, "
                             f"{_db(d.sqnr8_exact_db)} on VNNI)")
            elif d.channels_saturating:
                kept.append(entry)
        record["layers_saturating_kept_8bit"] = kept
        n_ch = sum(e["channels_reduced"] for e in record["layers_guarded"])
        n7 = sum(e["channels_7bit"] for e in record["layers_guarded"])
        summary = (f"{head}: {len(layers)} u8 x s8 layers, {len(candidates)} can overflow int16, "
                   f"{len(record['layers_guarded'])} guarded ({n_ch} weight channels to coarser scales, {n7} of them "
                   f"at 7 bits; emulated on {self._samples} calibration samples)")
        if kept:
            notes.append(f"saturating but better at 8 bits: {', '.join(e['node'] for e in kept)}")
        return PassResult(changed > 0, [summary] + notes)

    # -----------------------------------------------------------------------------------------------------------
    def _layers(self, ctx: Context) -> list[tuple[IntLayer, tuple, np.ndarray]]:
        """u8 activation x s8 weight layers of the plan: (layer with the plan's 8-bit weights, weight key, float
        weight). Depthwise convolutions run on exact kernels and are left out."""
        plan, graph = ctx.plan, ctx.graph
        nodes = {n.name: n for n in graph.nodes}
        tensors = graph.tensors()
        out = []
        for key, wq in plan.weights.items():
            if wq.qparams is None or wq.spec.dtype != "int8":
                continue
            w = ir.constant_value(tensors[wq.tensor])
            if w is None or w.dtype.kind != "f":
                continue
            for node_name, idx in sorted(wq.consumers):
                node = nodes.get(node_name)
                info = weighted_op(node) if node is not None else None
                if info is None or info.gemm_weight is None or idx != info.weight_input \
                        or not plan.status.get(node_name, (0,))[0]:
                    continue
                if info.gemm_weight(node, w) is None:
                    continue  # not one GEMM (a MatMul weight with batch dimensions)
                x = node.inputs[0]
                aq = plan.activations.get(x.name)
                if aq is None or aq.qparams is None or aq.spec.dtype != "uint8":
                    continue
                if aq.consumers is not ALL_CONSUMERS and (node_name, 0) not in aq.consumers:
                    continue
                if np.any(np.asarray(wq.qparams.zero_point) != 0):
                    continue  # asymmetric weights: the emulation assumes onnxruntime's symmetric path
                attrs = dict(node.attrs)
                layer = IntLayer(node_name, node.op, x.name, node.outputs[0].name,
                                 float(np.asarray(aq.qparams.scale).reshape(-1)[0]),
                                 int(np.asarray(aq.qparams.zero_point).reshape(-1)[0]),
                                 quantize_array(w.astype(np.float32), wq.qparams), wq.qparams.scale, attrs,
                                 info.product_scale(node))
                if layer.exact_kernel:
                    continue
                out.append((layer, key, w))
        return out

    def _sample_rows(self, ctx: Context, layers: list[IntLayer]) -> list[np.ndarray]:
        """GEMM rows (u8, the kernel's K order) of each layer at random output positions of the first
        `max_samples` calibration samples, activations quantized with the plan's qparams."""
        plan = ctx.plan
        rng = np.random.default_rng(self.seed)
        per_sample = max(1, self.max_rows // self.max_samples)
        self._samples = 0

        def feeds():
            for count, feed in self.data.batches(self.batch_size):
                take = min(count, self.max_samples - self._samples)
                if take <= 0:
                    return
                if take < count:
                    feed = {k: v[:take] for k, v in feed.items()}
                self._samples += take
                self._batch = take
                yield feed

        parts: list[list[np.ndarray]] = [[] for _ in layers]
        try:
            for values in capture(ir.to_model(ctx.graph), [l.x for l in layers], feeds()):
                for i, layer in enumerate(layers):
                    x = quantize_array(np.asarray(values[layer.x], np.float32), plan.activations[layer.x].qparams)
                    total = layer.row_count(x.shape)
                    k = min(total, per_sample * self._batch)
                    idx = np.sort(rng.choice(total, size=k, replace=False))
                    parts[i].append(layer.rows(x, idx))
        except OqError:
            raise
        except Exception as exc:  # onnxruntime failures on user data
            raise OqError(f"{self.data.where}: onnxruntime failed while sampling activations for the saturation "
                          f"guard: {str(exc).splitlines()[0][:300]}") from None
        return [np.concatenate(p, axis=1) if p else np.zeros((l.groups, 0, l.k), np.uint8)
                for p, l in zip(parts, layers)]
