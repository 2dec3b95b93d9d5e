"""Synthetic but realistic-looking inputs for the reference models (numpy only).

Every sample ``i`` is drawn from its own generator seeded with ``(seed, i)``,
so ``make_inputs(name, n, seed)[:k] == make_inputs(name, k, seed)`` and the
data is bit-identical across processes and platforms.  Distribution-level
constants (embedding table, feature mixing matrix, per-channel scales) come
from fixed generators, so every seed samples the *same* distribution:
calibrate with seed 0, evaluate on seed 1.
"""

from __future__ import annotations

import numpy as np

from .specs import get_spec

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float64)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float64)

DEFAULT_SEQ_LEN = 16
VOCAB = 512
D_MODEL = 64


def _rng(seed: int, i: int, salt: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(i), int(salt)])


def _interp_matrix(n_out: int, n_in: int) -> np.ndarray:
    """Bilinear (align_corners=True) 1-D interpolation matrix [n_out, n_in]."""
    pos = np.linspace(0.0, n_in - 1, n_out)
    eye = np.eye(n_in)
    return np.stack([np.interp(pos, np.arange(n_in), eye[:, j]) for j in range(n_in)], axis=1)


def _upsample(field: np.ndarray, size: int) -> np.ndarray:
    """[..., k, k] -> [..., size, size] smooth bilinear upsampling."""
    m = _interp_matrix(size, field.shape[-1])
    return m @ field @ m.T


# --------------------------------------------------------------------- images


def _image(rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """One natural-looking RGB image [3, size, size], ImageNet-normalised."""
    # luminance: strong low-frequency structure + some mid frequencies
    lum = 0.22 * _upsample(rng.standard_normal((4, 4)), size)
    lum += 0.08 * _upsample(rng.standard_normal((8, 8)), size)
    # colour: channel-correlated tint plus weak per-channel variation
    tint = rng.normal(0.0, 0.07, size=(3, 1, 1))
    chroma = 0.06 * _upsample(rng.standard_normal((3, 3, 3)), size)
    img = 0.45 + rng.normal(0.0, 0.08) + lum[None] + tint + chroma
    # an object: a filled ellipse with its own colour (gives sharp edges)
    if rng.random() < 0.7:
        yy, xx = np.mgrid[0:size, 0:size] / (size - 1)
        cy, cx = rng.uniform(0.2, 0.8, size=2)
        ry, rx = rng.uniform(0.1, 0.35, size=2)
        mask = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1.0
        colour = rng.uniform(0.0, 1.0, size=(3, 1, 1))
        img = np.where(mask[None], 0.6 * colour + 0.4 * img, img)
    # sensor noise, then quantise to 8-bit pixel values like a decoded JPEG/PNG
    img = img + rng.normal(0.0, 0.02, size=img.shape)
    img = np.round(np.clip(img, 0.0, 1.0) * 255.0) / 255.0
    return (img - IMAGENET_MEAN[:, None, None]) / IMAGENET_STD[:, None, None]


# --------------------------------------------------------------------- latent

_LATENT_CONST = np.random.default_rng(20_301)
_LATENT_SCALE = np.exp(_LATENT_CONST.normal(0.0, 0.4, size=(16, 1, 1)))  # uneven channel ranges
_LATENT_SHIFT = _LATENT_CONST.normal(0.0, 0.3, size=(16, 1, 1))


def _latent(rng: np.random.Generator) -> np.ndarray:
    """One VAE/encoder-like latent [16, 8, 8]: spatially smooth, per-channel scales."""
    z = 0.8 * _upsample(rng.standard_normal((16, 4, 4)), 8) + 0.45 * rng.standard_normal((16, 8, 8))
    return z * _LATENT_SCALE + _LATENT_SHIFT


# -------------------------------------------------------------------- tabular

_TAB_CONST = np.random.default_rng(20_401)
_TAB_MIX = _TAB_CONST.normal(0.0, 1.0 / np.sqrt(12), size=(12, 64))  # 12 latent factors -> 64 features
_TAB_SCALE = np.exp(_TAB_CONST.normal(0.0, 0.5, size=64))
_TAB_SHIFT = _TAB_CONST.normal(0.0, 0.5, size=64)
_TAB_LOGNORMAL = _TAB_CONST.permutation(64)[:8]  # skewed, positive features (amounts, counts)


def _tabular(rng: np.random.Generator) -> np.ndarray:
    """One standardised-ish tabular feature vector [64] with correlated and skewed columns."""
    x = rng.standard_normal(12) @ _TAB_MIX + 0.3 * rng.standard_normal(64)
    x[_TAB_LOGNORMAL] = np.exp(0.7 * x[_TAB_LOGNORMAL]) - 1.0
    return x * _TAB_SCALE + _TAB_SHIFT


# --------------------------------------------------------------------- tokens

_TOK_CONST = np.random.default_rng(20_501)
_EMBED = _TOK_CONST.normal(0.0, 0.6, size=(VOCAB, D_MODEL))
_EMBED[:, [7, 41]] *= 5.0  # a couple of outlier channels, as in real transformer activations
_EMBED[:, [7, 41]] += 1.5
_ZIPF_P = 1.0 / (np.arange(VOCAB) + 3.0) ** 1.1
_ZIPF_P /= _ZIPF_P.sum()
_TOKEN_PERM = _TOK_CONST.permutation(VOCAB)


def _positional(seq_len: int) -> np.ndarray:
    pos = np.arange(seq_len)[:, None]
    i = np.arange(D_MODEL // 2)[None, :]
    ang = pos / (10_000.0 ** (2 * i / D_MODEL))
    pe = np.zeros((seq_len, D_MODEL))
    pe[:, 0::2] = np.sin(ang)
    pe[:, 1::2] = np.cos(ang)
    return pe


def _tokens(rng: np.random.Generator, seq_len: int) -> np.ndarray:
    """One embedded token sequence [seq_len, 64]: Zipf-distributed token ids, embeddings + sinusoids."""
    ids = _TOKEN_PERM[rng.choice(VOCAB, size=seq_len, p=_ZIPF_P)]
    return _EMBED[ids] + 0.5 * _positional(seq_len)


# ------------------------------------------------------------------------ API

_SALT = {"image": 1, "latent": 2, "tabular": 3, "tokens": 4}
_KIND = {
    "resnet_mini": "image",
    "mobilenet_mini": "image",
    "decoder": "latent",
    "mlp": "tabular",
    "transformer": "tokens",
}


def make_inputs(name: str, n: int, seed: int = 0, *, seq_len: int | None = None) -> dict[str, np.ndarray]:
    """``n`` input samples for reference model ``name``, stacked on axis 0.

    Returns ``{onnx_input_name: float32 array}``.  Deterministic in ``seed``;
    different seeds give different samples of the same distribution.
    ``seq_len`` (transformer only, default 16) sets the sequence length.
    """
    spec = get_spec(name)
    kind = _KIND[name]
    if n < 0:
        raise ValueError("n must be >= 0")
    if seq_len is not None and kind != "tokens":
        raise ValueError(f"seq_len only applies to the transformer, not {name!r}")
    seq = DEFAULT_SEQ_LEN if seq_len is None else int(seq_len)
    samples = []
    for i in range(n):
        rng = _rng(seed, i, _SALT[kind])
        if kind == "image":
            samples.append(_image(rng))
        elif kind == "latent":
            samples.append(_latent(rng))
        elif kind == "tabular":
            samples.append(_tabular(rng))
        else:
            samples.append(_tokens(rng, seq))
    shape = tuple(seq if d == "seq" else d for d in spec.inputs[spec.input_name][1:])
    x = np.stack(samples).astype(np.float32) if samples else np.zeros((0, *shape), np.float32)
    assert x.shape[1:] == shape, (x.shape, shape)
    return {spec.input_name: x}
