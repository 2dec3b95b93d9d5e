"""What a --min-sqnr search measures on: the --eval data, or calibration samples held back from calibration.

A search quantizes and measures many times, so both the evaluation samples and their fp32 outputs are read once and
kept. Held-back samples are never calibrated on: the calibration source is read once, its last quarter (at least one
sample) measures and the rest calibrates, passed on as feeds in memory (hashed into the output like a file).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from ..calibration import progress_reporter
from ..config import RunConfig
from ..data import model_inputs, open_calibration
from ..errors import OqError
from ..outputs import calibration_files
from ..record import calibration_hash
from ..runtime import session
from .measure import _float_outputs
from .run import _describe, _open_eval
from .stats import ErrorStats

HOLD_BACK = 4  # with no --eval data, the last 1/HOLD_BACK of the calibration samples measure


@dataclass
class Split:
    config: RunConfig  # what every quantization of the search runs with
    eval_feeds: list[dict[str, np.ndarray]]
    description: str  # where the numbers were measured, for the printout
    data_hash: dict  # calibration and evaluation data, for the state file's key


def _read(source) -> list[dict[str, np.ndarray]]:
    return [feed for _, feed in source.batches(1)]  # one checked feed per sample


def split(config: RunConfig, proto: onnx.ModelProto, eval_data: Any = None, eval_size: int | None = None) -> Split:
    if eval_data is not None:
        feeds = _read(_open_eval(eval_data, config, proto, eval_size))
        if not feeds:
            raise OqError("--eval: the evaluation data holds no samples")
        return Split(config, feeds, f"{len(feeds)} samples of {_describe(eval_data)}",
                     {"calib": calibration_hash(config.calib, calibration_files(config.calib)),
                      "eval": calibration_hash(feeds, [])})
    if eval_size is not None:
        raise OqError("--eval-size (eval_size) goes with --eval data")
    if config.calib is None:
        raise OqError("no calibration data given: pass an .npz, a folder of .npz feeds or images, "
                      "'module:function', or 'random' (not recommended)")
    feeds = _read(open_calibration(config.calib, model_inputs(proto), config.calib_size, config.preprocess))
    held = max(1, len(feeds) // HOLD_BACK)
    if len(feeds) - held < 1:
        raise OqError(f"--min-sqnr: the calibration data holds {len(feeds)} sample(s), too few to hold some back for "
                      f"measuring; give --eval data")
    calib, held_feeds = feeds[:-held], feeds[-held:]
    described = (f"{held} held-back calibration samples (the last quarter of {len(feeds)}; calibrated on the "
                 f"other {len(calib)})")
    config = dataclasses.replace(config, calib=calib, calib_size=None, preprocess=None)
    return Split(config, held_feeds, described, {"calib": calibration_hash(calib, []),
                                                 "eval": calibration_hash(held_feeds, [])})


class Evaluator:
    """Output SQNR of a model against fp32 over the evaluation samples, all float outputs together, computed as
    `oq analyze` computes it (graph optimisation off: the Q/DQ graph as written)."""

    def __init__(self, fp32: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], batch_size: int, progress):
        self.fp32, self.progress = fp32, progress
        self.batches = list(open_calibration(feeds, model_inputs(fp32)).batches(batch_size))
        self.samples = sum(count for count, _ in self.batches)
        self.outputs = _float_outputs(fp32)

    @functools.cached_property
    def reference(self) -> list[list[np.ndarray]]:
        ref = session(self.fp32, "disable")
        return [ref.run(self.outputs, feed) for _, feed in self.batches]

    def sqnr(self, model: onnx.ModelProto, desc: str = "min-sqnr: measuring") -> float:
        stats = ErrorStats()
        run = session(model, "disable")
        bar = progress_reporter(self.progress, desc, self.samples)
        try:
            for (count, feed), ref in zip(self.batches, self.reference):
                for r, value in zip(ref, run.run(self.outputs, feed)):
                    stats.add(r, value)
                bar.update(count)
        finally:
            bar.close()
        return stats.sqnr_db
