"""Compute qparams: weights from their values, activations from observers fed by streamed calibration data."""
from __future__ import annotations

import numpy as np

from oq import ir
from oq.calibration import observe
from oq.errors import OqError
from oq.observers import accepted_kwargs, make_observer, observer_factory
from oq.passmanager import Context, Pass, PassResult, has_plan
from oq.spec import QParams, qparams_from_range, weight_qparams


def observer_for(method: str, spec, extra: dict):
    """An observer for one tensor. It gets, of what is known (the spec's grid and the run's observer options), the
    keyword arguments its factory's signature names, so a registered observer takes part without a table here."""
    known = dict(extra)
    if spec is not None:
        known.update(bits=spec.bits, symmetric=spec.symmetric)
        if spec.symmetric and spec.signed:
            qmin, qmax = spec.qrange
            known["levels"] = (qmax - qmin + 1) // 2  # a signed symmetric grid has half its levels per side
    return make_observer(method, **accepted_kwargs(observer_factory(method), known))


def _finer_power_of_two(qp, observer):
    """Power-of-two scales round up, wasting up to a bit; when the observer kept a histogram, take half the scale
    instead if that quantizes the observed values with less error (clipping a thin tail for twice the resolution)."""
    if not qp.spec.power_of_two or not hasattr(observer, "quantization_error"):
        return qp
    qmin, qmax = qp.spec.qrange
    zp = float(np.asarray(qp.zero_point, np.float64))
    scale = float(qp.scale)
    if observer.quantization_error(scale / 2, zp, qmin, qmax) < observer.quantization_error(scale, zp, qmin, qmax):
        return QParams(np.asarray(scale / 2, np.float32), qp.zero_point, qp.axis, qp.spec)
    return qp


def _rows_are_samples(graph):
    """A predicate: does axis 0 of a tensor hold whole samples, whatever the batching? True when the tensor's first
    dim is the inputs' symbolic batch dim, or when the inputs' batch is fixed (feeds are never concatenated)."""
    batch_dims = [t.shape[0] if t.shape else None for t in graph.inputs]
    if all(isinstance(d, int) for d in batch_dims):
        return lambda tensor: True
    symbols = {d for d in batch_dims if isinstance(d, str)}
    return lambda tensor: bool(tensor.shape) and tensor.shape[0] in symbols


class Calibrate(Pass):
    name = "calibrate"
    requires = (has_plan,)

    def __init__(self, data, batch_size: int = 1, method: str | None = None, progress: bool | None = None,
                 max_memory_mb: float | None = None, observer_args: dict | None = None):
        self.data, self.batch_size, self.method, self.progress = data, batch_size, method, progress
        self.max_memory_mb = max_memory_mb
        self.observer_args = observer_args or {}

    def run(self, ctx: Context) -> PassResult:
        plan = ctx.plan
        tensors = ctx.graph.tensors()
        for wq in plan.weights.values():
            wq.qparams = weight_qparams(ir.constant_value(tensors[wq.tensor]), wq.spec, wq.axis)
        groups = plan.observed_groups()
        members = [m for ms in groups.values() for m in ms]
        observers = {}
        row_samples = _rows_are_samples(ctx.graph)
        for name in members:
            spec = plan.activations[name].spec if name in plan.activations else None
            observers[name] = observer_for(self.method or (spec.observer if spec else "minmax"), spec,
                                           self.observer_args)
            if hasattr(observers[name], "rows_are_samples"):
                observers[name].rows_are_samples = row_samples(tensors[name])
        if observers:
            stats = observe(ir.to_model(ctx.graph), observers, self.data, self.batch_size, self.progress,
                            self.max_memory_mb)
        else:
            stats = {"samples": 0, "tensors": 0, "seconds": 0.0}
        stats["method"] = self.method or ", ".join(sorted({type(o).name for o in observers.values()})) or "none"
        for root, ms in groups.items():
            merged = observers[ms[0]]
            for m in ms[1:]:
                merged.merge(observers[m])
            lo, hi = merged.range()
            if not (np.isfinite(lo) and np.isfinite(hi)):
                raise OqError(f"tensor '{ms[0]}' produced NaN or inf during calibration")
            for m in ms:
                if m in plan.activations:
                    qp = qparams_from_range(lo, hi, plan.activations[m].spec)
                    plan.activations[m].qparams = _finer_power_of_two(qp, merged)
        if ctx.report is not None:
            ctx.report.calibration = stats
        return PassResult(False, [f"{stats['samples']} samples, {stats['tensors']} tensors, {stats['seconds']:.2f}s"])
