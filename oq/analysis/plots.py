"""The report's figures, drawn with matplotlib's Agg backend (no display) and returned as PNG bytes."""
from __future__ import annotations

import io
import math

import numpy as np

from ..errors import OqError
from .records import Analysis

MATPLOTLIB_HINT = "the HTML report needs matplotlib: pip install 'oq-quant[report]'"


def pyplot():
    """matplotlib.pyplot on the Agg backend, imported only for the HTML report."""
    try:
        import matplotlib
    except ImportError:
        raise OqError(MATPLOTLIB_HINT) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    fig.clf()
    return buf.getvalue()


def _short(name: str, width: int = 36) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3):]


def sqnr_along_graph(a: Analysis, plt) -> bytes:
    """Graphwise SQNR of every quantized tensor, in graph order; the worst labelled."""
    ordered = sorted(a.tensors, key=lambda t: t.order)
    finite = [t.sqnr_db if math.isfinite(t.sqnr_db) else np.nan for t in ordered]
    fig = plt.figure(figsize=(9, 3.6))
    ax = fig.add_subplot()
    ax.plot(range(len(ordered)), finite, marker="o", lw=1)
    for t in a.tensors[:3]:
        i = ordered.index(t)
        ax.annotate(_short(t.tensor, 28), (i, finite[i]), textcoords="offset points", xytext=(4, -12), fontsize=7)
    ax.axhline(a.output_sqnr_db, color="gray", ls="--", lw=0.8, label=f"model output {a.output_sqnr_db:.1f} dB")
    ax.set_xlabel("quantized tensor, in graph order")
    ax.set_ylabel("SQNR (dB)")
    ax.set_title("graphwise SQNR (whole model quantized)")
    ax.legend(fontsize=8)
    return _png(fig)


def histograms(a: Analysis, plt) -> bytes:
    """fp32 values of the worst tensors, with the representable range drawn."""
    shown = [t for t in a.tensors if t.tensor in a.histograms][:4]
    cols = 2 if len(shown) > 1 else 1
    rows = max(1, math.ceil(len(shown) / cols))
    fig = plt.figure(figsize=(4.6 * cols, 3.0 * rows))
    for k, t in enumerate(shown, 1):
        ax = fig.add_subplot(rows, cols, k)
        values = a.histograms[t.tensor]
        ax.hist(values, bins=80, log=True, color="tab:blue", alpha=0.8)
        for x in t.range:
            ax.axvline(x, color="tab:red", lw=1)
        ax.set_title(f"{_short(t.tensor)}\n{t.sqnr_db:.1f} dB, clipping {100 * t.clip_ratio:.2f} %", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle("fp32 values of the worst tensors (red: representable range)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return _png(fig)


def channel_ranges(a: Analysis, plt) -> bytes:
    """Per output channel weight min/max of the worst weighted nodes, with the grid's range."""
    shown = [n for n in a.nodes if n.channel_ranges][:4]
    cols = 2 if len(shown) > 1 else 1
    rows = max(1, math.ceil(len(shown) / cols))
    fig = plt.figure(figsize=(4.6 * cols, 3.0 * rows))
    for k, n in enumerate(shown, 1):
        r = n.channel_ranges
        ax = fig.add_subplot(rows, cols, k)
        x = np.arange(len(r["min"]))
        ax.fill_between(x, r["min"], r["max"], step="mid", alpha=0.5, label="weight min..max")
        for key in ("grid_min", "grid_max"):
            values = r[key]
            if len(values) == 1:
                ax.axhline(values[0], color="tab:red", lw=1)
            else:
                ax.step(x, values, where="mid", color="tab:red", lw=0.8)
        ax.set_title(f"{_short(n.name)} ({n.op})", fontsize=8)
        ax.set_xlabel("output channel", fontsize=7)
        ax.tick_params(labelsize=7)
    fig.suptitle("per-channel weight ranges of the worst weighted nodes (red: grid range)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return _png(fig)
