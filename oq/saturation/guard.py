"""The guard's per-channel decision: keep the plan's 8-bit weight scale or take a coarser one that saturates less,
whichever gives the smaller emulated layer error on calibration rows."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .check import _sqnr
from .layers import IntLayer, gemm_weights
from .pairs import SAFE_WEIGHT_QMAX, largest, pair_count, pair_excess

# Candidate largest weight magnitudes for a channel that saturates: its scale becomes max|w| / q. 64 is the floor
# where no pair can saturate whatever the activations (255 * (64 + 64) = 32640).
QMAX_LADDER = (120, 112, 104, 96, 88, 80, 72, SAFE_WEIGHT_QMAX)


@dataclass
class GuardDecision:
    reduced: np.ndarray  # bool [C]: channels that get a coarser scale
    scale: np.ndarray  # float32 [C]: the chosen scale (the plan's where not reduced)
    qmax: np.ndarray  # int [C]: largest |q| of the reduced channels (0 where not reduced)
    saturated_pairs: int  # on the sampled rows, with the plan's 8-bit weights
    total_pairs: int
    channels_saturating: int
    sqnr8_db: float  # emulated layer output with the plan's 8-bit weights (saturating) vs float weights
    sqnr_guarded_db: float  # with the chosen scales
    sqnr8_exact_db: float  # the plan's 8-bit weights on a CPU that does not saturate (VNNI)


def guard_decision(layer: IntLayer, w_float: np.ndarray, a: np.ndarray, per_channel: bool = True,
                   ladder=QMAX_LADDER) -> GuardDecision:
    """Choose, per output channel, between the plan's 8-bit scale and coarser scales max|w|/q (q in `ladder`, down
    to 64 where no pair can saturate) the one whose emulated layer output (pair saturation included) has the smallest
    squared error on the sampled GEMM rows a [G, R, K], against the layer computed with float weights on the same
    quantized activations. Only channels that saturate on the rows are candidates. With per-tensor weight scales
    one q is chosen for the whole layer (smallest total error)."""
    wf = gemm_weights(layer.op, np.asarray(w_float, np.float64), layer.attrs)  # [G, K, Ng]
    amax_w = np.abs(wf).max(axis=1).reshape(-1)  # [C]
    if not per_channel:
        amax_w = np.full_like(amax_w, amax_w.max(initial=0))
    xs = float(layer.x_scale)
    ng = wf.shape[2]
    # errors are computed directly as activations @ (integer weight - float weight / scale), in float32: no
    # cancellation between two large accumulators, and BLAS speed
    ac = [a[g].astype(np.float32) - np.float32(layer.x_zp) for g in range(layer.groups)]
    amax_a = largest(a)
    s8 = layer.w_scale.astype(np.float64)
    sig = float(sum(((xs * (ac[g] @ wf[g].astype(np.float32))).astype(np.float64) ** 2).sum()
                    for g in range(layer.groups)))

    def rounding_err(g, wq, w_over_s):  # [R, cols] accumulator units
        return (ac[g] @ (wq.astype(np.float64) - w_over_s).astype(np.float32)).astype(np.float64)

    err8 = np.concatenate([rounding_err(g, layer.wg[g], wf[g] / s8[g * ng:(g + 1) * ng])
                           for g in range(layer.groups)], axis=1)
    excess, count = layer.excess(a)
    e8x = ((err8 * (s8 * xs)) ** 2).sum(axis=0)
    e8 = (((err8 + excess) * (s8 * xs)) ** 2).sum(axis=0)
    del err8
    saturating = (excess != 0).any(axis=0)
    best_e, best_s = e8.copy(), s8.copy()
    best_q = np.zeros(layer.channels, np.int64)
    # only the channels that saturate are re-emulated (all of them when one scale serves the whole layer)
    cols = np.arange(layer.channels) if not per_channel else np.nonzero(saturating)[0]
    for q in (ladder if saturating.any() else ()):
        s = np.where(amax_w > 0, amax_w / q, s8)
        e = np.full(layer.channels, np.inf)
        for g in np.unique(cols // ng):
            c = cols[cols // ng == g]
            w_over_s = wf[g][:, c - g * ng] / s[c]
            wq = np.clip(np.rint(w_over_s), -q, q).astype(np.int8)
            err = rounding_err(g, wq, w_over_s) + pair_excess(a[g], wq, amax_a)[0]
            e[c] = ((err * (s[c] * xs)) ** 2).sum(axis=0)
        if per_channel:
            better = saturating & (e < best_e)
        else:
            better = np.full(layer.channels, bool(e.sum() < best_e.sum()))
        best_e, best_s, best_q = np.where(better, e, best_e), np.where(better, s, best_s), np.where(better, q, best_q)
    reduced = best_q > 0
    return GuardDecision(reduced, best_s.astype(np.float32), best_q, count,
                         pair_count(a.shape[1], layer.k, layer.channels), int(saturating.sum()),
                         _sqnr(sig, float(e8.sum())), _sqnr(sig, float(best_e.sum())), _sqnr(sig, float(e8x.sum())))

