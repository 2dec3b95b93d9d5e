"""The plain-text summary `oq analyze` prints."""
from __future__ import annotations

import math

from .records import Analysis


def db(value: float | None) -> str:
    if value is None:
        return "-"
    return "exact" if math.isinf(value) and value > 0 else f"{value:.2f}"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3):]


def summary(a: Analysis, top: int = 20) -> str:
    lines = [f"oq analyze: {a.model} -> target {a.target}, {a.samples} samples ({a.measured_on}), "
             f"calibration {a.calib_method}",
             f"model output SQNR {db(a.output_sqnr_db)} dB, cosine {a.output_cosine:.5f} (whole model quantized vs "
             f"fp32)"]
    if len(a.outputs) > 1:
        lines += [f"  output {name}: {db(o['sqnr_db'])} dB" for name, o in a.outputs.items()]
    lines.append("")
    nodes = a.nodes[:top]
    if a.layerwise:
        lines.append(f"worst nodes ({len(nodes)} of {len(a.nodes)}; layerwise = output SQNR with only this node "
                     f"quantized):")
    else:
        lines.append(f"worst nodes ({len(nodes)} of {len(a.nodes)}; ranked by input SQNR, layerwise skipped):")
    width = min(40, max([4] + [len(n.name) for n in nodes]))
    lines.append(f"  {'#':>3}  {'node':<{width}}  {'op':<10} {'layerwise':>9} {'share %':>7} {'input':>7} "
                 f"{'weight':>7} {'clip %':>6}  hint")
    for rank, n in enumerate(nodes, 1):
        share = "-" if n.noise_share is None else f"{100 * n.noise_share:.1f}"
        lines.append(f"  {rank:>3}  {_cut(n.name, width):<{width}}  {n.op:<10} {db(n.layerwise_sqnr_db):>9} "
                     f"{share:>7} {db(n.input_sqnr_db):>7} {db(n.weight_sqnr_db):>7} {100 * n.clip_ratio:>6.2f}  "
                     f"{n.hint}")
    if a.tensors:
        t = a.tensors[0]
        lines += ["", f"worst tensor (whole model quantized): {t.tensor} ({t.producer_op or 'input'}), "
                      f"{db(t.sqnr_db)} dB, clipping {100 * t.clip_ratio:.2f} %"]
    lines += [f"warning: {w}" for w in a.warnings]
    return "\n".join(lines)
