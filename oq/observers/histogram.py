"""The shared histogram core (exactly mergeable power-of-two grid) and the percentile observer."""
from __future__ import annotations

import math

import numpy as np

from ..errors import OqError

from .base import Observer

_MIN_WIDTH = 2.0 ** -200


class HistogramObserver(Observer):
    """Shared core of the histogram observers: counts on a grid that grows with the data, plus exact min/max.

    Grid: `4 * bins` bins of width w = 2**e, anchored at 0: bin k covers [(k - H) * w, (k - H + 1) * w) with
    H = 2 * bins. w is the smallest power of two with H * w > max|x| seen, so between `bins` and `2 * bins` bins lie
    between 0 and max|x| (the resolution is at least max|x| / bins, always relative to the ACTUAL range, never to a
    first batch's guess). When data exceeds the grid, w doubles (as often as needed) and each new bin is the exact sum
    of 2**s old ones, because all edges are multiples of w relative to 0: no smearing, no lost counts.

    Batching invariance: the final grid depends only on the overall max|x|; a value binned on a finer grid and then
    re-binned lands where it would have landed directly (floor(floor(x / w) / 2**s) == floor(x / (w * 2**s)), and
    x / w is exact in float64 for power-of-two w). So counts are identical for any batching, order or merge tree.

    Exact zeros are also counted apart (`exact_zeros`): they sit in the bin [0, w) but are a point mass at 0 that
    every quantization grid represents exactly (ReLU outputs, padding, dead channels), which the subclasses use.
    While only zeros have been seen there is no grid (a grid needs a non-zero extent), just the counts.
    Not registered itself: subclasses decide what `range()` reads from it.
    Subclasses merge with each other (e.g. an `entropy` observer can absorb a `percentile` one).
    """

    name = "histogram"
    probe = "sample"

    def __init__(self, bins: int = 2048, sample_limit: int | None = 8192):
        bins = int(bins)
        if bins < 16:
            raise OqError(f"histogram bins must be at least 16, got {bins}")
        self.bins = bins
        # Binning every value of a large activation costs far more than the inference that produced it. When the
        # caller says axis 0 holds samples (`rows_are_samples`), each sample's values are binned at a fixed stride
        # so that at most `sample_limit` per sample are counted, each counting `stride` times. The selection depends
        # only on the sample's own size, so results stay identical for any batching; min/max stay exact.
        self.sample_limit = sample_limit
        self.rows_are_samples = False
        self.half = 2 * bins  # H: index of the bin starting at 0
        self.counts: np.ndarray | None = None  # int64[2H], allocated at the first non-zero value
        self.width = 0.0
        self.exact_zeros = 0  # values == 0 seen (all of `count` while there is no grid)
        # binned values exactly at the running min / max (unweighted, out of `binned`): a point mass there is a
        # clamp (ReLU6, saturated pixels) that no threshold below it can represent (see EntropyObserver)
        self.at_lo = 0
        self.at_hi = 0
        self.binned = 0
        self.lo = np.inf
        self.hi = -np.inf
        self.count = 0
        self.nonfinite = False

    # -- grid ---------------------------------------------------------------------------------------------------
    def _width_for(self, amax: float) -> float:
        """Smallest power of two w with H * w > amax (a pure function of amax: the batching-invariance anchor)."""
        h = self.half
        w = math.ldexp(1.0, math.frexp(amax)[1] - math.frexp(h)[1])
        while h * w <= amax:
            w *= 2.0
        while w > _MIN_WIDTH and h * (w / 2.0) > amax:
            w /= 2.0
        return max(w, _MIN_WIDTH)

    def _rebin(self, counts: np.ndarray, old: float, new: float) -> np.ndarray:
        """Counts on the grid of width `old` moved onto the (coarser, aligned) grid of width `new`: exact."""
        if new == old:
            return counts.copy()
        shift = min(math.frexp(new / old)[1] - 1, 62)  # new / old == 2**shift exactly
        h = self.half
        target = (np.arange(-h, h, dtype=np.int64) >> shift) + h  # arithmetic shift == floor division
        out = np.zeros(2 * h, dtype=np.int64)
        np.add.at(out, target, counts)
        return out

    def _combine_extremes(self, lo: float, hi: float, at_lo, at_hi) -> None:
        """Fold in values whose min/max are lo/hi, with at_lo()/at_hi() of them exactly there (called only when
        needed): a new extreme replaces the count, an equal one adds to it, an inner one changes nothing. Runs
        before self.lo/self.hi take the new extremes."""
        if lo < self.lo:
            self.at_lo = at_lo()
        elif lo == self.lo:
            self.at_lo += at_lo()
        if hi > self.hi:
            self.at_hi = at_hi()
        elif hi == self.hi:
            self.at_hi += at_hi()

    def _amax(self) -> float:
        return max(-self.lo, self.hi) if self.count else 0.0

    # -- Observer -----------------------------------------------------------------------------------------------
    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x)
        ext = self._extent(x)
        if ext is None:
            return
        weight = 1
        if self.rows_are_samples and self.sample_limit and x.ndim >= 2 and x[0].size > self.sample_limit:
            weight = -(-x[0].size // self.sample_limit)
            x = x.reshape(x.shape[0], -1)[:, ::weight]
        self.update_sample(ext[0], ext[1], x, weight)

    def update_sample(self, lo: float, hi: float, values: np.ndarray, weight: int = 1) -> None:
        """A batch whose exact min and max are lo and hi (finite), represented by `values`, each standing for
        `weight` values of the batch (a regular sub-grid of every sample, so the selection never depends on how
        samples were batched)."""
        before = self.count
        x = values
        zeros = x.size - int(np.count_nonzero(x))

        def at(bound: float) -> int:
            return zeros if bound == 0.0 else int(np.count_nonzero(x == bound))

        self._combine_extremes(lo, hi, lambda: at(lo), lambda: at(hi))
        self.binned += x.size
        self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)
        self.count += weight * x.size
        self.exact_zeros += weight * zeros
        amax = self._amax()
        if amax == 0.0:
            return
        w = self._width_for(amax)
        if self.counts is None:
            self.counts = np.zeros(2 * self.half, dtype=np.int64)
            self.counts[self.half] += before  # all zeros so far
        elif w > self.width:
            self.counts = self._rebin(self.counts, self.width, w)
        self.width = w
        # x * (1 / w) is exact (w is a power of two and |x / w| < H), so the bin of a value never depends on the
        # batch it came in. float32 data stays in float32 (the bulk of calibration: about 2.5x faster); the scaling
        # could only lose exactness for subnormal inputs, which float32 activations do not carry in practice.
        flat = x.ravel()
        dtype = np.float32 if flat.dtype == np.float32 and w >= 2.0 ** -100 else np.float64
        scaled = np.multiply(flat, dtype(1.0 / w), dtype=dtype)
        np.floor(scaled, out=scaled)
        idx = scaled.astype(np.intp)
        idx += self.half
        counts = np.bincount(idx, minlength=2 * self.half)
        self.counts += counts if weight == 1 else weight * counts

    def merge(self, other: Observer) -> None:
        if not isinstance(other, HistogramObserver):
            raise OqError(f"cannot merge a {other.name!r} observer into a {self.name!r} one")
        if other.half != self.half:
            raise OqError(f"cannot merge histograms of {other.bins} and {self.bins} bins")
        self.nonfinite = self.nonfinite or other.nonfinite
        parts = [(obs.counts, obs.width, obs.count) for obs in (self, other)]
        self._combine_extremes(other.lo, other.hi, lambda: other.at_lo, lambda: other.at_hi)
        self.lo, self.hi = min(self.lo, other.lo), max(self.hi, other.hi)
        self.count += other.count
        self.binned += other.binned
        self.exact_zeros += other.exact_zeros
        amax = self._amax()
        if amax == 0.0:
            return
        w = self._width_for(amax)
        total = np.zeros(2 * self.half, dtype=np.int64)
        for counts, width, count in parts:
            if counts is not None:
                total += self._rebin(counts, width, w)
            else:
                total[self.half] += count  # all zeros
        self.counts, self.width = total, w

    def state_bytes(self) -> int:
        return (0 if self.counts is None else self.counts.nbytes) + 64  # at most 4 * bins * 8 + 64

    # -- helpers for subclasses -----------------------------------------------------------------------------------
    def _degenerate(self) -> tuple[float, float] | None:
        """The range when there is nothing to search: NaN data, no data, or all zeros."""
        if self.nonfinite:
            return math.nan, math.nan
        if self.count == 0:
            return 0.0, 0.0
        if self.counts is None:
            return self.lo, self.hi  # all zeros
        return None

    def quantization_error(self, scale: float, zero_point: float, qmin: float, qmax: float) -> float:
        """Expected squared error of quantizing the observed values on this grid, with each bin's values taken at
        the bin's centre (exact zeros at 0). For choosing between a few candidate grids, not for absolute numbers."""
        if self.counts is None:
            return 0.0
        centres = (np.arange(-self.half, self.half) + 0.5) * self.width
        counts = self.counts.astype(np.float64)
        counts[self.half] -= self.exact_zeros  # exact zeros quantize exactly
        q = np.clip(np.rint(centres / scale) + zero_point, qmin, qmax)
        return float(np.dot(counts, (centres - (q - zero_point) * scale) ** 2))

    def abs_histogram(self) -> np.ndarray:
        """Counts of |x| on [k * w, (k + 1) * w), k = 0 .. H - 1 (negative bins folded onto positive ones)."""
        h = self.half
        return self.counts[h:] + self.counts[:h][::-1]

    def range(self) -> tuple[float, float]:
        return self._degenerate() or (self.lo, self.hi)


class PercentileObserver(HistogramObserver):
    """Clip at percentiles: lo = the (100 - p)th percentile of x, hi = the pth, never beyond the observed min/max.

    Use when a few extreme values (outliers, rare spikes) would otherwise blow up the scale; p = 99.99 keeps all but
    1 in 10,000 values unclipped on each side. Computed from the histogram with linear interpolation inside the bin,
    with np.percentile's convention: within one bin width (max|x| / bins at worst) of np.percentile wherever the data
    is dense at that rank, and between the neighbouring order statistics (+- one bin) in sparse tails. For symmetric
    specs qparams_from_range then takes max(|lo|, |hi|).
    """

    name = "percentile"

    def __init__(self, percentile: float = 99.99, bins: int = 2048):
        super().__init__(bins)
        percentile = float(percentile)
        if not 50.0 <= percentile <= 100.0:
            raise OqError(f"percentile must be in [50, 100], got {percentile}")
        self.percentile = percentile

    def _quantile(self, q: float) -> float:
        """np.percentile's (linear) q-quantile, read off the histogram: order statistic q * (N - 1) (0-based), whose
        mass is centred at q * (N - 1) + 0.5 in the cumulative counts, with the mass spread uniformly in each bin."""
        if q <= 0.0:
            return self.lo
        if q >= 1.0:
            return self.hi
        total = int(self.counts.sum())
        rank = q * (total - 1) + 0.5
        cum = np.cumsum(self.counts)
        b = int(np.searchsorted(cum, rank, side="left"))
        before, inside = (int(cum[b - 1]) if b else 0), int(self.counts[b])
        if b == self.half:  # the bin [0, w): exact zeros first (a point mass at 0), the rest spread over the bin
            if rank - before <= self.exact_zeros:
                return min(max(0.0, self.lo), self.hi)
            before, inside = before + self.exact_zeros, inside - self.exact_zeros
        value = (b - self.half + (rank - before) / inside) * self.width
        return min(max(value, self.lo), self.hi)

    def range(self) -> tuple[float, float]:
        degenerate = self._degenerate()
        if degenerate:
            return degenerate
        p = self.percentile / 100.0
        return self._quantile(1.0 - p), self._quantile(p)
