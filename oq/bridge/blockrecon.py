"""Block reconstruction (BRECQ, Li et al. 2021) with QDrop (Wei et al. 2022): the learning, in torch.

Every quantized weight of a block is rounded as AdaRound does (oq.bridge.adaround: a rectified sigmoid h(V) per
weight between floor and floor + 1, annealed to 0/1 by a regulariser), but all weights of the block learn
together, against the error of the block's output, so the layers compensate each other. Activation quantizers
inside the block learn their step size (LSQ, in the log domain so one learning rate fits every scale; power-of-two
grids in the log2 domain with a straight-through ceil, TQT's way); zero-points stay as calibration set them, and
a scale-sharing group (Concat inputs, ...) is one parameter.

QDrop: while learning, each activation value is quantized only with probability 1 - drop, and the block's input is,
element by element, the float model's or the quantized model's value with equal odds; BRECQ (drop = 0) always
quantizes and reads the quantized model's input. Both learn from calibration data alone (the output error in MSE;
BRECQ's Fisher weighting needs labels).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..spec import QParams
from .adaround import GAMMA, ZETA, beta_at, effective_lr, initial_v, rectified_sigmoid
from .dropquant import coin, drop_quantize
from .fakequant import FakeQuantParams, fake_quantize

_EPS = 1e-12


@dataclass
class WeightPoint:
    """A quantized weight: its float value and grid (scale and zero-point expanded to its shape), the codes it may
    take, and its round-to-nearest codes; `learn` says whether its rounding is learned or fixed at nearest."""

    w: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    qmin: np.ndarray
    qmax: np.ndarray
    nearest: np.ndarray
    learn: bool


@dataclass(frozen=True)
class Settings:
    iters: int = 500
    # rounding variables V (Adam); None: AdaRound's paper rate scaled to the step count, as oq.bridge.adaround
    # does (each V must travel about 2.4 to settle at 0 or 1, and Adam moves it about lr per step)
    lr: float | None = None
    scale_lr: float = 4e-3  # log-scales (Adam)
    reg: float = 0.01
    beta: tuple[float, float] = (20.0, 2.0)
    warmup: float = 0.2
    drop: float = 0.0  # QDrop's probability of leaving a value unquantized; 0 is BRECQ
    learn_scales: bool = True
    # samples per step, drawn from one cached chunk; None: the whole chunk. Small steps keep a CPU run within
    # minutes (the QDrop paper's 32 per step over 20k steps is GPU work).
    step_batch: int | None = 8
    seed: int = 0
    device: str = "cpu"


class Quantizers(nn.Module):
    """All weight and activation quantizers of a model, addressed by key, and how they currently act.

    mode: "float" (identity), "nearest" (round-to-nearest weights, calibrated scales), "soft" (the relaxed rounding
    being learned), "hard" (the learned rounding, h = [V >= 0]); `drop` applies in "soft" mode only."""

    def __init__(self, weights: dict[str, WeightPoint], acts: dict[str, QParams], learn_acts: set[str],
                 device="cpu"):
        super().__init__()
        self.mode, self.drop = "nearest", 0.0
        self.gen = torch.Generator(device=device)  # QDrop's draws, seeded per block by train_block
        self.learned_scales = True  # off: activations use their calibrated scales whatever was learned
        self.weight_keys = list(weights)
        self._w: dict[str, dict[str, torch.Tensor]] = {}
        self.v = nn.ParameterDict()
        t = lambda a: torch.as_tensor(np.ascontiguousarray(a, np.float32), device=device)  # noqa: E731
        for i, (key, p) in enumerate(weights.items()):
            w64 = np.asarray(p.w, np.float64)
            s = np.broadcast_to(np.asarray(p.scale, np.float32), w64.shape)
            z = np.broadcast_to(np.asarray(p.zero_point, np.float64), w64.shape)
            ratio = w64 / s
            floor = np.floor(ratio)
            self._w[key] = dict(s=t(s), floor=t(floor), lo=t(np.asarray(p.qmin) - z), hi=t(np.asarray(p.qmax) - z),
                                nearest=t((np.asarray(p.nearest, np.float64) - z) * s), z=z, floor_np=floor)
            if p.learn:
                self.v[f"w{i}"] = nn.Parameter(t(initial_v(ratio - floor)))
        self._v_name = {key: f"w{i}" for i, key in enumerate(weights) if weights[key].learn}
        self._a: dict[str, tuple[FakeQuantParams, str, str]] = {}
        self._grid: dict[str, tuple[float, float]] = {}
        self.scale_params = nn.ParameterDict()
        for i, (key, qp) in enumerate(acts.items()):
            fq = FakeQuantParams.from_qparams(qp, device=device)
            method = "pot" if qp.spec.power_of_two else "lsq"
            if key in learn_acts:
                start = fq.log2_scale if method == "pot" else torch.log(fq.scale.clamp_min(_EPS))
                self.scale_params[f"a{i}"] = nn.Parameter(start.clone())
            self._a[key] = (fq, method, f"a{i}")
            if fq.axis is None and fq.scale.numel() == 1:  # per tensor: the fused path (oq.bridge.dropquant)
                z = float(torch.round(fq.zero_point.reshape(())))
                self._grid[key] = (fq.qmin - z, fq.qmax - z)

    # --- the two ops the block models call ------------------------------------------------------------------
    def weight(self, key: str, w: torch.Tensor) -> torch.Tensor:
        if self.mode == "float" or key not in self._w:
            return w
        p = self._w[key]
        name = self._v_name.get(key)
        if self.mode == "nearest" or name is None:
            return p["nearest"].to(w.dtype)
        v = self.v[name]
        h = rectified_sigmoid(v) if self.mode == "soft" else (v >= 0).to(v.dtype)
        return (p["s"] * torch.clamp(p["floor"] + h, p["lo"], p["hi"])).to(w.dtype)

    def act(self, key: str, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "float" or key not in self._a or not torch.is_floating_point(x):
            return x
        fq, method, name = self._a[key]
        learned = self.mode != "nearest" and self.learned_scales and name in self.scale_params
        if key in self._grid:
            dropped = coin(x.shape, self.drop, self.gen, x.device) if self.mode == "soft" and self.drop > 0 else None
            if not learned:
                p, kind = fq.scale, "fixed"
            else:
                p, kind = self.scale_params[name], ("log2" if method == "pot" else "log")
            return drop_quantize(x, p, kind, *self._grid[key], dropped)
        if not learned:
            y = fake_quantize(x, fq.scale, fq.zero_point, fq.qmin, fq.qmax, fq.axis, fq.block_size, "ste")
        elif method == "pot":
            y = fake_quantize(x, self.scale_params[name], fq.zero_point, fq.qmin, fq.qmax, fq.axis, fq.block_size,
                              "pot")
        else:
            y = fake_quantize(x, torch.exp(self.scale_params[name]), fq.zero_point, fq.qmin, fq.qmax, fq.axis,
                              fq.block_size, "lsq", grad_scale=1.0)
        if self.mode == "soft" and self.drop > 0:
            keep = coin(x.shape, self.drop, self.gen, x.device)
            y = torch.where(keep, x, y)
        return y

    def ops(self) -> dict:
        from .blockgraph import DOMAIN
        return {(DOMAIN, "WeightQuant"): lambda attrs, inputs: self.weight(attrs["key"], inputs[0]),
                (DOMAIN, "ActQuant"): lambda attrs, inputs: self.act(attrs["key"], inputs[0])}

    # --- learning -------------------------------------------------------------------------------------------
    def parameters_of(self, weight_keys, act_keys) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        v = [self.v[self._v_name[k]] for k in weight_keys if k in self._v_name]
        s = [self.scale_params[self._a[k][2]] for k in act_keys if k in self._a and self._a[k][2] in self.scale_params]
        return v, s

    def regulariser(self, weight_keys, beta: float) -> torch.Tensor:
        total = 0.0
        for key in weight_keys:
            if key in self._v_name:
                h = rectified_sigmoid(self.v[self._v_name[key]])
                total = total + (1.0 - (2.0 * h - 1.0).abs().pow(beta)).sum()
        return total

    def forget(self, weight_keys, act_keys) -> None:
        """Put these quantizers back to round-to-nearest and their calibrated scales, for good."""
        for key in weight_keys:
            self._v_name.pop(key, None)
        for key in act_keys:
            if key in self._a and self._a[key][2] in self.scale_params:
                del self.scale_params[self._a[key][2]]

    def snapshot(self, weight_keys, act_keys) -> dict:
        v, s = self.parameters_of(weight_keys, act_keys)
        return {id(p): p.detach().clone() for p in v + s}

    def restore(self, weight_keys, act_keys, saved: dict) -> None:
        v, s = self.parameters_of(weight_keys, act_keys)
        with torch.no_grad():
            for p in v + s:
                p.copy_(saved[id(p)])

    # --- results --------------------------------------------------------------------------------------------
    def codes(self, key: str) -> np.ndarray | None:
        """The learned integer codes (zero-point included) of weight `key`, None if its rounding is not learned."""
        name = self._v_name.get(key)
        if name is None:
            return None
        p = self._w[key]
        up = (self.v[name] >= 0).detach().cpu().numpy()
        lo, hi = p["lo"].cpu().numpy(), p["hi"].cpu().numpy()
        return np.rint(np.clip(p["floor_np"] + up, lo, hi) + p["z"]).astype(np.int64)

    def qparams(self, key: str) -> QParams | None:
        """The learned QParams of activation quantizer `key`, None if its scale is not learned."""
        fq, method, name = self._a[key]
        if name not in self.scale_params:
            return None
        value = self.scale_params[name].detach()
        if method == "pot":
            fq.log2_scale = value.clone()
            qp = fq.to_qparams("pot")
        else:
            scale = torch.exp(value).to(torch.float32).cpu().numpy()
            base = fq.to_qparams("lsq")
            qp = QParams(scale.reshape(np.shape(base.scale)), base.zero_point, base.axis, base.spec, base.block_size)
        floor = qp.spec.min_scale
        if floor > 0:
            qp = QParams(np.maximum(qp.scale, np.float32(floor)).astype(np.float32), qp.zero_point, qp.axis, qp.spec,
                         qp.block_size)
        return qp


def output_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Squared error summed over channels (dim 1 of a 4-D/5-D tensor, the last dim otherwise), averaged over the
    rest: the per-layer objective of AdaRound and BRECQ."""
    out, target = out.float(), target.float()
    if out.dim() == 0:
        return (out - target).pow(2)
    dim = 1 if out.dim() >= 4 else out.dim() - 1
    # sum over dim, mean over the rest == mean over all times the size of dim; mse_loss is one fused pass
    return torch.nn.functional.mse_loss(out, target) * out.shape[dim]


def _writable(a) -> np.ndarray:
    """A memory-mapped (read-only) array copied into memory; torch does not take read-only buffers."""
    a = np.asarray(a)
    return a if a.flags.writeable else np.array(a)


def run_block(module: nn.Module, inputs: list[np.ndarray], device) -> list[np.ndarray]:
    """The block's outputs (numpy) for one chunk of inputs, without gradients."""
    with torch.no_grad():
        out = module(*[torch.as_tensor(_writable(x), device=device) for x in inputs])
    out = out if isinstance(out, tuple) else (out,)
    return [o.detach().cpu().numpy() for o in out]


def _sub_batch(arrays, size: int | None, gen: torch.Generator):
    """(float inputs, quantized inputs, targets) cut to `size` random samples along the leading axis, when every
    array is float with the same leading size (the chunk's samples); as they are otherwise: an integer input is
    usually a shape computed from the whole chunk (a transformer's reshape target holds the batch size)."""
    every = [np.asarray(a) for group in arrays for a in group]
    if any(a.dtype.kind != "f" or a.ndim == 0 for a in every):
        return arrays
    n = every[0].shape[0] if every else 0
    if size is None or n <= size or any(a.shape[0] != n for a in every):
        return arrays
    pick = torch.randperm(n, generator=gen)[:size].sort().values.numpy()
    return tuple([np.asarray(a)[pick] if np.ndim(a) > 0 and np.asarray(a).shape[0] == n else a for a in group]
                 for group in arrays)


@dataclass
class BlockOutcome:
    loss_nearest: float
    loss_learned: float  # of what was kept: learned rounding and scales, or learned rounding with calibrated scales
    kept: bool  # the learned state was kept (it lowered the loss)
    scales_kept: bool  # the learned activation scales were kept too
    validation_chunks: int
    steps: int
    seconds: float


def train_block(module: nn.Module, quant: Quantizers, weight_keys: list[str], act_keys: list[str], data,
                n_chunks: int, float_outputs: list[int], settings: Settings, seed: int) -> BlockOutcome:
    """Learn the block's quantizers. `data(chunk)` gives (float inputs, quantized inputs, float targets) as lists
    of numpy arrays. With two chunks or more, the last eighth of them (at least one) is held out: learning never
    sees it, and the outcome's losses are the mean output loss there (quantized inputs) at round-to-nearest and with
    what was learned. Of round-to-nearest, the learned rounding with the learned scales and the learned rounding with
    the calibrated scales, the block keeps the one with the lowest held-out loss: step sizes fitted to a few hundred
    samples can lose on others (measured on a small MLP: 26.1 dB at round-to-nearest, 22.4 with learned scales)."""
    import time

    start = time.perf_counter()
    device = torch.device(settings.device)
    v, s = quant.parameters_of(weight_keys, act_keys if settings.learn_scales else [])
    if not settings.learn_scales:
        quant.forget([], act_keys)
    n_val = max(1, n_chunks // 8) if n_chunks >= 2 else 0
    n_train = n_chunks - n_val
    evals = list(range(n_train, n_chunks)) or [0]

    def loss_on(chunk_inputs, targets) -> torch.Tensor:
        out = module(*chunk_inputs)
        out = out if isinstance(out, tuple) else (out,)
        return sum(output_loss(out[j], targets[j]) for j in float_outputs)

    def tensors(arrays):
        return [torch.as_tensor(_writable(a), device=device) for a in arrays]

    def evaluate(mode: str) -> float:
        quant.mode, total = mode, 0.0
        with torch.no_grad():
            for c in evals:
                _, q_in, targets = data(c)
                total += float(loss_on(tensors(q_in), tensors(targets)))
        return total / max(len(evals), 1)

    loss_nearest = evaluate("nearest")
    if not (v or s) or settings.iters <= 0:
        return BlockOutcome(loss_nearest, loss_nearest, False, False, n_val, 0, time.perf_counter() - start)
    saved = quant.snapshot(weight_keys, act_keys)
    groups = [g for g in ({"params": v, "lr": effective_lr(settings)}, {"params": s, "lr": settings.scale_lr}) if g["params"]]
    opt = torch.optim.Adam(groups)
    gen = torch.Generator().manual_seed(seed)
    quant.gen.manual_seed(seed)
    quant.mode, quant.drop = "soft", settings.drop
    for step in range(settings.iters):
        c = int(torch.randint(n_train, (1,), generator=gen))
        fp_in, q_in, targets = _sub_batch(data(c), settings.step_batch, gen)
        x = tensors(q_in)
        if settings.drop > 0:  # QDrop: each input value from the float or the quantized model, even odds
            for i, f in enumerate(tensors(fp_in)):
                if torch.is_floating_point(f) and f.shape == x[i].shape:
                    x[i] = torch.where(coin(f.shape, 0.5, gen, device), f, x[i])
        loss = loss_on(x, tensors(targets))
        beta = beta_at(step, settings)
        if beta is not None:
            loss = loss + settings.reg * quant.regulariser(weight_keys, beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    quant.drop = 0.0
    loss_learned = evaluate("hard")
    quant.learned_scales = False
    loss_weights = evaluate("hard") if s else float("inf")
    quant.learned_scales = True
    best = min(loss_nearest, loss_learned, loss_weights)
    kept, scales_kept = best < loss_nearest, best == loss_learned and best < loss_nearest
    if not kept:
        quant.restore(weight_keys, act_keys, saved)
        quant.forget(weight_keys, act_keys)
    elif not scales_kept:
        quant.forget([], act_keys)
    quant.mode = "hard"
    shown = best if kept else min(loss_learned, loss_weights)
    return BlockOutcome(loss_nearest, shown, kept, scales_kept, n_val, settings.iters, time.perf_counter() - start)


__all__ = ["Settings", "WeightPoint", "Quantizers", "output_loss", "beta_at", "run_block", "train_block",
           "BlockOutcome"]
