"""Synthetic but realistic-looking inputs for the reference models (numpy only).

Every sample ``i`` is drawn from its own generator seeded with ``(seed, i)``,
so ``make_inputs(name, n, seed)[:k] == make_inputs(name, k, seed)`` and the
data is bit-identical across processes and platforms.  Distribution-level
constants (embedding table, feature mixing matrix, per-channel scales) come
from fixed generators, so every seed samples the *same* distribution:
calibrate with seed 0, evaluate on seed 1.

``make_labelled`` pairs the same inputs with the targets of the synthetic
tasks the reference models are trained on (see ``zoo.py``).
"""

from __future__ import annotations

import functools

import numpy as np

from .specs import get_spec

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float64)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float64)

DEFAULT_SEQ_LEN = 16
VOCAB = 512
D_MODEL = 64


def _rng(seed: int, i: int, salt: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(i), int(salt)])


@functools.cache
def _interp_matrix(n_out: int, n_in: int) -> np.ndarray:
    """Bilinear (align_corners=True) 1-D interpolation matrix [n_out, n_in] (cached, read-only)."""
    pos = np.linspace(0.0, n_in - 1, n_out)
    eye = np.eye(n_in)
    m = np.stack([np.interp(pos, np.arange(n_in), eye[:, j]) for j in range(n_in)], axis=1)
    m.setflags(write=False)
    return m


def _upsample(field: np.ndarray, size: int) -> np.ndarray:
    """[..., k, k] -> [..., size, size] smooth bilinear upsampling."""
    m = _interp_matrix(size, field.shape[-1])
    return m @ field @ m.T


# --------------------------------------------------------------------- images


def _image(rng: np.random.Generator, size: int = 32) -> tuple[np.ndarray, dict]:
    """One natural-looking RGB image [3, size, size], ImageNet-normalised, and its latent parameters."""
    # luminance: strong low-frequency structure + some mid frequencies
    lum = 0.22 * _upsample(rng.standard_normal((4, 4)), size)
    lum += 0.08 * _upsample(rng.standard_normal((8, 8)), size)
    # colour: channel-correlated tint plus weak per-channel variation
    tint = rng.normal(0.0, 0.07, size=(3, 1, 1))
    chroma = 0.06 * _upsample(rng.standard_normal((3, 3, 3)), size)
    img = 0.45 + rng.normal(0.0, 0.08) + lum[None] + tint + chroma
    params: dict = {"object": False}
    # an object: a filled ellipse with its own colour (gives sharp edges)
    if rng.random() < 0.7:
        yy, xx = np.mgrid[0:size, 0:size] / (size - 1)
        cy, cx = rng.uniform(0.2, 0.8, size=2)
        ry, rx = rng.uniform(0.1, 0.35, size=2)
        mask = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1.0
        colour = rng.uniform(0.0, 1.0, size=(3, 1, 1))
        img = np.where(mask[None], 0.6 * colour + 0.4 * img, img)
        params = {"object": True, "centre": (cy, cx), "radii": (ry, rx), "colour": colour.ravel(),
                  "area": float(mask.mean())}
    # sensor noise, then quantise to 8-bit pixel values like a decoded JPEG/PNG
    img = img + rng.normal(0.0, 0.02, size=img.shape)
    img = np.round(np.clip(img, 0.0, 1.0) * 255.0) / 255.0
    return (img - IMAGENET_MEAN[:, None, None]) / IMAGENET_STD[:, None, None], params


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
    "transformer_wide": "tokens",
}


def _sample(kind: str, seed: int, i: int, seq: int) -> tuple[np.ndarray, dict | None]:
    """Sample ``i`` of ``seed`` and, for images, the latent parameters it was drawn from."""
    rng = _rng(seed, i, _SALT[kind])
    if kind == "image":
        return _image(rng)
    if kind == "latent":
        return _latent(rng), None
    if kind == "tabular":
        return _tabular(rng), None
    return _tokens(rng, seq), None


def _draw(name: str, n: int, seed: int, seq_len: int | None) -> tuple[np.ndarray, list]:
    spec = get_spec(name)
    kind = _KIND[name]
    if n < 0:
        raise ValueError("n must be >= 0")
    if seq_len is not None and kind != "tokens":
        raise ValueError(f"seq_len only applies to the transformers, not {name!r}")
    seq = DEFAULT_SEQ_LEN if seq_len is None else int(seq_len)
    drawn = [_sample(kind, seed, i, seq) for i in range(n)]
    shape = tuple(seq if d == "seq" else d for d in spec.inputs[spec.input_name][1:])
    x = np.stack([d[0] for d in drawn]).astype(np.float32) if drawn else np.zeros((0, *shape), np.float32)
    assert x.shape[1:] == shape, (x.shape, shape)
    return x, [d[1] for d in drawn]


def make_inputs(name: str, n: int, seed: int = 0, *, seq_len: int | None = None) -> dict[str, np.ndarray]:
    """``n`` input samples for reference model ``name``, stacked on axis 0.

    Returns ``{onnx_input_name: float32 array}``.  Deterministic in ``seed``;
    different seeds give different samples of the same distribution.
    ``seq_len`` (transformer only, default 16) sets the sequence length.
    """
    x, _ = _draw(name, n, seed, seq_len)
    return {get_spec(name).input_name: x}


# ------------------------------------------------------------ labelled data
#
# Synthetic supervised tasks the reference models are trained on (see zoo.py).
# Each target is a fixed, deterministic function of the sample (or of the
# latent parameters it was drawn from), so the tasks are learnable but not
# trivial.

N_CLASSES = 10
_TASK_CONST = np.random.default_rng(20_601)
# mlp teacher: a fixed random 2-layer tanh network on the de-scaled features
_TEACHER_W1 = _TASK_CONST.normal(0.0, 1.5 / np.sqrt(64), size=(64, 32))
_TEACHER_B1 = _TASK_CONST.normal(0.0, 0.3, size=32)
_TEACHER_W2 = _TASK_CONST.normal(0.0, 1.0 / np.sqrt(32), size=(32, N_CLASSES))
# decoder target: a fixed random per-pixel linear map of the latent, upsampled, tanh
_DEC_MAP = _TASK_CONST.normal(0.0, 1.0 / np.sqrt(16), size=(3, 16))
_DEC_BIAS = _TASK_CONST.normal(0.0, 0.2, size=(3, 1, 1))
# transformer target: token + fixed linear map of the mean of the tokens in a window
ATTN_WINDOW = 2  # positions i-2 .. i+2 (clipped at the sequence ends)
_TOK_MAP = _TASK_CONST.normal(0.0, 1.0 / np.sqrt(D_MODEL), size=(D_MODEL, D_MODEL))
# image classes: terciles of the visible object area (fraction of the image)
_AREA_BINS = (0.105, 0.17)


def _image_label(params: dict) -> int:
    """0: no object; else 1 + 3 * size bin + the object's dominant colour channel."""
    if not params["object"]:
        return 0
    size_bin = int(np.searchsorted(_AREA_BINS, params["area"]))
    return 1 + 3 * size_bin + int(np.argmax(params["colour"]))


def _teacher_logits(x: np.ndarray) -> np.ndarray:
    z = (x.astype(np.float64) - _TAB_SHIFT) / _TAB_SCALE
    return np.tanh(z @ _TEACHER_W1 + _TEACHER_B1) @ _TEACHER_W2


@functools.cache
def _teacher_centre() -> np.ndarray:
    """Per-class mean teacher logit over the feature distribution (keeps the classes balanced)."""
    x, _ = _draw("mlp", 2048, 20_602, None)
    return _teacher_logits(x).mean(axis=0)


def _mlp_labels(x: np.ndarray) -> np.ndarray:
    return np.argmax(_teacher_logits(x) - _teacher_centre(), axis=1)


def _decoder_targets(z: np.ndarray) -> np.ndarray:
    u = np.einsum("ck,nkhw->nchw", _DEC_MAP, (z.astype(np.float64) - _LATENT_SHIFT) / _LATENT_SCALE)
    return 2.0 * np.tanh(0.8 * _upsample(u, 32) + _DEC_BIAS)


def _transformer_targets(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    seq = x.shape[1]
    idx = np.arange(seq)
    window = (np.abs(idx[:, None] - idx[None, :]) <= ATTN_WINDOW).astype(np.float64)
    window /= window.sum(axis=1, keepdims=True)
    return x + np.einsum("ij,njd->nid", window, x) @ _TOK_MAP


def make_labelled(name: str, n: int, seed: int = 0, *, seq_len: int | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``(make_inputs(name, n, seed), targets)`` for model ``name``'s training task.

    Classifiers (``resnet_mini``, ``mobilenet_mini``, ``mlp``) get int64 class
    labels [n] in ``0..9``; ``decoder`` a float32 target image [n, 3, 32, 32];
    ``transformer`` a float32 target sequence [n, seq, 64].
    """
    x, params = _draw(name, n, seed, seq_len)
    kind = _KIND[name]
    if kind == "image":
        y = np.array([_image_label(p) for p in params], dtype=np.int64)
    elif kind == "tabular":
        y = _mlp_labels(x).astype(np.int64)
    elif kind == "latent":
        y = _decoder_targets(x).astype(np.float32)
    else:
        y = _transformer_targets(x).astype(np.float32)
    return {get_spec(name).input_name: x}, y
