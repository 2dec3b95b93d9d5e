"""The run record: what made an output, written into its metadata and the report.

oq version, the target's name and a hash of its resolved spec, the options that shape the result, a hash of the
calibration data and the pass list. Options that only change how the work is done (batch size, memory bound,
progress) are left out of the model's metadata, so reruns give byte-identical files whatever the batching; the
report records every option.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .config import RunConfig

# options that change how the work runs but not its result
EXECUTION_ONLY = ("batch_size", "max_memory_mb", "progress", "plugins", "pipeline", "target", "calib")


def target_hash(target) -> str:
    spec = dataclasses.asdict(target)
    spec.pop("source", None)  # where it was read from does not change what it says
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def calibration_hash(calib, files: list[Path]) -> str:
    """sha256 over the calibration files' names and bytes; for code sources, of the reference only."""
    h = hashlib.sha256()
    if files:
        for path in sorted(files):
            h.update(path.name.encode() + b"\0")
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        return h.hexdigest()[:16]
    feeds = [calib] if isinstance(calib, Mapping) else calib if isinstance(calib, (list, tuple)) else None
    if feeds is not None and all(isinstance(f, Mapping) for f in feeds):  # arrays in memory: names, shapes, bytes
        for feed in feeds:
            for key in sorted(feed):
                a = np.ascontiguousarray(feed[key])
                h.update(f"{key}\0{a.dtype.str}\0{a.shape}\0".encode())
                h.update(a.tobytes())
        return h.hexdigest()[:16]
    name = calib if isinstance(calib, str) else getattr(calib, "__qualname__", None) or type(calib).__name__
    return f"not hashed ({name})"


def run_record(config: RunConfig, target, calib_files: list[Path], passes: list[str], version: str) -> dict:
    options = {k: v for k, v in config.as_dict().items() if k not in EXECUTION_ONLY and v not in (None, [], ())}
    if config.algo in (None, "rtn"):  # round to nearest: the same output whichever way it was asked for
        for name in ("algo", "device", "algo_iters"):
            options.pop(name, None)
    return {"oq.version": version, "oq.target": target.name, "oq.target_sha256": target_hash(target),
            "oq.options": json.dumps(options, sort_keys=True), "oq.calibration_sha256":
            calibration_hash(config.calib, calib_files), "oq.passes": ",".join(passes)}
