"""The observer interface and the two observers that track only a range: minmax and ema."""
from __future__ import annotations

import math

import numpy as np

from ..errors import OqError


class Observer:
    """Base: `update` with each batch, `merge` with another observer of the same kind, `range` for the qparams.

    `probe` says what calibration may compute inside onnxruntime instead of fetching whole tensors (oq.probes):
    "full" (the default, for any observer: `update` gets every value), "extent" (`update_extent` gets each batch's
    min and max) or "sample" (`update_sample` gets the exact extent plus a regular sub-grid of each sample).
    """

    name = "base"
    probe = "full"
    # what range() chose, for the report (e.g. "auto:mse", "entropy:mse"); None when there is no choice to tell
    details: str | None = None

    def update(self, x: np.ndarray) -> None:
        raise NotImplementedError

    def merge(self, other: "Observer") -> None:
        raise NotImplementedError

    def range(self) -> tuple[float, float]:
        raise NotImplementedError

    def state_bytes(self) -> int:
        """Rough size of the observer's state (arrays by their buffers, anything else 8 bytes)."""
        return sum(v.nbytes if isinstance(v, np.ndarray) else 8 for v in vars(self).values())

    def _extent(self, x: np.ndarray) -> tuple[float, float] | None:
        """(min, max) of a batch, or None when there is nothing to take from it: empty, or NaN/inf (which marks
        the observer `nonfinite`, so its range() turns NaN and calibration names the tensor)."""
        if x.size == 0:
            return None
        ext = _batch_extent(x)
        if ext is None:
            self.nonfinite = True
        return ext


def _batch_extent(x: np.ndarray) -> tuple[float, float] | None:
    """(min, max) of a non-empty batch as Python floats; None when it holds NaN or inf."""
    lo, hi = float(x.min()), float(x.max())  # NaN propagates through min/max
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    return lo, hi


class _ExtentObserver(Observer):
    """Observers that read only each batch's min and max: `update` reduces to `update_extent`."""

    probe = "extent"

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x)
        ext = self._extent(x)
        if ext is not None:
            self.update_extent(ext[0], ext[1], x.size)

    def update_extent(self, lo: float, hi: float, count: int) -> None:
        """A batch of `count` values whose min and max are lo and hi (finite)."""
        raise NotImplementedError


class MinMaxObserver(_ExtentObserver):
    """Running min and max: exact, order- and batching-independent. The default; use it unless outliers hurt.

    A batch holding NaN or inf makes `range()` return NaN, so calibration reports the tensor instead of silently
    producing a useless scale.
    """

    name = "minmax"

    def __init__(self):
        self.lo = np.inf
        self.hi = -np.inf
        self.count = 0
        self.nonfinite = False

    def update_extent(self, lo: float, hi: float, count: int) -> None:
        self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)
        self.count += count

    def merge(self, other: Observer) -> None:
        # Histogram observers track the exact min/max too, so they can be folded into a minmax one.
        from .histogram import HistogramObserver  # late: histogram observers build on this module

        if not isinstance(other, (MinMaxObserver, HistogramObserver)):
            raise OqError(f"cannot merge a {other.name!r} observer into a {self.name!r} one")
        self.lo, self.hi = min(self.lo, other.lo), max(self.hi, other.hi)
        self.count += other.count
        self.nonfinite = self.nonfinite or other.nonfinite

    def range(self) -> tuple[float, float]:
        if self.nonfinite:
            return math.nan, math.nan
        if self.count == 0:
            return 0.0, 0.0
        return self.lo, self.hi

    def state_bytes(self) -> int:
        return 32


class EMAObserver(_ExtentObserver):
    """Exponential moving average of each batch's min and max: new = momentum * old + (1 - momentum) * batch.

    The first batch initialises the averages. Softens the effect of a few outlier batches compared with minmax, as in
    quantization-aware training; the result depends on the batch size and order by design (use `percentile` for a
    batching-invariant outlier-robust range). `merge` takes the element-count-weighted average of the two observers.
    """

    name = "ema"

    def __init__(self, momentum: float = 0.9):
        momentum = float(momentum)
        if not 0.0 <= momentum < 1.0:
            raise OqError(f"ema momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.lo = 0.0
        self.hi = 0.0
        self.count = 0  # elements seen (the merge weight)
        self.batches = 0
        self.nonfinite = False

    def update_extent(self, lo: float, hi: float, count: int) -> None:
        if self.batches == 0:
            self.lo, self.hi = lo, hi
        else:
            m = self.momentum
            self.lo = m * self.lo + (1.0 - m) * lo
            self.hi = m * self.hi + (1.0 - m) * hi
        self.batches += 1
        self.count += count

    def merge(self, other: Observer) -> None:
        if not isinstance(other, EMAObserver):
            raise OqError(f"cannot merge a {other.name!r} observer into a {self.name!r} one")
        total = self.count + other.count
        if other.count:
            a, b = self.count / total, other.count / total
            self.lo = a * self.lo + b * other.lo
            self.hi = a * self.hi + b * other.hi
        self.count = total
        self.batches += other.batches
        self.nonfinite = self.nonfinite or other.nonfinite

    range = MinMaxObserver.range  # same reading of the tracked (lo, hi)

    def state_bytes(self) -> int:
        return 48


# Smallest bin width; only float64 data below ~2**-188 in magnitude reaches it (float32 never does).
