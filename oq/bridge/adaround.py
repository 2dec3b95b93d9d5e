"""AdaRound (Nagel et al. 2020, "Up or Down? Adaptive Rounding for Post-Training Quantization") for one layer.

A weight w on a grid with scale s, zero-point z and integer range [qmin, qmax] is rounded to
floor(w / s) + h, h in {0, 1}, instead of to the nearest grid point. AdaRound learns h per weight from the layer's
own inputs x: it relaxes h to the rectified sigmoid

    h(V) = clip(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)          zeta = 1.1, gamma = -0.1

and minimises, over V (one value per weight, initialised so that h(V) is the fractional part of w / s),

    mean over rows of sum over output channels (x W - x W~)^2  +  lambda * sum(1 - |2 h(V) - 1|^beta)
    W~ = s * (clip(floor(w / s) + h(V), qmin - z, qmax - z))

with Adam. The regulariser, off for the first `warmup` share of the iterations, then weighted by a beta annealed
linearly from 20 to 2, drives every h(V) to 0 or 1; the learned rounding is h = [V >= 0] (h(V) >= 1/2).

The layer is given in GEMM form (oq.gemm_rows): the weight's values are gathered into [G, K, N/G] by an index map
(one GEMM per group: a grouped or depthwise convolution is G GEMMs) and the inputs are rows [G, R, K] (im2col
patches of a convolution, rows of a MatMul/Gemm input), so the output error is x (W~ - W) and the target, the float
layer's output, never needs to be stored. Scale and zero-point come expanded to the weight's own shape, so
per-tensor, per-channel and per-block grids of any width are the same problem. Each Adam step takes `batch_rows`
rows, in a fresh random order every pass over the cached rows; the gradient is written out (Problem.gradient, checked
against autograd in the tests) since on small layers autograd's bookkeeping costs more than the arithmetic.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

ZETA, GAMMA = 1.1, -0.1
# The paper's schedule: 10k (up to 20k) Adam steps at lr 1e-3. Adam moves each V by at most about lr per step, so
# the learning rate is scaled to keep that total travel when fewer steps are taken: 1000 steps at 1e-2 reach the
# same held-out accuracy as 10000 at 1e-3 on the reference models, ten times faster (see passes/reconstruct.py).
PAPER_LR, PAPER_ITERS = 1e-3, 10000


@dataclass(frozen=True)
class Settings:
    """How one layer's rounding is learned."""

    iters: int = 1000
    lr: float | None = None  # None: PAPER_LR * PAPER_ITERS / iters (see effective_lr)
    reg: float = 0.01  # lambda, the weight of the rounding regulariser
    beta: tuple[float, float] = (20.0, 2.0)  # annealed from the first to the second after the warm-up
    warmup: float = 0.2  # share of the iterations without the regulariser
    batch_rows: int = 1024  # input rows per Adam step, drawn from the cached rows
    seed: int = 0
    device: str = "cpu"


@dataclass
class Layer:
    """One weight and the data it is learned from (numpy, in the weight's own layout unless said otherwise)."""

    w: np.ndarray  # the float weight
    scale: np.ndarray  # float32, broadcasting against w
    zero_point: np.ndarray  # broadcasting against w
    qmin: "int | np.ndarray"  # the codes allowed (zero-point included), broadcasting against w
    qmax: "int | np.ndarray"
    index: np.ndarray  # int64 [G, K, N/G]: flat indices of w, the GEMM form of the weight
    rows: np.ndarray  # float32 [G, R, K]: inputs of the GEMM(s)


@dataclass
class Outcome:
    codes: np.ndarray  # learned integer codes (zero-point included), int64, the weight's shape
    nearest: np.ndarray  # round-to-nearest codes, same layout
    mse_nearest: float  # reconstruction error of the layer output, mean over rows and output channels
    mse_learned: float
    changed: float  # share of the weights whose code differs from round-to-nearest


def rectified_sigmoid(v: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def initial_v(frac: np.ndarray) -> np.ndarray:
    """V with h(V) = frac (frac in [0, 1), so the sigmoid's argument stays inside (0, 1))."""
    p = (np.asarray(frac, np.float64) - GAMMA) / (ZETA - GAMMA)
    return np.log(p / (1.0 - p))


def effective_lr(s: Settings) -> float:
    return s.lr if s.lr is not None else PAPER_LR * PAPER_ITERS / max(s.iters, 1)


def beta_at(step: int, s: Settings) -> float | None:
    """The regulariser's beta at `step`, None during the warm-up."""
    start = s.warmup * s.iters
    if step < start:
        return None
    progress = (step - start) / max(s.iters - start, 1)
    return s.beta[1] + (s.beta[0] - s.beta[1]) * max(0.0, 1.0 - progress)


# Below this many multiply-adds per step a CPU step is dominated by per-op overheads, which extra threads only
# add to (measured on a busy 2-core machine: 40 ms per step with 2 threads, 3 ms with one, for a 3x3x64 -> 64
# convolution with 1024 rows); the thread count is restored afterwards.
SINGLE_THREAD_MACS = 1e8


@contextmanager
def _threads(n: int | None):
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def learn(layer: Layer, settings: Settings, nearest: np.ndarray) -> Outcome:
    """Learn the rounding of `layer`; `nearest` are its round-to-nearest codes (oq.spec.quantize_array's)."""
    g, k, n = layer.index.shape
    small = settings.device == "cpu" and min(settings.batch_rows, layer.rows.shape[1]) * g * k * n < SINGLE_THREAD_MACS
    with _threads(1 if small else None):
        return _learn(layer, settings, nearest)


class Problem:
    """One layer's rounding problem in GEMM form, as float32 tensors on the device: the float weight w, the scale s,
    floor(w / s), the grid's range [lo, hi] around the zero-point, the rows x, and V at its initial value."""

    def __init__(self, layer: Layer, device="cpu"):
        self.device = torch.device(device)
        self.shape, self.index = np.shape(layer.w), np.asarray(layer.index).reshape(-1)
        if not np.array_equal(np.sort(self.index), np.arange(np.prod(self.shape, dtype=np.int64))):
            raise ValueError("the GEMM index map must visit every weight once")
        self.gemm_shape = np.shape(layer.index)
        w = self.gemm_form(layer.w)
        s = self.gemm_form(np.asarray(layer.scale, np.float32))
        self.zp = self.gemm_form(layer.zero_point)
        ratio = w / s
        self.floor = np.floor(ratio)
        # the codes allowed, around the zero-point
        self.lo, self.hi = self.gemm_form(layer.qmin) - self.zp, self.gemm_form(layer.qmax) - self.zp
        t = self.tensor
        self.w, self.s, self.floor_t, self.lo_t, self.hi_t = t(w), t(s), t(self.floor), t(self.lo), t(self.hi)
        self.rows = t(layer.rows)  # [G, R, K]
        self.v0 = t(initial_v(ratio - self.floor))

    def tensor(self, a) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.float32, device=self.device)

    def gemm_form(self, a) -> np.ndarray:
        """`a` (broadcasting against the weight) as float64 [G, K, N/G]."""
        return np.broadcast_to(np.asarray(a, np.float64), self.shape).reshape(-1)[self.index].reshape(self.gemm_shape)

    def weight_form(self, a: np.ndarray) -> np.ndarray:
        """The inverse of gemm_form."""
        out = np.empty(self.index.size, np.asarray(a).dtype)
        out[self.index] = np.asarray(a).reshape(-1)
        return out.reshape(self.shape)

    def loss(self, v: torch.Tensor, x: torch.Tensor, reg: float, beta: float | None) -> torch.Tensor:
        """The objective on rows x [G, B, K], differentiable by autograd (the reference for `gradient`)."""
        h = rectified_sigmoid(v)
        delta = self.s * torch.clamp(self.floor_t + h, self.lo_t, self.hi_t) - self.w
        loss = torch.bmm(x, delta).pow(2).sum(dim=(0, 2)).mean()
        if beta is not None:
            loss = loss + reg * (1.0 - (2.0 * h - 1.0).abs().pow(beta)).sum()
        return loss

    def gradient(self, v: torch.Tensor, x: torch.Tensor, reg: float, beta: float | None) -> torch.Tensor:
        """d loss / d v, written out: two GEMMs on the rows and elementwise work on the weights, a few times fewer
        operations than autograd's graph (what a step on a small layer costs)."""
        u = torch.sigmoid(v)
        h_raw = u * (ZETA - GAMMA) + GAMMA
        h = h_raw.clamp(0.0, 1.0)
        q = self.floor_t + h
        delta = self.s * torch.minimum(torch.maximum(q, self.lo_t), self.hi_t) - self.w
        y = torch.bmm(x, delta)  # [G, B, N/G]: the layer output's error
        g = torch.bmm(x.transpose(1, 2), y).mul_(2.0 / x.shape[1])  # d loss / d delta
        g.mul_(self.s).mul_((q >= self.lo_t) & (q <= self.hi_t))  # d loss / d h
        if beta is not None:
            c = 2.0 * h - 1.0
            g.sub_(c.abs().pow(beta - 1.0).mul_(c.sign()).mul_(2.0 * beta * reg))
        return g.mul_(u * (1.0 - u) * (ZETA - GAMMA)).mul_((h_raw >= 0.0) & (h_raw <= 1.0))

    def codes(self, up: np.ndarray) -> np.ndarray:
        """Integer codes (zero-point included) in the weight's layout for rounding `up` (GEMM form, bool)."""
        return self.weight_form(np.rint(np.clip(self.floor + up, self.lo, self.hi) + self.zp).astype(np.int64))


def _learn(layer: Layer, settings: Settings, nearest: np.ndarray) -> Outcome:
    p = Problem(layer, settings.device)
    gen = torch.Generator(device="cpu").manual_seed(settings.seed)
    v = torch.nn.Parameter(p.v0.clone())
    opt = torch.optim.Adam([v], lr=effective_lr(settings))
    n_rows = p.rows.shape[1]
    batch = min(settings.batch_rows, n_rows)
    epoch, at = p.rows, n_rows  # the rows in this epoch's order, and the next row to take
    with torch.no_grad():
        for step in range(settings.iters):
            if at + batch > n_rows:  # a new epoch: the rows in a new random order
                epoch = torch.index_select(p.rows, 1, torch.randperm(n_rows, generator=gen).to(p.device))
                at = 0
            v.grad = p.gradient(v, epoch[:, at:at + batch], settings.reg, beta_at(step, settings))
            at += batch
            opt.step()
        up = (v >= 0).cpu().numpy()
    codes = p.codes(up)
    nearest = np.asarray(nearest).astype(np.int64)
    mse_n = reconstruction_mse(layer, nearest, p.device)
    mse_l = reconstruction_mse(layer, codes, p.device)
    return Outcome(codes, nearest, mse_n, mse_l, float(np.mean(codes != nearest)) if codes.size else 0.0)


def reconstruction_mse(layer: Layer, codes: np.ndarray, device="cpu", chunk: int = 8192) -> float:
    """Mean over rows and output channels of (x W - x W_q)^2, W_q = (codes - z) * s, on all of the layer's rows."""
    dev = torch.device(device)
    w = np.asarray(layer.w, np.float64)
    wq = (codes.astype(np.float64) - np.broadcast_to(np.asarray(layer.zero_point, np.float64), w.shape)) * \
        np.broadcast_to(np.asarray(layer.scale, np.float32).astype(np.float64), w.shape)
    index = torch.as_tensor(layer.index, dtype=torch.long, device=dev)
    diff = torch.as_tensor((w - wq).reshape(-1), dtype=torch.float64, device=dev)[index]
    rows = layer.rows
    total, count = 0.0, 0
    for start in range(0, rows.shape[1], chunk):
        x = torch.as_tensor(np.ascontiguousarray(rows[:, start:start + chunk]), dtype=torch.float64, device=dev)
        err = torch.bmm(x, diff)
        total += float(err.pow(2).sum())
        count += err.numel()
    return total / count if count else 0.0


__all__ = ["Settings", "Layer", "Outcome", "learn", "reconstruction_mse", "rectified_sigmoid", "initial_v",
           "beta_at", "ZETA", "GAMMA"]
