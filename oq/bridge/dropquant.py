"""Per-tensor activation fake quantization for reconstruction, fused with QDrop's random dropping.

oq.bridge.fakequant is the general, layout-aware fake quantization (per channel, per block, LSQ+ ...) whose backward
recomputes the forward; block reconstruction spends most of its time in activation quantizers on large feature maps
(an EfficientNet block at 112x112 holds ~10 M values per step), where that generality costs about two dozen full
passes over the tensor per step. This one covers the common case, one scale and zero-point per tensor, in about ten:
the forward saves what the backward needs (which values pass a gradient, and dy/dscale), and the dropped values are
folded in there rather than by a separate torch.where in autograd.

The forward is the same QuantizeLinear -> DequantizeLinear as fakequant (x / scale in float32, round half to even,
clamp to the grid), written as clamp(round(x / s), qmin - z, qmax - z) * s, which is equal for integer z. The
scale parameter p is the scale itself ("fixed": no gradient), its natural log ("log", LSQ in the log domain) or its
log2 with a straight-through ceil ("log2", power-of-two grids, TQT). Gradients as fakequant documents them:
dy/dx = 1 inside the grid (and where dropped) and 0 where saturated; dy/ds = round(v) - v inside, the clamp bound
outside, 0 where dropped; then ds/dp = s (log) or s ln 2 (log2).
"""
from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)
KINDS = ("fixed", "log", "log2")
_SHIFTS = torch.arange(8, dtype=torch.uint8)


def scale_of(p: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "log":
        return torch.exp(p)
    if kind == "log2":
        return torch.exp2(torch.ceil(p))
    return p


class DropQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, kind: str, lo: float, hi: float, dropped):
        s = scale_of(p.detach(), kind).to(x.dtype)
        v = x / s
        r = torch.round(v)
        q = torch.clamp(r, lo, hi)
        inside = r == q
        y = q * s
        if not ctx.needs_input_grad[1]:
            d = None
        else:  # dy/ds: q - v inside (q == round(v)), the clamp bound q outside; y is taken, so in place
            d = q.sub_(v.mul_(inside))
        if dropped is not None:
            y = torch.where(dropped, x, y)
            inside |= dropped
            if d is not None:
                d.masked_fill_(dropped, 0.0)
        ctx.kind = kind
        ctx.save_for_backward(inside, d, s)
        return y

    @staticmethod
    def backward(ctx, grad):
        passing, d, s = ctx.saved_tensors
        gx = grad * passing if ctx.needs_input_grad[0] else None
        gp = None
        if ctx.needs_input_grad[1]:
            gs = torch.sum(grad * d)
            gp = gs * s if ctx.kind == "log" else gs * s * LN2 if ctx.kind == "log2" else gs
            gp = gp.reshape(())
        return gx, gp, None, None, None, None


def drop_quantize(x: torch.Tensor, p: torch.Tensor, kind: str, lo: float, hi: float,
                  dropped: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize x on the integer grid [lo, hi] (qmin - z, qmax - z) with the one scale p stands for (`kind`);
    where `dropped` is True, x passes unquantized."""
    if kind not in KINDS:
        raise ValueError(f"unknown scale kind {kind!r}; choose from {', '.join(KINDS)}")
    return DropQuant.apply(x, p.reshape(()), kind, float(lo), float(hi), dropped)


def coin(shape, p: float, gen: torch.Generator, device=None) -> torch.Tensor:
    """A bool tensor, each value True with probability p. For p = 0.5 (QDrop's) the bits of random 64-bit integers
    are unpacked, about ten times faster on CPU than comparing torch.rand against p."""
    shape = tuple(shape)
    if p != 0.5:
        return (torch.rand(shape, generator=gen, device=gen.device) < p).to(device)
    n = math.prod(shape)
    words = torch.randint(-2**63, 2**63 - 1, (-(-n // 64),), dtype=torch.int64, generator=gen, device=gen.device)
    shifts = _SHIFTS.to(words.device)
    bits = (words.view(torch.uint8).unsqueeze(1) >> shifts) & 1
    return bits.view(-1)[:n].view(torch.bool).reshape(shape).to(device)
