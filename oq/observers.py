"""Observers reduce streamed tensors into the statistics qparams are computed from.

Every observer is mergeable, so calibration can be split (over batches, processes, machines) and give the same
result as one pass. Register your own with `register_observer`; build one by name with `make_observer(name, **kw)`.

Built in:

- `minmax`     exact running min/max. Batching-invariant.
- `ema`        moving average of per-batch min/max (QAT-style). Depends on the batching by design.
- `percentile` lo/hi percentiles of the data, from the histogram. Batching-invariant.
- `entropy`    TensorRT-style KL-divergence threshold, from the histogram. Batching-invariant.
- `mse`        clipping range minimising the expected 8-bit quantization MSE, from the histogram. Batching-invariant.

The histogram observers share one core (`HistogramObserver`) whose grid is a pure function of the largest |x| seen:
bin width is a power of two, bins are anchored at 0, and the grid only ever grows by doubling the width, which merges
adjacent bins exactly. So the final counts are identical however the samples were batched, ordered or split, and
every quantity computed from them is too. Memory per observer is fixed (4 * bins int64 counts), whatever the data.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .errors import OqError


class Observer:
    """Base: `update` with each batch, `merge` with another observer of the same kind, `range` for the qparams."""

    name = "base"

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


class MinMaxObserver(Observer):
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

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x)
        ext = self._extent(x)
        if ext is None:
            return
        self.lo, self.hi = min(self.lo, ext[0]), max(self.hi, ext[1])
        self.count += x.size

    def merge(self, other: Observer) -> None:
        # Histogram observers track the exact min/max too, so they can be folded into a minmax one.
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


class EMAObserver(Observer):
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

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x)
        ext = self._extent(x)
        if ext is None:
            return
        if self.batches == 0:
            self.lo, self.hi = ext
        else:
            m = self.momentum
            self.lo = m * self.lo + (1.0 - m) * ext[0]
            self.hi = m * self.hi + (1.0 - m) * ext[1]
        self.batches += 1
        self.count += x.size

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

    def __init__(self, bins: int = 2048, sample_limit: int | None = 65536):
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

    def _amax(self) -> float:
        return max(-self.lo, self.hi) if self.count else 0.0

    # -- Observer -----------------------------------------------------------------------------------------------
    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x)
        ext = self._extent(x)
        if ext is None:
            return
        before = self.count
        self.lo, self.hi = min(self.lo, ext[0]), max(self.hi, ext[1])
        weight = 1
        if self.rows_are_samples and self.sample_limit and x.ndim >= 2 and x[0].size > self.sample_limit:
            weight = -(-x[0].size // self.sample_limit)
            x = x.reshape(x.shape[0], -1)[:, ::weight]
        self.count += weight * x.size
        self.exact_zeros += weight * (x.size - int(np.count_nonzero(x)))
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
        self.lo, self.hi = min(self.lo, other.lo), max(self.hi, other.hi)
        self.count += other.count
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


def _xlogx(v: np.ndarray) -> np.ndarray:
    out = np.zeros_like(v, dtype=np.float64)
    pos = v > 0
    out[pos] = v[pos] * np.log(v[pos])
    return out


def kl_threshold_bins(habs: np.ndarray, levels: int, eps: float = 1e-4) -> int:
    """TensorRT's entropy calibration on a histogram of |x|: the number of bins i to keep (threshold = i * width),
    the first of the candidates with the smallest divergence (see `kl_divergences`); 0 for an empty histogram."""
    cand, kl = kl_divergences(habs, levels, eps)
    return int(cand[int(np.argmin(kl))]) if cand.size else 0


def kl_divergences(habs: np.ndarray, levels: int, eps: float = 1e-4) -> tuple[np.ndarray, np.ndarray]:
    """(candidates, KL(P || Q) for each) of TensorRT's entropy calibration on a histogram of |x|.

    For every candidate i in [levels, n] (n = last non-empty bin + 1): P = habs[:i] with all counts beyond folded
    into bin i - 1; Q = habs[:i] merged into `levels` equal chunks (the last takes the remainder) and expanded back
    evenly over the chunk's bins where P is non-zero; the divergence of P and Q, both normalised. As in TensorRT /
    MXNet except for the smoothing: they add eps to every empty bin and take it from the others, which changes the
    divergence by O(eps); here eps (in count units) only stands in for Q where P > 0 and Q = 0 (the folded outliers
    landing in an empty last chunk), which is the case smoothing exists for. (onnxruntime's port also truncates Q to
    integers and leaves the remainder bins out of the expansion; neither is reproduced.)

    Vectorised over all candidates at once in O(candidates * levels) using prefix sums (the KL of a chunk with a
    constant Q needs only the chunk's sum of P, sum of P log P and number of non-empty bins).
    """
    habs = np.asarray(habs, dtype=np.float64)
    nonzero = np.flatnonzero(habs)
    if nonzero.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    n = int(nonzero[-1]) + 1
    h = habs[:n]
    m = max(1, min(int(levels), n))
    cum = np.concatenate(([0.0], np.cumsum(h)))  # exact: counts < 2**53
    cum_nz = np.concatenate(([0], np.cumsum(h > 0)))
    cum_plogp = np.concatenate(([0.0], np.cumsum(_xlogx(h))))
    total = cum[-1]
    cand = np.arange(m, n + 1)  # number of bins kept
    merged = cand // m
    edges = np.arange(m + 1)[None, :] * merged[:, None]  # (K, m + 1) chunk boundaries
    edges[:, -1] = cand
    quant = np.diff(cum[edges], axis=1)  # counts per chunk, outliers excluded (as the references do)
    norm = np.diff(cum_nz[edges], axis=1)  # non-empty bins of P per chunk
    tail = total - cum[cand]  # outliers folded into the last kept bin
    last = h[cand - 1]
    norm[:, -1] += (last == 0) & (tail > 0)
    p_chunk = quant.copy()
    p_chunk[:, -1] += tail
    with np.errstate(divide="ignore", invalid="ignore"):
        log_q = np.where(quant > 0, np.log(quant / np.maximum(norm, 1)), 0.0)
    p_log_q = (p_chunk * log_q).sum(axis=1)
    p_log_q += np.where((quant[:, -1] == 0) & (tail > 0), tail * math.log(eps), 0.0)
    p_log_p = cum_plogp[cand - 1] + _xlogx(last + tail)
    q_total = cum[cand]
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = (p_log_p - p_log_q) / total + np.log(q_total / total)
    return cand, np.where(q_total > 0, kl, np.inf)  # nothing kept: Q is empty


class EntropyObserver(HistogramObserver):
    """TensorRT-style entropy calibration: the |x| threshold t minimising KL(P || Q) between the clipped histogram and
    its `levels`-level quantized version. Use for int8 activations with long tails (the TensorRT default method).

    Returns (-t, t) clipped to the observed [min, max] (so (0, t) when no negative value was seen); t is at most
    max|x|, so a symmetric spec's max(|lo|, |hi|) is exactly t, and an asymmetric spec wastes no range on a side the
    data never reaches. Levels default to
    2**(bits - 1) = 128 for signed data (int8 symmetric, as TensorRT and onnxruntime) and 2**bits = 256 when the data
    is non-negative (a uint8 / asymmetric grid spends all 256 levels on [0, t]); pass levels=128 for non-negative
    tensors quantized to int8 symmetric (e.g. ReLU outputs on a TensorRT target) where only 128 levels cover [0, t].
    The histogram has between `bins` (2048, TensorRT's count) and 2 * bins bins over [0, max|x|], so the search
    resolution is never coarser than TensorRT's, whatever the range; candidates are every bin edge from `levels`
    up. Exact zeros are left out of the divergence: every grid represents them exactly, and as a spike in the first
    bin (half of a ReLU output) they would dominate the KL and pull the threshold down to ~1.5 sigma. The search
    over all candidates is vectorised (about 3-25 ms for 2048-4096 bins and 128-256 levels).
    """

    name = "entropy"

    def __init__(self, bits: int = 8, levels: int | None = None, bins: int = 2048):
        super().__init__(bins)
        bits = int(bits)
        if not 2 <= bits <= 16:
            raise OqError(f"entropy bits must be in [2, 16], got {bits}")
        if levels is not None and int(levels) < 2:
            raise OqError(f"entropy levels must be at least 2, got {levels}")
        self.bits, self.levels = bits, None if levels is None else int(levels)

    def threshold(self) -> float:
        unsigned = self.lo >= 0
        levels = self.levels or (2 ** self.bits if unsigned else 2 ** (self.bits - 1))
        habs = self.abs_histogram()
        habs[0] -= self.exact_zeros  # lossless on every grid; as a spike in bin 0 they would dominate the KL
        kept = kl_threshold_bins(habs, levels)
        return min(kept * self.width, self._amax())

    def range(self) -> tuple[float, float]:
        degenerate = self._degenerate()
        if degenerate:
            return degenerate
        t = self.threshold()
        return (0.0, t) if self.lo >= 0 else (max(-t, self.lo), min(t, self.hi))


class MSEObserver(HistogramObserver):
    """The clipping range minimising the expected quantization MSE (rounding inside + clipping outside) on a
    `bits`-bit grid, searched over `candidates` ranges scaled from max/50 to max. Use when accuracy depends on the
    bulk of the distribution and some clipping of the tails is acceptable (weights-like or Laplacian activations).

    symmetric=None decides from the data: no negative values -> ranges (0, t) on an unsigned grid of 2**bits - 1
    steps; otherwise (-t, t) on the signed symmetric grid (step t / (2**(bits-1) - 1)). symmetric=True always
    searches (-t, t); symmetric=False searches (a * min, a * max) with the zero-point of an unsigned asymmetric grid.
    A symmetric result is clipped to the observed [min, max] (0 kept inside), as for `entropy`: max(|lo|, |hi|) is
    still exactly t.
    The error of each bin is integrated exactly assuming its values spread uniformly over the bin (clipped to the
    observed min/max), so exact zeros and tiny-but-common values are not charged a full step's rounding error.
    """

    name = "mse"

    def __init__(self, bits: int = 8, symmetric: bool | None = None, candidates: int = 160, bins: int = 2048):
        super().__init__(bins)
        bits, candidates = int(bits), int(candidates)
        if not 2 <= bits <= 16:
            raise OqError(f"mse bits must be in [2, 16], got {bits}")
        if candidates < 2:
            raise OqError(f"mse candidates must be at least 2, got {candidates}")
        self.bits, self.symmetric, self.candidates = bits, symmetric, candidates

    def range(self) -> tuple[float, float]:
        degenerate = self._degenerate()
        if degenerate:
            return degenerate
        amax = self._amax()
        counts = self.counts.copy()
        counts[self.half] -= self.exact_zeros  # exact zeros quantize exactly on every candidate grid
        idx = np.flatnonzero(counts)
        weight = counts[idx].astype(np.float64)
        # bins in units of amax (keeps tiny and huge ranges in float64's comfortable zone), clipped to the data
        left = np.maximum((idx - self.half) * (self.width / amax), self.lo / amax)
        right = np.minimum((idx - self.half + 1) * (self.width / amax), self.hi / amax)
        right = np.maximum(right, left)
        scale = np.linspace(1.0 / 50.0, 1.0, self.candidates)[:, None]  # (K, 1)
        symmetric = self.symmetric if self.symmetric is not None else self.lo < 0
        if symmetric:
            qmax = 2 ** (self.bits - 1) - 1
            step = scale / qmax
            lo_q, hi_q = -(qmax + 1) * step, qmax * step
        else:
            lo0, hi0 = min(self.lo, 0.0) / amax, max(self.hi, 0.0) / amax
            qmax = 2 ** self.bits - 1
            step = scale * (hi0 - lo0) / qmax
            zp = np.clip(np.round(-scale * lo0 / step), 0, qmax)
            lo_q, hi_q = -zp * step, (qmax - zp) * step

        def antiderivative(x):  # of the squared error e(x) of quantizing x: rounding inside, clipping outside
            xc = np.clip(x, lo_q, hi_q)
            k = np.rint(xc / step)
            u = xc - k * step
            out = x - xc
            out *= out * out  # (x ** 3 is a slow generic pow in numpy)
            out += u * u * u
            out /= 3.0
            out += k * (step * step * step / 12.0)
            return out

        # sum_bins weight * (G(right) - G(left)) / span as one matrix product over the distinct bin edges
        span = right - left
        wide = span > 0
        edges, where = np.unique(np.concatenate([left[wide], right[wide]]), return_inverse=True)
        density = weight[wide] / span[wide]
        n_wide = int(wide.sum())
        coef = (np.bincount(where[n_wide:], density, edges.size) - np.bincount(where[:n_wide], density, edges.size))
        mse = antiderivative(edges[None, :]) @ coef
        if not wide.all():  # bins whose values are all one point (e.g. constant data, or max on a bin edge)
            x = left[~wide][None, :]
            xc = np.clip(x, lo_q, hi_q)
            mse += (np.square(xc - np.rint(xc / step) * step) + np.square(x - xc)) @ weight[~wide]
        best = float(scale[int(np.argmin(mse)), 0])
        if symmetric:
            t = best * amax
            return max(-t, min(self.lo, 0.0)), min(t, max(self.hi, 0.0))
        return best * min(self.lo, 0.0), best * max(self.hi, 0.0)


_REGISTRY: dict[str, Callable[..., Observer]] = {
    "minmax": MinMaxObserver,
    "ema": EMAObserver,
    "percentile": PercentileObserver,
    "entropy": EntropyObserver,
    "mse": MSEObserver,
}


def register_observer(name: str, factory: Callable[..., Observer]) -> None:
    """Make an observer available to targets and --calib-method under `name`; `factory(**kwargs)` builds one."""
    _REGISTRY[name] = factory


def observer_names() -> list[str]:
    return sorted(_REGISTRY)


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
