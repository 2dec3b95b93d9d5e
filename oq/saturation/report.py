"""What `oq inspect --saturation` prints: per-layer tables of the analytic and emulated checks."""
from __future__ import annotations

import numpy as np
import onnx

from .check import AnalyticRow, LayerCheck, _sqnr, analyze_model, check_model_saturation, emulate
from .runtime import _feeds_iter, _session

_TITLE = "u8 x s8 pair saturation (VPMADDUBSW, x86 without VNNI)"


def _db(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.1f}"


def _short(name: str, width: int = 40) -> str:
    return (name if len(name) <= width else "..." + name[-(width - 3):]).ljust(width + 1)


def _lead(row: AnalyticRow | LayerCheck) -> str:
    """The columns both tables start with: layer, op, K, channels."""
    return f"  {_short(row.name)}{row.op:<7}{row.k:>6}{row.channels:>5}"


def _finish(lines: list[str], rows: list, skipped) -> str:
    """The table's end: the skipped layers, or a line saying there was nothing to check."""
    for name, op, why in skipped:
        lines.append(f"  {_short(name)}{op:<7} skipped: {why}")
    if not rows and not skipped:
        lines.append("  (no u8 x s8 Conv/MatMul/Gemm layers)")
    return "\n".join(lines)


def format_checks(checks: list[LayerCheck], skipped=()) -> str:
    lines = [f"{_TITLE}, emulated on the given inputs:",
             f"  {'layer':<41}{'op':<7}{'K':>6}{'ch':>5}{'rows':>7}{'amax':>5}{'sat. pairs':>12}"
             f"{'ch sat':>7}{'max rel err':>12}{'SQNR dB':>9}"]
    for c in checks:
        if c.note:
            lines.append(f"{_lead(c)}{c.rows:>7}{'':>5}  {c.note}")
            continue
        lines.append(f"{_lead(c)}{c.rows:>7}{c.amax:>5}"
                     f"{100 * c.saturated_fraction:>11.3f}%{c.channels_saturating:>7}{c.max_rel_err:>12.4f}"
                     f"{_db(c.sqnr_db):>9}")
    return _finish(lines, checks, skipped)


def format_analytic(rows: list[AnalyticRow], skipped=(), amax: int = 255) -> str:
    lines = [f"{_TITLE}, analytic worst case with activations at {amax}:",
             "  (pairs in onnxruntime's K order: Conv (kh, kw, c_in), MatMul/Gemm rows of B; 'any order' is the",
             "   bound for any pairing. Worst case only: give --calib to emulate on real activations)",
             f"  {'layer':<41}{'op':<7}{'K':>6}{'ch':>5}{'ch at risk':>11}{'any order':>10}{'worst/32767':>12}"]
    for r in rows:
        if r.note:
            lines.append(f"{_lead(r)}  {r.note}")
            continue
        lines.append(f"{_lead(r)}{r.at_risk:>11}{r.at_risk_any_order:>10}{r.worst:>12.2f}")
    return _finish(lines, rows, skipped)


def inspect_saturation(model: onnx.ModelProto, feeds=None, max_rows: int = 4096) -> str:
    """What `oq inspect --saturation` prints: with feeds (a feed dict or an iterable of them), the emulation on
    those inputs and the whole-model effect on the first feed; without, the analytic worst case."""
    if feeds is None:
        rows, skipped = analyze_model(model)
        return format_analytic(rows, skipped)
    feeds = list(_feeds_iter(feeds))
    checks, skipped = check_model_saturation(model, feeds, max_rows=max_rows)
    text = format_checks(checks, skipped)
    if feeds and any(not c.note for c in checks):
        exact = _session(model).run(None, feeds[0])
        emulated = emulate(model, feeds[0])
        sig = sum(float((np.asarray(e, np.float64) ** 2).sum()) for e in exact)
        noise = sum(float(((np.asarray(e, np.float64) - np.asarray(x, np.float64)) ** 2).sum())
                    for e, x in zip(exact, emulated))
        text += (f"\nwhole model on the first feed: outputs as an AVX2 CPU computes them vs exact integer kernels "
                 f"(VNNI/ARM): SQNR {_db(_sqnr(sig, noise))} dB")
    return text
