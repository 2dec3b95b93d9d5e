"""Calibration data sources, validated against the model's inputs before any run."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
from onnx import helper

from .errors import OqError


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype
    shape: tuple  # ints for fixed dims, str/None for dynamic

    @property
    def dynamic_batch(self) -> bool:
        return bool(self.shape) and not isinstance(self.shape[0], int)


def model_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    inits = {i.name for i in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        specs.append(InputSpec(vi.name, np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)), dims))
    return specs


def _check_array(where: str, spec: InputSpec, arr: np.ndarray) -> None:
    if arr.dtype != spec.dtype:
        raise OqError(f"{where}: array for input '{spec.name}' has dtype {arr.dtype}, the model expects {spec.dtype}")
    if arr.ndim != len(spec.shape):
        raise OqError(f"{where}: array for input '{spec.name}' has rank {arr.ndim} (shape {list(arr.shape)}), "
                      f"the model expects rank {len(spec.shape)} ({_fmt_shape(spec.shape)})")
    for axis, (want, got) in enumerate(zip(spec.shape, arr.shape)):
        if axis > 0 and isinstance(want, int) and want != got:
            raise OqError(f"{where}: array for input '{spec.name}' has shape {list(arr.shape)}, the model expects "
                          f"{_fmt_shape(spec.shape)} (axis {axis} differs)")


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in shape) + "]"


def _check_names(where: str, specs: list[InputSpec], keys) -> None:
    keys = list(keys)
    for spec in specs:
        if spec.name not in keys:
            have = ", ".join(f"'{k}'" for k in keys) or "nothing"
            raise OqError(f"{where} has no array for input '{spec.name}'; it has: {have}")
    extra = [k for k in keys if k not in {s.name for s in specs}]
    if extra:
        raise OqError(f"{where} has arrays that are not model inputs: {', '.join(repr(k) for k in extra)}; "
                      f"model inputs: {', '.join(repr(s.name) for s in specs)}")


def _check_finite(where: str, feed: dict[str, np.ndarray], first_index: int) -> None:
    for name, arr in feed.items():
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            bad = np.nonzero(~np.isfinite(arr.reshape(arr.shape[0], -1)).all(axis=1))[0][0] if arr.ndim else 0
            raise OqError(f"{where}: input '{name}' has NaN or inf in sample {first_index + int(bad)}")


class CalibrationData:
    """An iterable of feeds; `batches(n)` groups consecutive samples when the model's batch axis allows it."""

    def __init__(self, where: str, specs: list[InputSpec], limit: int | None = None):
        self.where, self.specs, self.limit = where, specs, limit

    def __len__(self) -> int:
        raise NotImplementedError

    def samples(self) -> Iterator[dict[str, np.ndarray]]:
        raise NotImplementedError

    def batches(self, batch_size: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(number of samples, feed) pairs. Samples are only concatenated when every input has a dynamic batch axis
        and equal shapes otherwise."""
        can_batch = batch_size > 1 and all(s.dynamic_batch for s in self.specs)
        pending: list[dict[str, np.ndarray]] = []
        index = 0

        def flush():
            feed = {k: np.concatenate([p[k] for p in pending]) if len(pending) > 1 else pending[0][k]
                    for k in pending[0]}
            _check_finite(self.where, feed, index - len(pending))
            return len(pending), feed

        for sample in self.samples():
            if pending and (not can_batch or len(pending) >= batch_size or
                            any(pending[0][k].shape[1:] != v.shape[1:] for k, v in sample.items())):
                yield flush()
                pending = []
            pending.append(sample)
            index += 1
        if pending:
            yield flush()


class NpzStack(CalibrationData):
    """One .npz whose arrays hold the samples stacked along axis 0: either along the model's batch axis (same rank
    as the input, sample i = rows i:i+1), or as whole feeds stacked on a new axis (rank + 1, sample i = arr[i]),
    for models whose batch size is fixed."""

    def __init__(self, path: Path, specs: list[InputSpec], limit: int | None = None):
        super().__init__(str(path), specs, limit)
        try:
            npz = np.load(path, allow_pickle=False)
            keys = list(npz.files)
        except Exception as exc:
            raise OqError(f"{path}: not a readable .npz file ({type(exc).__name__})") from None
        _check_names(str(path), specs, keys)
        counts = set()
        self.arrays: dict[str, np.ndarray] = {}
        self.whole_feeds: set[str] = set()
        for spec in specs:
            arr = npz[spec.name]
            if arr.ndim == len(spec.shape) + 1:
                _check_array(str(path), spec, arr[0] if len(arr) else arr[:0].reshape(arr.shape[1:]))
                self.whole_feeds.add(spec.name)
            else:
                _check_array(str(path), spec, arr)
            self.arrays[spec.name] = arr
            counts.add(arr.shape[0] if arr.ndim else 1)
        if len(counts) != 1:
            raise OqError(f"{path}: arrays hold different numbers of samples ({sorted(counts)})")
        self.count = counts.pop()
        if self.count == 0:
            raise OqError(f"{path}: holds no samples")

    def __len__(self) -> int:
        return min(self.count, self.limit) if self.limit else self.count

    def samples(self):
        for i in range(len(self)):
            yield {k: v[i] if k in self.whole_feeds else v[i:i + 1] for k, v in self.arrays.items()}


class NpzFolder(CalibrationData):
    """A folder of .npz files, each one complete feed (inputs may change shape from file to file)."""

    def __init__(self, path: Path, specs: list[InputSpec], limit: int | None = None):
        super().__init__(str(path), specs, limit)
        self.files = sorted(p for p in path.iterdir() if p.suffix == ".npz")
        if not self.files:
            raise OqError(f"{path}: folder holds no .npz files")

    def __len__(self) -> int:
        return min(len(self.files), self.limit) if self.limit else len(self.files)

    def samples(self):
        for f in self.files[:len(self)]:
            try:
                with np.load(f, allow_pickle=False) as npz:
                    feed = {k: npz[k] for k in npz.files}
            except Exception as exc:
                raise OqError(f"{f}: not a readable .npz file ({type(exc).__name__})") from None
            _check_names(str(f), self.specs, feed)
            for spec in self.specs:
                _check_array(str(f), spec, feed[spec.name])
            yield feed


class ImageFolder(CalibrationData):
    """A folder of images for a model with one image input, preprocessed as `--preprocess` says."""

    def __init__(self, path: Path, specs: list[InputSpec], preprocess: str | None, limit: int | None = None):
        from .preprocess import IMAGE_SUFFIXES, parse_preprocess

        super().__init__(str(path), specs, limit)
        if len(specs) != 1 or len(specs[0].shape) != 4:
            raise OqError(f"{path}: a folder of images can only feed a model with one 4-D image input; this model "
                          f"takes {', '.join(f'{s.name} {_fmt_shape(s.shape)}' for s in specs)}")
        self.pp = parse_preprocess(preprocess)
        self.files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        if not self.files:
            raise OqError(f"{path}: folder holds no .npz files and no images")
        shape = specs[0].shape
        hw = shape[2:4] if self.pp.layout == "nchw" else shape[1:3]
        self.model_hw = tuple(hw) if all(isinstance(d, int) for d in hw) else None

    def __len__(self) -> int:
        return min(len(self.files), self.limit) if self.limit else len(self.files)

    def samples(self):
        from .preprocess import load_image

        spec = self.specs[0]
        for f in self.files[:len(self)]:
            arr = load_image(f, self.pp, self.model_hw).astype(spec.dtype)
            _check_array(str(f), spec, arr)
            yield {spec.name: arr}


class CallableSource(CalibrationData):
    """`module:function` returning an iterable of feed dicts (each value with the batch axis)."""

    def __init__(self, func, where: str, specs: list[InputSpec], limit: int | None = None):
        super().__init__(where, specs, limit)
        self.func = func

    @classmethod
    def from_ref(cls, ref: str, specs: list[InputSpec], limit: int | None = None) -> "CallableSource":
        from .plugins import resolve

        func = resolve(ref, "calibration source")
        if not callable(func):
            raise OqError(f"calibration source {ref!r}: '{ref.partition(':')[2]}' is not a function")
        return cls(func, ref, specs, limit)

    def __len__(self) -> int:
        return self.limit or 0  # unknown until iterated

    def samples(self):
        try:
            feeds = self.func()
            iterator = iter(feeds)
        except Exception as exc:
            raise OqError(f"calibration source {self.where} raised {type(exc).__name__}: {str(exc)[:200]}") from None
        index = 0
        while self.limit is None or index < self.limit:
            try:
                feed = next(iterator)
            except StopIteration:
                break
            except Exception as exc:
                raise OqError(f"calibration source {self.where} raised {type(exc).__name__} at sample {index}: "
                              f"{str(exc)[:200]}") from None
            if not isinstance(feed, dict):
                raise OqError(f"calibration source {self.where}: sample {index} is a {type(feed).__name__}, "
                              f"expected a dict of input name -> array")
            feed = {k: np.asarray(v) for k, v in feed.items()}
            where = f"{self.where} sample {index}"
            _check_names(where, self.specs, feed)
            for spec in self.specs:
                _check_array(where, spec, feed[spec.name])
            yield feed
            index += 1
        if index == 0:
            raise OqError(f"calibration source {self.where} yielded no samples")


class RandomSource(CalibrationData):
    """Gaussian noise shaped like the inputs: only on explicit request, and the report says so."""

    def __init__(self, specs: list[InputSpec], limit: int | None = None, seed: int = 0):
        super().__init__("random", specs, limit)
        for s in specs:
            if any(not isinstance(d, int) for d in s.shape[1:]):
                raise OqError(f"--calib random: input '{s.name}' has dynamic dims {_fmt_shape(s.shape)} beyond the "
                              f"batch axis; give real calibration data")
        self.seed = seed

    def __len__(self) -> int:
        return self.limit or 32

    def samples(self):
        rng = np.random.default_rng(self.seed)
        for _ in range(len(self)):
            feed = {}
            for s in self.specs:
                shape = (1, *s.shape[1:])
                if s.dtype.kind == "f":
                    feed[s.name] = rng.standard_normal(shape).astype(s.dtype)
                elif s.dtype.kind in "iu":
                    feed[s.name] = rng.integers(0, 2, shape).astype(s.dtype)
                else:
                    feed[s.name] = np.zeros(shape, s.dtype)
            yield feed


def open_calibration(calib, specs: list[InputSpec], limit: int | None = None,
                     preprocess: str | None = None) -> CalibrationData:
    """An .npz of stacked samples, a folder of .npz feeds or images, `module:function`, or "random"."""
    if isinstance(calib, CalibrationData):
        return calib
    if limit is not None and limit < 1:
        raise OqError(f"--calib-size must be >= 1, got {limit}")
    if callable(calib):
        return CallableSource(calib, getattr(calib, "__name__", "callable"), specs, limit)
    text = str(calib)
    if text == "random":
        return RandomSource(specs, limit)
    path = Path(text)
    if not path.exists() and ":" in text and not text.endswith(".npz"):
        return CallableSource.from_ref(text, specs, limit)
    if not path.exists():
        raise OqError(f"{path}: calibration data not found")
    if path.is_dir():
        if any(p.suffix == ".npz" for p in path.iterdir()):
            return NpzFolder(path, specs, limit)
        return ImageFolder(path, specs, preprocess, limit)
    if path.suffix != ".npz":
        raise OqError(f"{path}: calibration data must be an .npz file, a folder of .npz files or images, "
                      f"'module:function', or 'random'")
    return NpzStack(path, specs, limit)
