"""Reading .npz calibration files: never unpickling, every failure one line naming the file and member."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import OqError


def first_line(exc: BaseException, width: int = 160) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:width]}" if text else type(exc).__name__


def open_npz(path: Path):
    """np.load of an .npz archive, never unpickling: a file that is not one is the user's error, on one line."""
    try:
        npz = np.load(path, allow_pickle=False)
    except Exception as exc:
        if isinstance(exc, ValueError) and "allow_pickle" in str(exc):  # numpy's reading of "not zip, not .npy"
            with open(path, "rb") as f:
                head = f.read(2)
            if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):  # a pickle's opening
                raise OqError(f"{path}: holds pickled Python data; oq reads .npz without pickle (it would run code "
                              f"from the file): save plain arrays with np.savez") from None
            raise OqError(f"{path}: not a readable .npz file (neither a zip archive nor an .npy array)") from None
        raise OqError(f"{path}: not a readable .npz file ({first_line(exc)})") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise OqError(f"{path}: is a single .npy array, not an .npz archive of arrays named after the model's inputs "
                      f"(save with np.savez(path, input_name=array, ...))")
    return npz


def npz_member(path: Path, npz, key: str) -> np.ndarray:
    """One array of an open .npz. Members are read lazily, so a damaged archive (bad CRC, truncated or rewritten
    bytes, an unknown .npy format version) or an object array fails here, named with its member."""
    try:
        return npz[key]
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise OqError(f"{path}: member '{key}' holds a Python object array; oq reads .npz without pickle (it "
                          f"would run code from the file): save numeric arrays") from None
        raise OqError(f"{path}: member '{key}' is not a readable array ({first_line(exc)})") from None
    except Exception as exc:
        raise OqError(f"{path}: member '{key}' is corrupt ({first_line(exc)})") from None
