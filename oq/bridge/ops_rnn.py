"""LSTM, GRU and RNN as explicit time loops (ONNX gate orders: LSTM i,o,f,c; GRU z,r,h).

Input projections of all time steps are one matmul; the recurrence runs step by step, so autograd reaches W, R, B,
the peepholes and the initial states. sequence_lens is honoured: past its length a sequence keeps its state and its
Y rows are zero, as onnxruntime does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import NodeAttrs, arg, op

# activation name -> (function of x, alpha, beta; default alpha; default beta); None: takes no alpha / beta
_ACTIVATIONS = {
    "sigmoid": (lambda x, a, b: torch.sigmoid(x), None, None),
    "tanh": (lambda x, a, b: torch.tanh(x), None, None),
    "relu": (lambda x, a, b: torch.relu(x), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: F.leaky_relu(x, a), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: torch.where(x > a, x, torch.zeros_like(x)), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * torch.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: torch.clamp(a * x + b, 0.0, 1.0), 0.2, 0.5),
    "elu": (lambda x, a, b: F.elu(x, a), 1.0, None),
    "softsign": (lambda x, a, b: F.softsign(x), None, None),
    "softplus": (lambda x, a, b: F.softplus(x), None, None),
}
_DEFAULTS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _check(attrs: NodeAttrs) -> str | None:
    if attrs.get("direction", "forward") not in ("forward", "reverse", "bidirectional"):
        return f"direction={attrs['direction']!r} is not an ONNX value"
    if attrs.get("layout", 0) not in (0, 1):
        return f"layout={attrs['layout']} is not an ONNX value"
    for name in attrs.get("activations", []):
        if name.lower() not in _ACTIVATIONS:
            return f"activation {name!r} is not supported"
    return None


def _activations(attrs: NodeAttrs, directions: int) -> list[list]:
    """Per direction, the list of activation functions (alpha/beta bound)."""
    names = list(attrs.get("activations", [])) or _DEFAULTS[attrs.op_type] * directions
    alphas = list(attrs.get("activation_alpha", []))
    betas = list(attrs.get("activation_beta", []))
    bound = []
    for name in names:
        fn, alpha, beta = _ACTIVATIONS[name.lower()]
        if alpha is not None and alphas:
            alpha = alphas.pop(0)
        if beta is not None and betas:
            beta = betas.pop(0)
        bound.append(lambda x, fn=fn, a=alpha, b=beta: fn(x, a, b))
    per = len(_DEFAULTS[attrs.op_type])
    if len(bound) < per * directions:
        bound = bound[:per] * directions
    return [bound[d * per:(d + 1) * per] for d in range(directions)]


def _prepare(attrs: NodeAttrs, inputs: list):
    x, w, r = inputs[0], inputs[1], inputs[2]
    layout = attrs.get("layout", 0)
    if layout:
        x = x.transpose(0, 1)
    steps, batch = x.shape[0], x.shape[1]
    directions = w.shape[0]
    hidden = r.shape[-1]
    gates = _GATES[attrs.op_type]
    b = arg(inputs, 3)
    if b is None:
        b = torch.zeros((directions, 2 * gates * hidden), dtype=x.dtype, device=x.device)
    lens = arg(inputs, 4)
    mask = None
    if lens is not None:
        t = torch.arange(steps, device=x.device).reshape(steps, 1)
        mask = (t < lens.to(x.device).reshape(1, batch)).unsqueeze(-1)  # [T, B, 1]
    states = []
    for i in ((5, 6) if attrs.op_type == "LSTM" else (5,)):
        s = arg(inputs, i)
        if s is not None and layout:
            s = s.transpose(0, 1)
        states.append(s)
    return x, w, r, b, mask, states, (steps, batch, directions, hidden, layout)


def _finish(ys: list, finals: list[list], dims) -> tuple:
    steps, batch, directions, hidden, layout = dims
    y = torch.stack(ys, dim=1)  # [T, D, B, H]
    outs = [torch.stack([f[k] for f in finals], dim=0) for k in range(len(finals[0]))]  # [D, B, H] each
    if layout:
        y = y.permute(2, 0, 1, 3)
        outs = [o.transpose(0, 1) for o in outs]
    return (y, *outs)


def _order(steps: int, reverse: bool):
    return range(steps - 1, -1, -1) if reverse else range(steps)


def _run(attrs: NodeAttrs, inputs: list, cell) -> tuple:
    x, w, r, b, mask, states, dims = _prepare(attrs, inputs)
    steps, batch, directions, hidden, _ = dims
    acts = _activations(attrs, directions)
    direction = attrs.get("direction", "forward")
    clip = attrs.get("clip")
    ys, finals = [], []
    for d in range(directions):
        reverse = direction == "reverse" or (direction == "bidirectional" and d == 1)
        projected = torch.matmul(x, w[d].transpose(0, 1))  # [T, B, G*H]
        state = [s[d] if s is not None else torch.zeros((batch, hidden), dtype=x.dtype, device=x.device)
                 for s in states]
        out = [None] * steps
        for t in _order(steps, reverse):
            new = cell(projected[t], state, r[d], b[d], acts[d], d, clip)
            if mask is not None:
                new = [torch.where(mask[t], n, s) for n, s in zip(new, state)]
                out[t] = torch.where(mask[t], new[0], torch.zeros_like(new[0]))
            else:
                out[t] = new[0]
            state = new
        ys.append(torch.stack(out, dim=0))
        finals.append(state)
    return _finish(ys, finals, dims)


def _clip(v: torch.Tensor, clip) -> torch.Tensor:
    return v if clip is None else torch.clamp(v, -clip, clip)


@op("LSTM", check=_check)
def lstm(attrs: NodeAttrs, inputs: list):
    peephole = arg(inputs, 7)
    forget_from_input = bool(attrs.get("input_forget", 0))

    def cell(xw, state, r, b, acts, d, clip):
        f_act, g_act, h_act = acts
        h, c = state
        hidden = h.shape[-1]
        g = xw + torch.matmul(h, r.transpose(0, 1)) + b[:4 * hidden] + b[4 * hidden:]
        gi, go, gf, gc = g.split(hidden, dim=-1)
        if peephole is not None:
            pi, po, pf = peephole[d].split(hidden)
            gi, gf = gi + pi * c, gf + pf * c
        i = f_act(_clip(gi, clip))
        f = 1 - i if forget_from_input else f_act(_clip(gf, clip))
        c_new = f * c + i * g_act(_clip(gc, clip))
        if peephole is not None:
            go = go + po * c_new
        o = f_act(_clip(go, clip))
        return [o * h_act(c_new), c_new]

    y, y_h, y_c = _run(attrs, inputs, cell)
    return y, y_h, y_c


@op("GRU", check=_check)
def gru(attrs: NodeAttrs, inputs: list):
    before_reset = bool(attrs.get("linear_before_reset", 0))

    def cell(xw, state, r, b, acts, d, clip):
        f_act, g_act = acts
        (h,) = state
        hidden = h.shape[-1]
        wb, rb = b[:3 * hidden], b[3 * hidden:]
        xz, xr, xh = (xw + wb).split(hidden, dim=-1)
        rz, rr, rh = r.split(hidden, dim=0)
        rbz, rbr, rbh = rb.split(hidden)
        z = f_act(_clip(xz + torch.matmul(h, rz.transpose(0, 1)) + rbz, clip))
        reset = f_act(_clip(xr + torch.matmul(h, rr.transpose(0, 1)) + rbr, clip))
        if before_reset:
            hh = xh + reset * (torch.matmul(h, rh.transpose(0, 1)) + rbh)
        else:
            hh = xh + torch.matmul(reset * h, rh.transpose(0, 1)) + rbh
        hh = g_act(_clip(hh, clip))
        return [(1 - z) * hh + z * h]

    y, y_h = _run(attrs, inputs, cell)
    return y, y_h


@op("RNN", check=_check)
def rnn(attrs: NodeAttrs, inputs: list):
    def cell(xw, state, r, b, acts, d, clip):
        (h,) = state
        hidden = h.shape[-1]
        return [acts[0](_clip(xw + torch.matmul(h, r.transpose(0, 1)) + b[:hidden] + b[hidden:], clip))]

    y, y_h = _run(attrs, inputs, cell)
    return y, y_h
