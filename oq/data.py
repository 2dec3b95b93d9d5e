"""Calibration data sources, validated against the model's inputs before any run."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx
from onnx import helper

from .errors import OqError
from .npz import npz_member as _npz_member, open_npz as _open_npz
from .preprocess import IMAGE_SUFFIXES, load_image, no_preprocess, parse_preprocess


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype
    shape: tuple | None  # ints for fixed dims, str/None for dynamic; None: rank unknown (no shape in the model)

    @property
    def dynamic_batch(self) -> bool:
        return self.shape is None or (bool(self.shape) and not isinstance(self.shape[0], int))


def model_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    inits = {i.name for i in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        # a negative dim_value (some exporters write -1 for a dynamic axis) is as unknown as a missing one
        dims = (tuple(d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else (d.dim_param or None)
                      for d in tt.shape.dim) if tt.HasField("shape") else None)
        specs.append(InputSpec(vi.name, np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)), dims))
    return specs


def _check_array(where: str, spec: InputSpec, arr: np.ndarray) -> None:
    if arr.dtype != spec.dtype:
        raise OqError(f"{where}: array for input '{spec.name}' has dtype {arr.dtype}, the model expects {spec.dtype}")
    if spec.shape is None:
        return
    if arr.ndim != len(spec.shape):
        raise OqError(f"{where}: array for input '{spec.name}' has rank {arr.ndim} (shape {list(arr.shape)}), "
                      f"the model expects rank {len(spec.shape)} ({_fmt_shape(spec.shape)})")
    for axis, (want, got) in enumerate(zip(spec.shape, arr.shape)):
        if axis > 0 and isinstance(want, int) and want != got:
            raise OqError(f"{where}: array for input '{spec.name}' has shape {list(arr.shape)}, the model expects "
                          f"{_fmt_shape(spec.shape)} (axis {axis} differs)")


def _fmt_shape(shape) -> str:
    if shape is None:
        return "[unknown rank]"
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
    """An iterable of feeds; `batches(n)` groups consecutive samples when the model's batch axis allows it.

    `notes` collects what the report should say about the data once it has been read (the calibration pass adds
    them to the report's warnings). `zero_inputs` names the inputs that were 0 in every sample of the last complete
    pass over the data (None before one)."""

    def __init__(self, where: str, specs: list[InputSpec], limit: int | None = None):
        self.where, self.specs, self.limit = where, specs, limit
        self.notes: list[str] = []
        self.zero_inputs: set[str] | None = None

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

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
        zero: set[str] | None = None

        def flush():
            nonlocal zero
            feed = {k: np.concatenate([p[k] for p in pending]) if len(pending) > 1 else pending[0][k]
                    for k in pending[0]}
            _check_finite(self.where, feed, index - len(pending))
            zero = {k for k, v in feed.items()
                    if (zero is None or k in zero) and v.dtype.kind in "biufc" and not v.any()}
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
        self.zero_inputs = zero


class NpzStack(CalibrationData):
    """One .npz whose arrays hold the samples stacked along axis 0: either along the model's batch axis (same rank
    as the input, sample i = rows i:i+1), or as whole feeds stacked on a new axis (rank + 1, sample i = arr[i]),
    for models whose batch size is fixed."""

    def __init__(self, path: Path, specs: list[InputSpec], limit: int | None = None):
        with _open_npz(path) as npz:
            _check_names(str(path), specs, npz.files)
            arrays = {spec.name: _npz_member(path, npz, spec.name) for spec in specs}
        self._take(str(path), arrays, specs, limit)

    @classmethod
    def from_arrays(cls, arrays, specs: list[InputSpec], limit: int | None = None) -> "NpzStack":
        """The same layout from a dict of arrays in memory (the Python API's calib={"input": array})."""
        where = "calibration arrays"
        _check_names(where, specs, list(arrays))
        self = cls.__new__(cls)
        self._take(where, {spec.name: np.asarray(arrays[spec.name]) for spec in specs}, specs, limit)
        return self

    def _take(self, path: str, arrays: dict, specs: list[InputSpec], limit: int | None) -> None:
        super().__init__(path, specs, limit)
        counts = set()
        self.arrays: dict[str, np.ndarray] = {}
        self.whole_feeds: set[str] = set()
        for spec in specs:
            arr = arrays[spec.name]
            if spec.shape is not None and arr.ndim == len(spec.shape) + 1:
                _check_array(str(path), spec, arr[0] if len(arr) else arr[:0].reshape(arr.shape[1:]))
                self.whole_feeds.add(spec.name)
            else:
                _check_array(str(path), spec, arr)
                batch = spec.shape[0] if spec.shape else None
                if isinstance(batch, int) and batch != 1:  # samples would be fed one by one, at batch 1
                    raise OqError(f"{path}: input '{spec.name}' has a fixed batch of {batch} "
                                  f"({_fmt_shape(spec.shape)}); stack whole feeds on a new leading axis "
                                  f"(an array of shape [N, {', '.join(map(str, spec.shape))}])")
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
            with _open_npz(f) as npz:
                _check_names(str(f), self.specs, npz.files)
                feed = {spec.name: _npz_member(f, npz, spec.name) for spec in self.specs}
            for spec in self.specs:
                _check_array(str(f), spec, feed[spec.name])
            yield feed


class ImageFolder(CalibrationData):
    """A folder of images for a model with one image input, preprocessed as `--preprocess` says."""

    def __init__(self, path: Path, specs: list[InputSpec], preprocess: str | None, limit: int | None = None):
        super().__init__(str(path), specs, limit)
        if len(specs) != 1 or specs[0].shape is None or len(specs[0].shape) != 4:
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
        spec = self.specs[0]
        for f in self.files[:len(self)]:
            arr = load_image(f, self.pp, self.model_hw).astype(spec.dtype)
            _check_array(str(f), spec, arr)
            yield {spec.name: arr}


# A `module:function` source may be endless (a generator cycling over a loader); without --calib-size it is read up
# to this many samples. Ranges settle after a few hundred samples (TensorRT's guide: about 500 images for ImageNet
# classifiers; OpenVINO's NNCF reads 300 by default), so 1024 leaves margin for rare activations and bounds the run.
CALLABLE_DEFAULT_CAP = 1024


def _raised(where: str, exc: BaseException, index: int | None) -> OqError:
    at = "" if index is None else f" at sample {index}"
    if isinstance(exc, SystemExit):
        return OqError(f"calibration source {where} raised SystemExit({exc.code}){at}; a calibration function must "
                       f"return or yield feeds, not exit")
    return OqError(f"calibration source {where} raised {type(exc).__name__}{at}: {str(exc).strip()[:200]}")


class CallableSource(CalibrationData):
    """`module:function` returning an iterable of feed dicts (each value with the batch axis).

    The iterable may be endless: without a limit, at most CALLABLE_DEFAULT_CAP samples are read, and the report
    says so when the source had more. Anything the user's code raises (SystemExit included) is the user's error on
    one line; only KeyboardInterrupt passes through, so Ctrl-C still stops oq."""

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
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            raise _raised(self.where, exc, None) from None
        try:
            yield from self._read(iterator)
        finally:
            with contextlib.suppress(Exception):  # a generator's own clean-up (files, loader workers) runs now
                getattr(iterator, "close", lambda: None)()

    def _read(self, iterator):
        cap = self.limit if self.limit is not None else CALLABLE_DEFAULT_CAP
        index = 0
        while self.limit is None or index < self.limit:
            try:
                feed = next(iterator)
            except StopIteration:
                break
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                raise _raised(self.where, exc, index) from None
            if index == cap:  # one sample past the default cap: the source has more than it reads
                self.note(f"calibration source {self.where} yields more than {cap} samples: calibrated on the first "
                          f"{cap}, oq's cap for a function source without --calib-size (calib_size); set it to read "
                          f"more or fewer")
                break
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
            if s.shape is None or any(not isinstance(d, int) for d in s.shape[1:]):
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
    """An .npz of stacked samples, a folder of .npz feeds or images, `module:function`, or "random".

    `preprocess` (--preprocess) is for a folder of images only; with any other source it is an error."""
    if isinstance(calib, CalibrationData):
        if not isinstance(calib, ImageFolder):
            no_preprocess(preprocess, f"a {type(calib).__name__} object")
        return calib
    if limit is not None and limit < 1:
        raise OqError(f"--calib-size must be >= 1, got {limit}")
    if isinstance(calib, Mapping):
        no_preprocess(preprocess, "arrays in memory")
        return NpzStack.from_arrays(calib, specs, limit)
    if isinstance(calib, (list, tuple)):
        no_preprocess(preprocess, "a list of feeds")
        feeds = list(calib)
        return CallableSource(lambda: feeds, "calibration list", specs, limit if limit is not None else len(feeds))
    if callable(calib):
        name = getattr(calib, "__name__", "callable")
        no_preprocess(preprocess, f"the function {name}")
        return CallableSource(calib, name, specs, limit)
    if not isinstance(calib, (str, os.PathLike)):
        raise OqError(f"calibration data must be a path (.npz, folder), 'module:function', 'random', a dict of input "
                      f"name -> stacked samples, a list of feed dicts, or a function; got {type(calib).__name__}")
    text = str(calib)
    if text == "random":
        no_preprocess(preprocess, "random noise")
        return RandomSource(specs, limit)
    path = Path(text)
    if not path.exists() and ":" in text and not text.endswith(".npz"):
        no_preprocess(preprocess, f"the function source {text}")
        return CallableSource.from_ref(text, specs, limit)
    if not path.exists():
        raise OqError(f"{path}: calibration data not found")
    if path.is_dir():
        if any(p.suffix == ".npz" for p in path.iterdir()):
            no_preprocess(preprocess, f"{path}, a folder of .npz feeds")
            return NpzFolder(path, specs, limit)
        return ImageFolder(path, specs, preprocess, limit)
    if path.suffix != ".npz":
        raise OqError(f"{path}: calibration data must be an .npz file, a folder of .npz files or images, "
                      f"'module:function', or 'random'")
    no_preprocess(preprocess, f"{path}, an .npz file")
    return NpzStack(path, specs, limit)
