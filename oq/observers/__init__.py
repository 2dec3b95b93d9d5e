"""Observers reduce streamed tensors into the statistics qparams are computed from.

Every observer is mergeable, so calibration can be split (over batches, processes, machines) and give the same
result as one pass. Register your own with `register_observer`; build one by name with `make_observer(name, **kw)`.

Built in:

- `minmax`     exact running min/max. Batching-invariant.
- `ema`        moving average of per-batch min/max (QAT-style). Depends on the batching by design.
- `percentile` lo/hi percentiles of the data, from the histogram. Batching-invariant.
- `entropy`    TensorRT-style KL-divergence threshold, from the histogram. Batching-invariant.
- `mse`        clipping range minimising the expected 8-bit quantization MSE, from the histogram. Batching-invariant.
- `auto`       per tensor, the minmax, percentile or MSE range with the least expected error on the tensor's grid
               (the winner in `details`). Batching-invariant.

The histogram observers share one core (`HistogramObserver`) whose grid is a pure function of the largest |x| seen:
bin width is a power of two, bins are anchored at 0, and the grid only ever grows by doubling the width, which merges
adjacent bins exactly. So the final counts are identical however the samples were batched, ordered or split, and
every quantity computed from them is too. Memory per observer is fixed (4 * bins int64 counts), whatever the data.
"""
from __future__ import annotations

import inspect
from typing import Callable

from ..errors import OqError
from .auto import AutoObserver
from .base import EMAObserver, MinMaxObserver, Observer
from .entropy import EntropyObserver, kl_divergences, kl_threshold_bins
from .grid import range_error
from .histogram import HistogramObserver, PercentileObserver
from .mse import MSEObserver

__all__ = ["Observer", "MinMaxObserver", "EMAObserver", "HistogramObserver", "PercentileObserver", "EntropyObserver",
           "MSEObserver", "AutoObserver", "range_error", "kl_divergences", "kl_threshold_bins", "register_observer",
           "observer_names", "make_observer", "observer_factory", "accepted_kwargs"]

_REGISTRY: dict[str, Callable[..., Observer]] = {
    "minmax": MinMaxObserver,
    "ema": EMAObserver,
    "percentile": PercentileObserver,
    "entropy": EntropyObserver,
    "mse": MSEObserver,
    "auto": AutoObserver,
}


def register_observer(name: str, factory: Callable[..., Observer]) -> None:
    """Make an observer available to targets and --calib-method under `name`; `factory(**kwargs)` builds one."""
    _REGISTRY[name] = factory


def observer_names() -> list[str]:
    return sorted(_REGISTRY)


def observer_factory(name: str) -> Callable[..., Observer]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise OqError(f"unknown calibration method {name!r}; available: {', '.join(observer_names())}") from None


def accepted_kwargs(factory: Callable, known: dict) -> dict:
    """The entries of `known` that `factory` takes as keywords (all of them if it takes **kwargs)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: give nothing
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(known)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in known.items() if k in names}


def make_observer(name: str, **kwargs) -> Observer:
    """A new observer registered under `name`, built with `kwargs`: make_observer('percentile', percentile=99.9)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise OqError(f"unknown calibration method {name!r}; available: {', '.join(observer_names())}") from None
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise OqError(f"bad options for calibration method {name!r}: {exc}") from None
