"""Compute qparams: weights from their values, activations from observers fed by streamed calibration data."""
from __future__ import annotations

import numpy as np

from oq import ir
from oq.calibration import observe
from oq.errors import OqError
from oq.observers import accepted_kwargs, make_observer, observer_factory
from oq.passmanager import Context, Pass, PassResult, has_plan
from oq.spec import MIN_SCALE, QParams, qparams_from_range, weight_qparams


def observer_for(method: str, spec, extra: dict):
    """An observer for one tensor. It gets, of what is known (the spec's grid and the run's observer options), the
    keyword arguments its factory's signature names, so a registered observer takes part without a table here."""
    known = dict(extra)
    if spec is not None:
        known.update(bits=spec.bits, symmetric=spec.symmetric, spec=spec)
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


def _choices_note(choices: dict[str, str]) -> str:
    """One line counting what the observers chose, e.g. 'range choice: auto:mse x12, auto:minmax x3'."""
    counts: dict[str, int] = {}
    for choice in choices.values():
        counts[choice] = counts.get(choice, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return "range choice: " + ", ".join(f"{c} x{k}" for c, k in ranked)


def _rows_are_samples(graph):
    """A predicate: does axis 0 of a tensor hold whole samples, whatever the batching? True when the tensor's first
    dim is the inputs' symbolic batch dim, or when the inputs' batch is fixed (feeds are never concatenated)."""
    batch_dims = [t.shape[0] if t.shape else None for t in graph.inputs]
    if all(isinstance(d, int) for d in batch_dims):
        return lambda tensor: True
    symbols = {d for d in batch_dims if isinstance(d, str)}
    return lambda tensor: bool(tensor.shape) and tensor.shape[0] in symbols


def _check_weight(wq, values: np.ndarray) -> None:
    """NaN or inf in a weight would turn its range (and the whole layer) into NaN: name the initializer."""
    values = np.asarray(values)
    if values.dtype.kind != "f" or np.isfinite(values).all():
        return
    nan, inf = int(np.isnan(values).sum()), int(np.isinf(values).sum())
    what = " and ".join(f"{n} {kind}" for n, kind in ((nan, "NaN"), (inf, "inf")) if n)
    nodes = sorted({node for node, _ in wq.consumers})
    read_by = f" of node{'s' if len(nodes) > 1 else ''} {', '.join(repr(n) for n in nodes)}" if nodes else ""
    raise OqError(f"weight initializer '{wq.tensor}'{read_by} holds {what} among its {values.size} values (after "
                  f"folding any BatchNorm into it): fix the model's weights")


def _no_range(lo: float, hi: float) -> bool:
    """True when calibration saw nothing to set a scale from: every observed value 0, or no value at all (observers
    report (0, 0) then). The grid covers [min(lo, 0), max(hi, 0)], so a constant non-zero tensor has a range."""
    return max(-min(lo, 0.0), max(hi, 0.0)) <= MIN_SCALE


def _no_range_warning(members: list[str]) -> str:
    names = ", ".join(f"'{m}'" for m in members[:4]) + (f" and {len(members) - 4} more" if len(members) > 4 else "")
    what = f"activation {names}" if len(members) == 1 else f"activations {names} (one shared scale)"
    return (f"{what}: no range on the calibration data (every observed value is 0, or none was observed): its "
            f"scale is a placeholder (1.0), so real inputs will lose all precision there; check the data")


def _data_warnings(data, source: str, no_range: list[list[str]]) -> list[str]:
    """What the report should say about the calibration data: inputs that were all zero, activations left without
    a range, and the data source's own notes (e.g. an endless function source capped)."""
    out = []
    specs, zero = getattr(data, "specs", ()), getattr(data, "zero_inputs", None)
    if specs and zero and zero >= {s.name for s in specs}:
        names = ", ".join(f"'{s.name}'" for s in specs)
        out.append(f"{source}: {'every input' if len(specs) > 1 else 'input'} {names} is 0 in every sample (all-zero "
                   f"inputs?): the ranges come from the biases alone and will not fit real inputs; calibrate on "
                   f"representative data")
    return out + [_no_range_warning(ms) for ms in no_range] + list(getattr(data, "notes", ()))


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
            values = ir.constant_value(tensors[wq.tensor])
            _check_weight(wq, values)
            wq.qparams = weight_qparams(values, wq.spec, wq.axis)
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
        no_range = []
        choices = {}  # tensor -> what its observer chose (observers with a `details`)
        for root, ms in groups.items():
            merged = observers[ms[0]]
            for m in ms[1:]:
                merged.merge(observers[m])
            lo, hi = merged.range()
            if getattr(merged, "details", None):
                choices.update((m, merged.details) for m in ms)
            if not (np.isfinite(lo) and np.isfinite(hi)):
                raise OqError(f"tensor '{ms[0]}' produced NaN or inf during calibration")
            if _no_range(lo, hi):
                no_range.append(ms)
            for m in ms:
                if m in plan.activations:
                    qp = qparams_from_range(lo, hi, plan.activations[m].spec)
                    plan.activations[m].qparams = _finer_power_of_two(qp, merged)
        if choices:
            stats["choices"] = choices
        where = getattr(self.data, "where", None)
        source = f"calibration data {where}" if where else "calibration data"
        if len(no_range) * 2 > len(groups):
            names = ", ".join(f"'{ms[0]}'" for ms in no_range[:5]) + (", ..." if len(no_range) > 5 else "")
            raise OqError(f"{source} gives no range for {len(no_range)} of {len(groups)} activations (all-zero "
                          f"inputs?): every observed value of {names} is 0; calibrate on representative data")
        if ctx.report is not None:
            ctx.report.calibration = stats
            for warning in _data_warnings(self.data, source, no_range):
                if warning not in ctx.report.warnings:
                    ctx.report.warnings.append(warning)
        notes = [f"{stats['samples']} samples, {stats['tensors']} tensors, {stats['seconds']:.2f}s"]
        return PassResult(False, notes + ([_choices_note(choices)] if choices else []))
