"""The one error measure the range-choosing observers compare candidates with: the expected squared error of
quantize-dequantize of the observed histogram on the tensor's real grid (bits, symmetry, zero-point rules)."""
from __future__ import annotations

import numpy as np

from ..spec import QuantSpec, dequantize_array, qparams_from_range, quantize_array


def default_grid(bits: int, symmetric: bool | None, lo: float, levels: int | None = None) -> QuantSpec:
    """The grid an observer built without a spec assumes: signed symmetric when asked (or when the data goes
    negative and nothing was said, or when `levels` is half the codes), otherwise unsigned asymmetric."""
    if symmetric is None:
        symmetric = lo < 0 or (levels is not None and levels <= 2 ** (bits - 1))
    wide = "16" if bits > 8 else "8"
    if symmetric:
        return QuantSpec(f"int{wide}", symmetric=True, quant_min=-(2 ** (bits - 1)), quant_max=2 ** (bits - 1) - 1)
    return QuantSpec(f"uint{wide}", symmetric=False, quant_min=0, quant_max=2 ** bits - 1)


def range_error(observer, lo: float, hi: float, spec: QuantSpec) -> float:
    """Expected squared error (summed over the observed values, bin centres standing for their bins) of the grid
    that `spec` builds for [lo, hi]. Only for ranking candidate ranges of the same histogram; inf where the grid
    cannot hold the range at all (magnitudes beyond float32), which leaves the ranking to the tie-break."""
    with np.errstate(over="ignore", invalid="ignore"):
        err = _error(observer, lo, hi, spec)
    return err if np.isfinite(err) else np.inf


def _error(observer, lo: float, hi: float, spec: QuantSpec) -> float:
    qp = qparams_from_range(lo, hi, spec)
    if not spec.is_float:  # runtimes round activations half to even whatever the spec's offline rounding
        qmin, qmax = spec.qrange
        return observer.quantization_error(float(qp.scale), float(np.asarray(qp.zero_point, np.float64)), qmin,
                                           qmax)
    if observer.counts is None:
        return 0.0
    centres = (np.arange(-observer.half, observer.half) + 0.5) * observer.width
    counts = observer.counts.astype(np.float64)
    counts[observer.half] -= observer.exact_zeros  # exact zeros quantize exactly
    back = dequantize_array(quantize_array(centres, qp), qp).astype(np.float64)
    return float(np.dot(counts, (centres - back) ** 2))
