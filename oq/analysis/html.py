"""The HTML report: one self-contained file (tables, and figures as base64 PNG) that opens offline."""
from __future__ import annotations

import base64
import html

from .plots import channel_ranges, histograms, pyplot, sqnr_along_graph
from .records import Analysis
from .text import db

STYLE = """body{font-family:sans-serif;margin:1.5em;max-width:1200px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}td.n{text-align:right}h2{margin-top:1.6em}
.w{color:#a40}"""


def _img(png: bytes, alt: str) -> str:
    return f'<img src="data:image/png;base64,{base64.b64encode(png).decode()}" alt="{html.escape(alt)}">'


def _table(header: list[str], rows: list[list], numeric: set[int]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td{" class=n" if i in numeric else ""}>{html.escape(str(c))}</td>'
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render(a: Analysis) -> str:
    plt = pyplot()
    e = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>oq analyze: {e(a.model)}</title>"
             f"<style>{STYLE}</style></head><body>",
             f"<h1>oq analyze: {e(a.model)}</h1>",
             f"<p>target <b>{e(a.target)}</b>, calibration {e(a.calib_method)}, {a.samples} samples "
             f"({e(a.measured_on)}).</p>",
             f"<p>Model output SQNR (whole model quantized vs fp32): <b>{db(a.output_sqnr_db)} dB</b>, cosine "
             f"{a.output_cosine:.5f}.</p>"]
    if len(a.outputs) > 1:
        parts.append(_table(["output", "SQNR dB", "cosine"],
                            [[k, db(o["sqnr_db"]), f"{o['cosine']:.5f}"] for k, o in a.outputs.items()], {1, 2}))
    parts += [f"<p class=w>warning: {e(w)}</p>" for w in a.warnings]
    parts.append("<h2>Nodes</h2><p>layerwise: model output SQNR with only this node's inputs and weight quantized; "
                 "input: worst SQNR of its quantized inputs with the whole model quantized; weight: float weight vs "
                 "its grid; clip: share of input values outside the grid's range.</p>")
    parts.append(_table(["#", "node", "op", "layerwise dB", "share %", "input dB", "weight dB", "clip %", "hint"],
                        [[k, n.name, n.op, db(n.layerwise_sqnr_db),
                          "-" if n.noise_share is None else f"{100 * n.noise_share:.1f}", db(n.input_sqnr_db),
                          db(n.weight_sqnr_db), f"{100 * n.clip_ratio:.2f}", n.hint]
                         for k, n in enumerate(a.nodes, 1)], {0, 3, 4, 5, 6, 7}))
    parts.append("<h2>Tensors</h2><p>SQNR and cosine of the tensor as the next layer sees it (whole model "
                 "quantized) against fp32; range: what the grid represents; fp32 range: the values seen.</p>")
    parts.append(_table(
        ["#", "tensor", "producer", "consumers", "shape", "dtype", "scale", "zero point", "range", "fp32 range",
         "method", "SQNR dB", "cosine", "clip %"],
        [[k, t.tensor, t.producer_op or "input", ", ".join(t.consumers), t.shape, t.dtype,
          _few(t.scale), _few(t.zero_point), _pair(t.range), _pair(t.fp32_range), t.calib_method, db(t.sqnr_db),
          f"{t.cosine:.5f}", f"{100 * t.clip_ratio:.2f}"] for k, t in enumerate(a.tensors, 1)], {0, 11, 12, 13}))
    parts.append("<h2>Figures</h2>")
    parts.append(_img(sqnr_along_graph(a, plt), "graphwise SQNR along the graph"))
    parts.append(_img(histograms(a, plt), "fp32 value histograms of the worst tensors"))
    parts.append(_img(channel_ranges(a, plt), "per-channel weight ranges of the worst weighted nodes"))
    plt.close("all")
    parts.append("</body></html>")
    return "\n".join(parts)


def _few(values: list[float]) -> str:
    shown = ", ".join(f"{v:.4g}" for v in values[:4])
    return shown + (f", ... ({len(values)})" if len(values) > 4 else "")


def _pair(values: list[float]) -> str:
    return f"[{values[0]:.4g}, {values[1]:.4g}]"
