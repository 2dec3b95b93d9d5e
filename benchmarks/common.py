"""Helpers shared by the benchmarks: the CPU line, onnxruntime sessions and latency, onnxruntime.quantization's
quantize_static as the baseline."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import onnxruntime as ort


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    from oq.saturation.cpu import cpu_flag_set

    flags = cpu_flag_set(text)
    model = next((l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("model name")), "?")
    have = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return f"{model}; {' '.join(have) or 'no avx2'}"


def _session(path: str, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def median_latency(path: str, feed: dict, repeats: int, threads: int) -> float:
    sess = _session(path, threads)
    for _ in range(5):
        sess.run(None, feed)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ort_quantize_static(model_path: str, calib: dict, out: str, reduce_range: bool = False) -> None:
    """onnxruntime.quantization.quantize_static, QDQ and per channel, one calibration sample per batch."""
    import logging

    logging.getLogger().setLevel(logging.ERROR)  # its per-weight warnings drown the table
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            n = len(next(iter(calib.values())))
            self.it = iter([{k: v[i:i + 1] for k, v in calib.items()} for i in range(n)])

        def get_next(self):
            return next(self.it, None)

    quantize_static(model_path, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    reduce_range=reduce_range)
