"""The arithmetic of VPMADDUBSW: u8 x s8 products summed in pairs with int16 saturation, emulated and bounded."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

INT16_MIN, INT16_MAX = -32768, 32767
# Symmetric 7-bit-ish weights that can never saturate a pair: 255 * (64 + 64) = 32640 <= 32767.
SAFE_WEIGHT_QMAX = 64


class PairSums(NamedTuple):
    saturated: np.ndarray  # int64 [M, N]: what the VPMADDUBSW kernel accumulates
    exact: np.ndarray  # int64 [M, N]: the true integer product
    saturated_pairs: int  # pairs (row, k pair, column) whose int16 sum saturated
    total_pairs: int


def pair_count(rows: int, k: int, columns: int) -> int:
    """Pairs (row, k pair, column) a [rows, K] x [K, columns] product sums, K zero-padded to even."""
    return rows * ((k + 1) // 2) * columns


def largest(a: np.ndarray) -> int:
    """The largest u8 value of `a`, 0 when it is empty."""
    return int(a.max()) if a.size else 0


def _exact_matmul(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    # float64 is exact here (|sums| < 2**53) and uses BLAS, unlike integer matmul
    return np.rint(a.astype(np.float64) @ w.astype(np.float64)).astype(np.int64)


def _split_pairs(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (k even, k odd) halves of a [.., K, N] weight, K zero-padded to even."""
    if w.shape[-2] % 2:
        pad = [(0, 0)] * w.ndim
        pad[-2] = (0, 1)
        w = np.pad(w, pad)
    w = w.astype(np.int32)
    return w[..., 0::2, :], w[..., 1::2, :]


def pair_excess(a: np.ndarray, w: np.ndarray, amax: int | None = None,
                chunk_elems: int = 1 << 22) -> tuple[np.ndarray, int]:
    """(saturated - exact) of `a @ w` for u8 a [M, K] and s8 w [K, N], and the number of saturated pairs.

    Vectorised over the pairs that can saturate at all: same sign and amax * (|w0| + |w1|) beyond the int16 limit,
    amax being the largest value of `a` (all others contribute exactly).
    """
    a = np.asarray(a)
    m, k = a.shape
    out = np.zeros((m, w.shape[1]), np.int64)
    if m == 0 or k == 0:
        return out, 0
    if amax is None:
        amax = int(a.max())
    w0, w1 = _split_pairs(np.asarray(w))
    same = (w0 * w1) > 0
    bound = amax * (np.abs(w0) + np.abs(w1))
    limit = np.where(w0 > 0, INT16_MAX, -INT16_MIN)
    jj, nn = np.nonzero(same & (bound > limit))
    if len(jj) == 0:
        return out, 0
    order = np.argsort(nn, kind="stable")
    jj, nn = jj[order], nn[order]
    cols, starts = np.unique(nn, return_index=True)
    if k % 2:
        a = np.pad(a, [(0, 0), (0, 1)])
    a0, a1 = a[:, 0::2], a[:, 1::2]
    wa, wb = w0[jj, nn], w1[jj, nn]
    count = 0
    step = max(1, chunk_elems // len(jj))
    for s in range(0, m, step):
        p = a0[s:s + step, jj].astype(np.int32) * wa + a1[s:s + step, jj].astype(np.int32) * wb
        e = np.clip(p, INT16_MIN, INT16_MAX) - p
        count += int(np.count_nonzero(e))
        out[s:s + step, cols] = np.add.reduceat(e.astype(np.int64), starts, axis=1)
    return out, count


def pair_sums(a_u8: np.ndarray, w_s8: np.ndarray) -> PairSums:
    """Emulate VPMADDUBSW + VPMADDWD + VPADDD for u8 a [M, K] and s8 w [K, N].

    Each pair of adjacent-K products (k, k+1), k even, is added in int16 with saturation to [-32768, 32767], then the
    pair sums are accumulated exactly in int32. K is zero-padded to even, as MLAS pads it to a multiple of 4.
    """
    a = np.asarray(a_u8)
    w = np.asarray(w_s8)
    if a.dtype != np.uint8 or w.dtype != np.int8:
        raise TypeError(f"pair_sums wants uint8 activations and int8 weights, got {a.dtype} and {w.dtype}")
    if a.ndim != 2 or w.ndim != 2 or a.shape[1] != w.shape[0]:
        raise ValueError(f"shapes {a.shape} x {w.shape} are not [M, K] x [K, N]")
    exact = _exact_matmul(a, w)
    excess, count = pair_excess(a, w)
    return PairSums(exact + excess, exact, count, pair_count(a.shape[0], a.shape[1], w.shape[1]))


def pair_bounds(wg: np.ndarray, amax: int = 255) -> np.ndarray:
    """Worst |pair sum| per output column for weights in GEMM form [G, K, N] (K in the kernel's order): the larger
    of amax*(max(w0,0)+max(w1,0)) and -amax*(min(w0,0)+min(w1,0)) over the pairs. Returns [G*N] (channel order)."""
    w0, w1 = _split_pairs(np.asarray(wg))
    pos = amax * (np.maximum(w0, 0) + np.maximum(w1, 0))
    neg = -amax * (np.minimum(w0, 0) + np.minimum(w1, 0))
    worst = np.maximum(pos.max(axis=1, initial=0), neg.max(axis=1, initial=0))  # [G, N]
    return worst.reshape(-1)


def order_free_bounds(w_rows: np.ndarray, amax: int = 255) -> np.ndarray:
    """Worst |pair sum| per channel for ANY pairing of its weights (w_rows [C, K]): amax times the sum of its two
    largest same-sign magnitudes. Conservative whatever order a kernel packs K in."""
    w = np.asarray(w_rows, np.int32)
    if w.shape[1] < 2:
        return np.abs(w).max(axis=1, initial=0) * amax
    pos = -np.sort(-np.maximum(w, 0), axis=1)[:, :2].sum(axis=1)
    neg = -np.sort(np.minimum(w, 0), axis=1)[:, :2].sum(axis=1)
    return amax * np.maximum(pos, neg)


def exceeds_int16(bound: np.ndarray) -> np.ndarray:
    # a positive sum saturates above 32767, a negative one below -32768; bounds are magnitudes, so use the
    # stricter positive limit (conservative by one unit for negative pairs)
    return np.asarray(bound) > INT16_MAX
