"""Torch definitions of the reference models.

Everything that determines the exported graph or its weights lives in this
file, ``specs.py`` and ``data.py`` (whose synthetic inputs are used to set
realistic BatchNorm running statistics); all of them are hashed into the ONNX
cache key, so editing any one rebuilds the cached models.

Weights are deterministic: every model is created under its own
``torch.manual_seed`` and initialised with kaiming-like scales.  BatchNorm
layers get random affine parameters and running statistics measured on the
model's own synthetic input distribution (as after real training, but without
any training), rounded so they do not depend on thread count or BLAS details.
Consequently eval-mode activations keep a sensible scale through the network
and folding BN into the neighbouring Conv/Gemm changes the weights visibly.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

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


# --------------------------------------------------------------------------
# Initialisation
# --------------------------------------------------------------------------


def _init_params(model: nn.Module) -> None:
    """Kaiming-like weights, small random biases, random BN affine params."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.normal_(m.bias, std=0.05)
        elif isinstance(m, nn.Linear):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="linear")
            if m.bias is not None:
                nn.init.normal_(m.bias, std=0.05)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.2)
        elif isinstance(m, nn.LayerNorm):
            with torch.no_grad():
                m.weight.uniform_(0.7, 1.3)
                m.bias.normal_(0.0, 0.05)


def _round_sig(t: torch.Tensor, digits: int = 4) -> torch.Tensor:
    """Round to ``digits`` significant decimal digits (thread/BLAS independent)."""
    t = t.double()
    mag = torch.where(t == 0, torch.ones_like(t), 10.0 ** torch.floor(torch.log10(t.abs())))
    scale = 10.0 ** (digits - 1) / mag
    return (torch.round(t * scale) / scale).float()


@torch.no_grad()
def _set_bn_statistics(model: nn.Module, name: str) -> None:
    """Give every BN realistic running stats measured on the model's input distribution.

    Runs forward passes in train mode with a cumulative moving average
    (``momentum=None``), i.e. exact population statistics of the synthetic data.
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    from .data import make_inputs  # local import: data.py does not import torch

    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    model.train()
    batch = make_inputs(name, 256, seed=10_007)
    (x,) = batch.values()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-reproducible statistics across processes
    try:
        for chunk in torch.from_numpy(x).split(64):
            model(chunk)
    finally:
        torch.set_num_threads(threads)
    for bn in bns:
        bn.momentum = 0.1
        bn.running_mean.copy_(_round_sig(bn.running_mean))
        bn.running_var.copy_(_round_sig(bn.running_var).clamp_min(1e-3))
        bn.num_batches_tracked.zero_()
    model.eval()


@torch.no_grad()
def _set_attention_sharpness(model: nn.Module) -> None:
    """Scale Q/K projections up a bit so attention maps are peaked, as in trained models."""
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.q.weight.mul_(1.6)
            m.k.weight.mul_(1.6)


@torch.no_grad()
def _set_output_scale(model: nn.Module, name: str) -> None:
    """Centre and rescale the final layer so outputs look like a trained model's.

    With random weights the head's output is dominated by a constant offset
    (every input gets the same argmax).  Subtract the per-output mean measured
    on the model's data (keeping a small random class prior) and scale so the
    output std is ``target_std``: classifier logits get std ~3 (confident, not
    saturated, input-dependent predictions); the decoder's image gets mean ~0,
    std ~1 (an ImageNet-normalised image).
    """
    if name not in OUTPUT_LAYERS:
        return
    attr, target_std = OUTPUT_LAYERS[name]
    from .data import make_inputs

    layer = getattr(model, attr)
    model.eval()
    (x,) = make_inputs(name, 128, seed=10_009).values()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        y = model(torch.from_numpy(x))
    finally:
        torch.set_num_threads(threads)
    channel_dim = 1  # [N, C] logits and [N, C, H, W] images
    reduce_dims = [d for d in range(y.dim()) if d != channel_dim]
    mean = y.mean(dim=reduce_dims)
    factor = float(_round_sig(torch.tensor(target_std / float((y - mean.view(1, -1, *[1] * (y.dim() - 2))).std())), 3))
    gen = torch.Generator().manual_seed(get_spec(name).seed)
    prior = 0.1 * torch.randn(mean.shape, generator=gen)
    layer.bias.copy_(_round_sig((layer.bias - mean) * factor + prior))
    layer.weight.mul_(factor)


# --------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------

FACTORIES: dict[str, Callable[[], nn.Module]] = {
    "resnet_mini": ResNetMini,
    "mobilenet_mini": MobileNetMini,
    "decoder": Decoder,
    "mlp": MLP,
    "transformer": TransformerBlock,
}
assert set(FACTORIES) == set(SPECS)

# model -> (final layer attribute, target output std)
OUTPUT_LAYERS: dict[str, tuple[str, float]] = {
    "resnet_mini": ("fc", 3.0),
    "mobilenet_mini": ("fc", 3.0),
    "decoder": ("out", 1.0),
    "mlp": ("fc3", 3.0),
}


def load_torch(name: str) -> nn.Module:
    """Instantiate reference model ``name`` with its deterministic weights, in eval mode."""
    spec = get_spec(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = FACTORIES[name]()
        _init_params(model)
    if any(isinstance(m, SelfAttention) for m in model.modules()):
        _set_attention_sharpness(model)
    _set_bn_statistics(model, name)
    _set_output_scale(model, name)
    model.eval()
    return model
