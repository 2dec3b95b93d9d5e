"""Per tensor, the best of the other observers' ranges, judged on the tensor's own grid."""
from __future__ import annotations

from ..errors import OqError
from ..spec import QuantSpec
from .grid import default_grid, range_error
from .histogram import HistogramObserver, PercentileObserver
from .mse import MSEObserver

PERCENTILES = (99.999, 99.99, 99.9)  # widest first: the tie-break order
TIE = 1e-3  # relative differences below this are bin-centre noise, not a better range
MARGIN = 1.0  # >1: take the widest candidate within this factor of the least error (see README)


class AutoObserver(HistogramObserver):
    """Keeps the shared histogram; at the end reads the minmax, percentile (`percentiles`) and MSE ranges off it and
    keeps the one whose quantize-dequantize of the histogram has the least expected squared error on the tensor's
    grid (`spec` when calibration passes it, else `bits` / `symmetric`). No single method wins everywhere: minmax on
    bounded data, a percentile or MSE under outliers; the choice is cheap once the histogram exists.

    Ties (within 0.1 %, or within `margin` times the least error when margin > 1) go to the earlier candidate
    (minmax, then the percentiles widest first, then MSE): the wider range is the safer bet on held-out data.
    `details` names the winner ("auto:minmax", "auto:percentile99.99", "auto:mse") and `errors` holds every
    candidate's error, for the report.
    """

    name = "auto"

    def __init__(self, bits: int = 8, symmetric: bool | None = None, spec: QuantSpec | None = None,
                 percentiles: tuple[float, ...] = PERCENTILES, margin: float = MARGIN, bins: int = 2048):
        super().__init__(bins)
        bits = int(bits)
        if not 2 <= bits <= 16:
            raise OqError(f"auto bits must be in [2, 16], got {bits}")
        self.bits, self.symmetric, self.spec = bits, symmetric, spec
        if not float(margin) >= 1.0:
            raise OqError(f"auto margin must be at least 1, got {margin}")
        self.percentiles = tuple(float(p) for p in percentiles)
        self.margin = float(margin)
        self.details: str | None = None
        self.errors: dict[str, float] = {}

    def grid(self) -> QuantSpec:
        return self.spec or default_grid(self.bits, self.symmetric, self.lo)

    def _read(self, observer: HistogramObserver) -> tuple[float, float]:
        """`observer`'s range on this histogram (histogram observers merge into each other exactly)."""
        observer.merge(self)
        return observer.range()

    def candidates(self) -> dict[str, tuple[float, float]]:
        """The ranges to choose from, in tie-break order."""
        out = {"minmax": (self.lo, self.hi)}
        for p in self.percentiles:
            out[f"percentile{p:g}"] = self._read(PercentileObserver(p, bins=self.bins))
        symmetric = self.spec.symmetric if self.spec is not None else self.symmetric
        out["mse"] = self._read(MSEObserver(self.bits, symmetric, bins=self.bins))
        return out

    def range(self) -> tuple[float, float]:
        degenerate = self._degenerate()
        if degenerate:
            self.details, self.errors = None, {}
            return degenerate
        grid = self.grid()
        ranges = self.candidates()
        self.errors = {name: range_error(self, lo, hi, grid) for name, (lo, hi) in ranges.items()}
        least = min(self.errors.values())
        best = next(name for name, err in self.errors.items() if err <= self.margin * least * (1 + TIE))
        self.details = f"auto:{best}"
        return ranges[best]
