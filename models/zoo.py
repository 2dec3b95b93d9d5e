"""Torch definitions of the reference models, and how they are trained.

Everything that determines the trained weights lives in this file,
``specs.py`` and ``data.py`` (whose synthetic inputs and tasks the models are
trained on).  The weights are trained once and committed as fixtures
(``models/weights/NAME.npz``, written by ``python -m models freeze NAME``),
recording a hash of these three files: editing any of them makes the fixtures
stale, and ``tests/test_models.py`` says which to freeze again.

The models are briefly *trained*, because random networks are a poor stand-in
for the pretrained models a quantizer meets: they amplify quantization noise
far more, and their activations lack the heavy tails, dead channels and
uneven per-channel ranges that training produces.  Each model has a synthetic
supervised task from ``data.make_labelled`` (image classes from the object's
size and colour, a random-teacher tabular classification, a smooth image
regression from the latent, a windowed-attention sequence target) and a
:class:`Recipe`: AdamW with a one-cycle schedule for a few hundred to a few
thousand steps, in train mode so BatchNorm learns its running statistics.
Training is single-threaded with deterministic algorithms under one
``torch.manual_seed`` per model, so the weights are bit-reproducible for a given
machine and torch build -- but not across CPU types (AVX2 and AVX-512 kernels
round differently), hence the fixtures.  :func:`load_torch` reads the fixture;
only when it is missing or stale does it train here (about 45 s for all six
models on a 2-core machine), with a :class:`HostDependentWeightsWarning`.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import _weights
from ._weights import HostDependentWeightsWarning
from .specs import SPECS, get_spec

# --------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------


class ConvBNAct(nn.Sequential):
    """Conv2d (no bias) + BatchNorm2d + optional activation."""

    def __init__(self, cin, cout, k=3, stride=1, groups=1, act: type[nn.Module] | None = nn.ReLU):
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        ]
        if act is not None:
            layers.append(act())
        super().__init__(*layers)


# ---------------------------------------------------------------- resnet_mini


class BasicBlock(nn.Module):
    """ResNet basic block: Conv-BN-ReLU-Conv-BN (+ skip) -> ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                nn.BatchNorm2d(cout),
            )
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + identity)


class InceptionBlock(nn.Module):
    """Two parallel branches (1x1 and 1x1->3x3) joined by a channel Concat."""

    def __init__(self, cin: int, c1: int, c3: int):
        super().__init__()
        self.branch1 = ConvBNAct(cin, c1, k=1)
        self.branch3 = nn.Sequential(ConvBNAct(cin, c3, k=1), ConvBNAct(c3, c3, k=3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch3(x)], dim=1)


class ResNetMini(nn.Module):
    """[N,3,32,32] -> logits [N,10]."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = ConvBNAct(3, 16, k=3)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)  # 32 -> 16
        self.block1 = BasicBlock(16, 16, stride=1)
        self.block2 = BasicBlock(16, 32, stride=2)  # 16 -> 8, 1x1 downsample skip
        self.inception = InceptionBlock(32, 24, 24)  # -> 48 channels
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(48, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stem(x))
        x = self.block2(self.block1(x))
        x = self.inception(x)
        return self.fc(self.flatten(self.gap(x)))


# ------------------------------------------------------------- mobilenet_mini


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand - 3x3 depthwise - 1x1 project (+ residual)."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.use_residual = stride == 1 and cin == cout
        self.expand = ConvBNAct(cin, hidden, k=1, act=nn.ReLU6)
        self.depthwise = ConvBNAct(hidden, hidden, k=3, stride=stride, groups=hidden, act=nn.ReLU6)
        self.project = ConvBNAct(hidden, cout, k=1, act=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.depthwise(self.expand(x)))
        return x + out if self.use_residual else out


class MobileNetMini(nn.Module):
    """[N,3,32,32] -> logits [N,10]."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = ConvBNAct(3, 16, k=3, stride=2, act=nn.ReLU6)  # 32 -> 16
        self.blocks = nn.Sequential(
            InvertedResidual(16, 16, stride=1, expand=4),  # residual
            InvertedResidual(16, 24, stride=2, expand=4),  # 16 -> 8
            InvertedResidual(24, 24, stride=1, expand=4),  # residual
            InvertedResidual(24, 32, stride=1, expand=4),
            InvertedResidual(32, 32, stride=1, expand=4),  # residual
        )
        self.head = ConvBNAct(32, 64, k=1, act=nn.ReLU6)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(self.flatten(self.gap(x)))


# -------------------------------------------------------------------- decoder


class Decoder(nn.Module):
    """Latent [N,16,8,8] -> image [N,3,32,32] (two stride-2 ConvTranspose stages)."""

    def __init__(self):
        super().__init__()
        self.up1 = nn.ConvTranspose2d(16, 32, 4, stride=2, padding=1, bias=False)  # 8 -> 16
        self.bn1 = nn.BatchNorm2d(32)
        self.relu1 = nn.ReLU()
        # grouped transposed conv (ONNX ConvTranspose group=4)
        self.up2 = nn.ConvTranspose2d(32, 32, 4, stride=2, padding=1, groups=4, bias=False)  # 16 -> 32
        self.bn2 = nn.BatchNorm2d(32)
        self.relu2 = nn.ReLU()
        self.out = nn.Conv2d(32, 3, 3, padding=1, bias=True)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.up1(z)))
        x = self.relu2(self.bn2(self.up2(x)))
        return self.out(x)


# ------------------------------------------------------------------------ mlp


class MLP(nn.Module):
    """[N,64] -> logits [N,10]."""

    def __init__(self, din: int = 64, hidden: int = 128, num_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(din, hidden)
        self.bn1 = nn.BatchNorm1d(hidden)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, 64)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.fc1(x)))
        x = self.relu2(self.fc2(x))
        return self.fc3(x)


# ---------------------------------------------------------------- transformer


class _OnnxReshape(torch.autograd.Function):
    """``reshape`` with ONNX Reshape semantics (0 = copy that input dim).

    Exports as a single Reshape with a constant shape such as [0, 0, 4, -1],
    so dynamic batch/seq dims need no Shape/Gather/Concat side graph.
    """

    @staticmethod
    def forward(ctx, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        ctx.in_shape = t.shape
        return t.reshape([t.shape[i] if d == 0 else d for i, d in enumerate(shape)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.reshape(ctx.in_shape), None

    @staticmethod
    def symbolic(g, t, shape):
        return g.op("Reshape", t, g.op("Constant", value_t=torch.tensor(shape, dtype=torch.int64)))


class SelfAttention(nn.Module):
    """Hand-written multi-head self-attention (plain MatMul/Softmax in ONNX)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        assert dim % heads == 0
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = (0, 0, self.heads, -1)  # [B, S, D] -> [B, S, H, Dh]
        q = _OnnxReshape.apply(self.q(x), split).transpose(1, 2)  # [B, H, S, Dh]
        k = _OnnxReshape.apply(self.k(x), split).transpose(1, 2)
        v = _OnnxReshape.apply(self.v(x), split).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale  # [B, H, S, S]
        attn = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(attn, v).transpose(1, 2)  # [B, S, H, Dh]
        merged = _OnnxReshape.apply(ctx, (0, 0, -1))  # [B, S, D]
        return self.o(merged)


class TransformerBlock(nn.Module):
    """Pre-LN encoder block: x + MHA(LN(x)); x + FFN(LN(x)).  tokens [B,S,64] -> hidden [B,S,64]."""

    def __init__(self, dim: int = 64, heads: int = 4, ffn: int = 128):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens + self.attn(self.ln1(tokens))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class WideTransformer(nn.Module):
    """tokens [B,S,64] -> Linear to 128 -> encoder block (128 wide, 4 heads, FFN 512) -> Linear to 64, plus tokens."""

    def __init__(self, dim: int = 128, heads: int = 4, ffn: int = 512):
        super().__init__()
        self.up = nn.Linear(64, dim)
        self.block = TransformerBlock(dim, heads, ffn)
        self.down = nn.Linear(dim, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens + self.down(self.block(self.up(tokens)))


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """How a reference model is trained on its synthetic task (``data.make_labelled``)."""

    steps: int
    batch: int
    lr: float  # peak learning rate of the one-cycle schedule
    n_train: int  # training samples (seed TRAIN_SEED), cycled in shuffled epochs
    weight_decay: float = 0.01  # AdamW (decoupled); not applied to biases, BN and LN
    flip: bool = False  # random horizontal flips (label-preserving for the image task)
    channels_last: bool = False  # faster CPU convolutions; weights are made contiguous again


# About 30 s for all five on one 2-core CI machine (the two CNNs dominate).
RECIPES: dict[str, Recipe] = {
    "resnet_mini": Recipe(steps=350, batch=32, lr=1e-2, n_train=4096, flip=True, channels_last=True),
    "mobilenet_mini": Recipe(steps=300, batch=32, lr=1e-2, n_train=4096, flip=True, channels_last=True),
    "decoder": Recipe(steps=200, batch=32, lr=1e-2, n_train=4096, channels_last=True),
    "mlp": Recipe(steps=2000, batch=64, lr=3e-3, n_train=16384),
    "transformer": Recipe(steps=600, batch=64, lr=5e-3, n_train=4096),
    "transformer_wide": Recipe(steps=400, batch=64, lr=3e-3, n_train=4096),
}
assert set(RECIPES) == set(SPECS)

TRAIN_SEED = 1000  # make_labelled seed of the training set (calibration uses 0, evaluation 1)
HELD_OUT_SEED = 2  # make_labelled seed used by :func:`evaluate`


def _init_params(model: nn.Module) -> None:
    """torchvision-style init: Kaiming (fan_out) convolutions, zero conv biases; torch defaults elsewhere."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def _is_classifier(name: str) -> bool:
    return get_spec(name).output_name == "logits"


# (input kind, n) -> labelled training tensors; one entry, so the two CNNs share their images
_DATA_CACHE: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _training_set(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    from .data import _KIND, make_labelled

    key = (_KIND[name], RECIPES[name].n_train)
    if key not in _DATA_CACHE:
        inputs, y = make_labelled(name, key[1], TRAIN_SEED)
        _DATA_CACHE.clear()
        _DATA_CACHE[key] = (torch.from_numpy(inputs[get_spec(name).input_name]), torch.from_numpy(y))
    return _DATA_CACHE[key]


def _loss(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if _is_classifier(name):
        return nn.functional.cross_entropy(out, target)
    return nn.functional.mse_loss(out, target)


def _train(model: nn.Module, name: str, recipe: Recipe) -> dict[str, float]:
    """Train ``model`` in place on its synthetic task; returns a small log.

    Adam (AdamW, decoupled weight decay) with a one-cycle schedule, in train
    mode so BatchNorm learns its running statistics (momentum 0.1), then eval.
    Single-threaded with deterministic algorithms, so the weights are
    bit-reproducible for a given machine and torch build.
    """
    x, y = _training_set(name)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        foreach=True,
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=recipe.steps, pct_start=0.15)
    gen = torch.Generator().manual_seed(get_spec(name).seed)
    if recipe.channels_last:
        model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    model.train()
    perm, pos, losses = torch.randperm(len(x), generator=gen), 0, []
    for _ in range(recipe.steps):
        if pos + recipe.batch > len(x):
            perm, pos = torch.randperm(len(x), generator=gen), 0
        idx = perm[pos : pos + recipe.batch]
        pos += recipe.batch
        xb = x[idx]
        if recipe.flip:
            flip = torch.rand(len(idx), generator=gen) < 0.5
            xb = torch.where(flip.view(-1, 1, 1, 1), xb.flip(-1), xb)
        loss = _loss(name, model(xb), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    if recipe.channels_last:
        model.to(memory_format=torch.contiguous_format)
    tail = losses[-max(1, len(losses) // 10) :]
    return {"steps": recipe.steps, "final_loss": sum(tail) / len(tail)}


@torch.no_grad()
def evaluate(name: str, model: nn.Module, n: int = 512, seed: int = HELD_OUT_SEED) -> float:
    """Held-out score of ``model`` on its task: accuracy for classifiers, R^2 otherwise.

    For the transformer the R^2 is that of the residual target ``target - tokens``
    (the part that needs attention and the FFN), so copying the input scores 0.
    """
    from .data import make_labelled

    inputs, y = make_labelled(name, n, seed)
    x, y = torch.from_numpy(inputs[get_spec(name).input_name]), torch.from_numpy(y)
    out = model(x)
    if _is_classifier(name):
        return float((out.argmax(dim=1) == y).float().mean())
    base = x if name.startswith("transformer") else y.mean()
    return float(1.0 - (out - y).pow(2).mean() / (y - base).pow(2).mean())


# --------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------

FACTORIES: dict[str, Callable[[], nn.Module]] = {
    "resnet_mini": ResNetMini,
    "mobilenet_mini": MobileNetMini,
    "decoder": Decoder,
    "mlp": MLP,
    "transformer": TransformerBlock,
    "transformer_wide": WideTransformer,
}
assert set(FACTORIES) == set(SPECS)

# name -> trained state dict (read from the fixture or trained, once per process)
_TRAINED: dict[str, dict[str, torch.Tensor]] = {}
# name -> {"seconds", "steps", "final_loss"} of the training runs in this process
TRAINING_LOG: dict[str, dict[str, float]] = {}


def train(name: str, steps: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Train reference model ``name`` from scratch on this machine: ``(state dict, log)``.

    Deterministic for a given machine and torch build.  ``steps`` shortens the
    recipe (tests only; the fixtures are trained with the full recipe).
    Leaves the caller's thread count, determinism flag and RNG as they were.
    """
    spec = get_spec(name)
    recipe = RECIPES[name] if steps is None else dataclasses.replace(RECIPES[name], steps=steps)
    threads = torch.get_num_threads()
    det, det_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    start = time.perf_counter()
    # fork_rng: leave the caller's RNG alone; grad mode on even if called under no_grad
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad():
        torch.manual_seed(spec.seed)
        torch.set_num_threads(1)  # bit-reproducible training
        torch.use_deterministic_algorithms(True)
        try:
            model = FACTORIES[name]()
            _init_params(model)
            log = _train(model, name, recipe)
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(det, warn_only=det_warn)
    log["seconds"] = time.perf_counter() - start
    TRAINING_LOG[name] = log
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, log


def freeze(name: str) -> tuple[Path, dict[str, float]]:
    """Train ``name`` on this machine and write its fixture ``models/weights/NAME.npz``: ``(path, log)``."""
    state, log = train(name)
    path = _weights.write(name, {k: v.numpy() for k, v in state.items()})
    _TRAINED[name] = state
    return path, log


def _trained_state(name: str) -> dict[str, torch.Tensor]:
    if name not in _TRAINED:
        frozen = _weights.load(name)
        if frozen is not None:
            _TRAINED[name] = {k: torch.from_numpy(v) for k, v in frozen.items()}
        else:
            warnings.warn(_weights.fallback_message(name), HostDependentWeightsWarning, stacklevel=3)
            _TRAINED[name] = train(name)[0]
    return _TRAINED[name]


def load_torch(name: str) -> nn.Module:
    """Reference model ``name``, trained on its synthetic task, in eval mode.

    The weights come from the committed fixture ``models/weights/NAME.npz``
    (the same on every machine).  When it is missing or stale (the model
    sources changed since it was frozen), the model is trained here instead,
    with a :class:`HostDependentWeightsWarning`.  Either happens once per
    process (memoised); every call returns a fresh module with the same weights.
    """
    state = _trained_state(name)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG alone
        model = FACTORIES[name]()
    model.load_state_dict(state)
    model.eval()
    return model
