"""The clipping range that minimises the expected quantization error, over the shared histogram."""
from __future__ import annotations

import numpy as np

from ..errors import OqError

from .histogram import HistogramObserver


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
