"""The committed weight fixtures ``models/weights/NAME.npz`` (numpy only).

float32 training is not bit-reproducible across CPU types: the same recipe run
on an AVX2 machine and on an AVX-512 one ends with weights that differ in the
last bits, and after a few hundred optimizer steps those bits grow into
visibly different models.  So the weights of every reference model are
trained once (``python -m models freeze NAME``) and committed: every machine
then exports the same ONNX model, byte for byte.

A fixture holds the model's state dict (one array per key, float32 except
BatchNorm's int64 ``num_batches_tracked``) and, under :data:`HASH_KEY`, the
:func:`training_hash` of the sources it was trained from.  When the sources
change, the fixture is stale: :func:`load` ignores it and ``load_torch`` trains
on this machine instead, with a :class:`HostDependentWeightsWarning`.

The files are written deterministically (fixed zip timestamps, sorted keys):
freezing the same weights again leaves the file unchanged.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from .specs import get_spec

_PKG_DIR = Path(__file__).resolve().parent
WEIGHTS_DIR = _PKG_DIR / "weights"
# The sources that determine the *trained* weights: the model definitions and
# recipes (zoo.py), the seeds and shapes (specs.py) and the training data
# (data.py).  _export.py is not among them: export-only changes keep the weights.
TRAINING_SOURCES = ("specs.py", "zoo.py", "data.py")
HASH_KEY = "__training_hash__"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


class HostDependentWeightsWarning(UserWarning):
    """A reference model was trained on this machine because its weight fixture is missing or stale."""


def training_hash(name: str) -> str:
    """Hash of the model name and of the sources its training result depends on."""
    get_spec(name)
    h = hashlib.sha256(f"{name}\0".encode())
    for fname in TRAINING_SOURCES:
        h.update(fname.encode() + b"\0")
        h.update((_PKG_DIR / fname).read_bytes())
    return h.hexdigest()[:16]


def weights_path(name: str) -> Path:
    get_spec(name)
    return WEIGHTS_DIR / f"{name}.npz"


def read(name: str) -> tuple[dict[str, np.ndarray], str] | None:
    """``(state dict arrays, recorded training hash)`` from the fixture, or None when there is none."""
    path = weights_path(name)
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    recorded = str(arrays.pop(HASH_KEY, ""))
    return arrays, recorded


def status(name: str) -> str:
    """``"ok"``, ``"missing"`` or ``"stale"`` (frozen from other sources than the current ones)."""
    found = read(name)
    if found is None:
        return "missing"
    return "ok" if found[1] == training_hash(name) else "stale"


def load(name: str) -> dict[str, np.ndarray] | None:
    """The frozen state dict of ``name`` when its fixture exists and matches the current sources, else None."""
    found = read(name)
    if found is None or found[1] != training_hash(name):
        return None
    return found[0]


def fallback_message(name: str) -> str:
    """The warning given when ``name`` is trained here because its fixture is missing or stale."""
    why = status(name)
    why = "stale (frozen from other model sources)" if why == "stale" else why
    return (
        f"reference model {name!r}: models/weights/{name}.npz is {why}, so {name} was trained on this machine; "
        f"its weights depend on this host's CPU and torch build, and quantization accuracy may differ from "
        f"other machines'. Run `python -m models freeze {name}` to (re)write the fixture, and commit it."
    )


def write(name: str, state: dict[str, np.ndarray], directory: str | os.PathLike | None = None) -> Path:
    """Write ``state`` (a state dict as numpy arrays) as the fixture of ``name``; atomic and deterministic."""
    if HASH_KEY in state:
        raise ValueError(f"{HASH_KEY!r} is reserved")
    d = Path(directory) if directory is not None else WEIGHTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    entries = {k: np.asarray(v, order="C") for k, v in sorted(state.items())}
    entries[HASH_KEY] = np.array(training_hash(name))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key, arr in entries.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            data = io.BytesIO()
            np.lib.format.write_array(data, arr, allow_pickle=False)
            zf.writestr(info, data.getvalue(), compresslevel=9)
    path = d / f"{name}.npz"
    write_atomic(path, buf.getvalue())
    return path


def write_atomic(path: Path, data: bytes) -> None:
    """A temp file in the same folder, then a rename: concurrent writers never expose a partial file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
