"""Image preprocessing for calibration from a folder of images (`--calib DIR --preprocess SPEC`).

SPEC is a comma-separated list of key=value pairs, e.g.
    resize=256,crop=224,scale=1/255,mean=0.485/0.456/0.406,std=0.229/0.224/0.225,order=rgb,layout=nchw
resize: shorter side to this many pixels (or HxW); crop: centre crop (N or HxW); scale: multiply pixel values
(0..255) first; mean/std: per channel, after scaling; order: rgb or bgr; layout: nchw or nhwc.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from .errors import OqError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
KEYS = ("resize", "crop", "scale", "mean", "std", "order", "layout")


@dataclass(frozen=True)
class Preprocess:
    resize: tuple[int, int] | int | None = None
    crop: tuple[int, int] | None = None
    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    order: str = "rgb"
    layout: str = "nchw"


def _hw(value: str, key: str) -> tuple[int, int]:
    try:
        parts = [int(p) for p in value.lower().split("x")]
    except ValueError:
        raise OqError(f"--preprocess {key}={value}: expected N or HxW") from None
    if len(parts) == 1:
        return parts[0], parts[0]
    if len(parts) == 2:
        return parts[0], parts[1]
    raise OqError(f"--preprocess {key}={value}: expected N or HxW")


def _floats(value: str, key: str) -> tuple[float, ...]:
    try:
        return tuple(float(Fraction(p)) for p in value.split("/"))
    except (ValueError, ZeroDivisionError):
        raise OqError(f"--preprocess {key}={value}: expected numbers separated by '/'") from None


def parse_preprocess(spec: str | None) -> Preprocess:
    if not spec:
        return Preprocess()
    fields: dict = {}
    for item in spec.split(","):
        if "=" not in item:
            raise OqError(f"--preprocess: '{item}' is not key=value (keys: {', '.join(KEYS)})")
        key, value = (s.strip() for s in item.split("=", 1))
        if key == "resize":
            fields[key] = int(value) if value.isdigit() else _hw(value, key)
        elif key == "crop":
            fields[key] = _hw(value, key)
        elif key == "scale":
            try:
                fields[key] = float(Fraction(value))  # "1/255" is a fraction here, not a list
            except (ValueError, ZeroDivisionError):
                raise OqError(f"--preprocess scale={value}: expected a number such as 1/255 or 0.0039") from None
        elif key in ("mean", "std"):
            fields[key] = _floats(value, key)
        elif key == "order":
            if value not in ("rgb", "bgr"):
                raise OqError(f"--preprocess order={value}: expected rgb or bgr")
            fields[key] = value
        elif key == "layout":
            if value not in ("nchw", "nhwc"):
                raise OqError(f"--preprocess layout={value}: expected nchw or nhwc")
            fields[key] = value
        else:
            raise OqError(f"--preprocess: unknown key '{key}' (keys: {', '.join(KEYS)})")
    if any(s == 0 for s in fields.get("std", (1.0,))):
        raise OqError("--preprocess std: must not be 0")
    return Preprocess(**fields)


def no_preprocess(preprocess: str | None, source: str) -> None:
    """--preprocess given with calibration data other than a folder of images: an error, never silently ignored."""
    if preprocess is not None:
        raise OqError(f"--preprocess: applies to image folders only; the calibration data is {source}, whose arrays "
                      f"are fed as they are: drop --preprocess or prepare the arrays yourself")


def load_image(path: Path, pp: Preprocess, size_from_model: tuple[int, int] | None) -> np.ndarray:
    """One image as a float32 array [1, C, H, W] or [1, H, W, C]."""
    try:
        from PIL import Image
    except ImportError:
        raise OqError("calibrating from images needs Pillow: pip install 'oq[images]'") from None
    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            if pp.resize is not None:
                if isinstance(pp.resize, int):
                    w, h = im.size
                    k = pp.resize / min(w, h)
                    im = im.resize((max(1, round(w * k)), max(1, round(h * k))), Image.BILINEAR)
                else:
                    im = im.resize((pp.resize[1], pp.resize[0]), Image.BILINEAR)
            crop = pp.crop or size_from_model
            if crop is not None:
                ch, cw = crop
                w, h = im.size
                if ch > h or cw > w:
                    im = im.resize((max(cw, w), max(ch, h)), Image.BILINEAR)
                    w, h = im.size
                left, top = (w - cw) // 2, (h - ch) // 2
                im = im.crop((left, top, left + cw, top + ch))
            arr = np.asarray(im, dtype=np.float32)
    except OqError:
        raise
    except Exception as exc:
        raise OqError(f"{path}: cannot read image ({type(exc).__name__}: {str(exc)[:120]})") from None
    if pp.order == "bgr":
        arr = arr[..., ::-1]
    arr = arr * pp.scale
    arr = (arr - np.asarray(pp.mean, np.float32)) / np.asarray(pp.std, np.float32)
    if pp.layout == "nchw":
        arr = arr.transpose(2, 0, 1)
    return np.ascontiguousarray(arr[None], dtype=np.float32)
