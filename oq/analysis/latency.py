"""Latency in onnxruntime, for targets whose models onnxruntime runs as deployed: the median of a few timed runs on
one batch, after a warm-up run, with the graph optimisations a deployment gets (so Q/DQ pairs fuse into int8
kernels)."""
from __future__ import annotations

import statistics
import time

import numpy as np
import onnx

from ..runtime import session

RUNS = 10


def median_ms(model: onnx.ModelProto, feed: dict[str, np.ndarray], runs: int = RUNS) -> float:
    sess = session(model, "all")
    sess.run(None, feed)  # warm-up: allocations, kernel selection
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)
