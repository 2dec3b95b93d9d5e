"""Benchmarks that print ratios measured in one run (never timed tests).

    python -m oq.bench latency [--models resnet_mini mobilenet_mini] [--batch 32] [--repeats 50]

latency: fp32 vs oq's onnxruntime-target output vs onnxruntime.quantization.quantize_static (its CPU defaults), all
run with onnxruntime's default optimisations on this CPU; medians and ratios to fp32.
Needs the reference models (`models/`, run from the repository root) or --model/--calib for your own.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
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


def _ort_quantize_static(model_path: str, calib: dict, out: str) -> None:
    import logging

    logging.getLogger().setLevel(logging.ERROR)  # its per-weight warnings drown the table
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            n = len(next(iter(calib.values())))
            self.it = iter([{k: v[i:i + 1] for k, v in calib.items()} for i in range(n)])

        def get_next(self):
            return next(self.it, None)

    quantize_static(model_path, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True)


def latency(args) -> None:
    import oq

    print(f"CPU: {cpu_flags()}; onnxruntime {ort.__version__}; threads {args.threads}; batch {args.batch}; "
          f"median of {args.repeats} runs")
    print(f"{'model':<16}{'fp32 ms':>10}{'oq ms':>10}{'ort-q ms':>10}{'oq/fp32':>10}{'oq/ort-q':>10}")
    cases = []
    if args.model:
        data = dict(np.load(args.calib))
        cases.append((Path(args.model).stem, args.model, data, {k: v[:args.batch] for k, v in data.items()}))
    else:
        import models
        for name in args.models:
            cases.append((name, str(models.build(name)), models.make_inputs(name, 64),
                          models.make_inputs(name, args.batch, seed=1)))
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, calib, feed in cases:
            calib_path = f"{tmp}/{name}.npz"
            np.savez(calib_path, **calib)
            oq_path = f"{tmp}/{name}.oq.onnx"
            oq.quantize(path, "onnxruntime", calib_path, progress=False).save(oq_path)
            ortq_path = f"{tmp}/{name}.ortq.onnx"
            _ort_quantize_static(path, calib, ortq_path)
            # interleave repeats of the three so machine noise hits them alike
            t = {k: [] for k in ("fp32", "oq", "ortq")}
            for _ in range(3):
                for k, p in (("fp32", path), ("oq", oq_path), ("ortq", ortq_path)):
                    t[k].append(median_latency(p, feed, args.repeats, args.threads))
            fp, q, oq_ = (statistics.median(t[k]) * 1e3 for k in ("fp32", "oq", "ortq"))
            print(f"{name:<16}{fp:>10.3f}{q:>10.3f}{oq_:>10.3f}{q / fp:>10.2f}{q / oq_:>10.2f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m oq.bench")
    sub = p.add_subparsers(dest="what", required=True)
    lat = sub.add_parser("latency", help="fp32 vs oq (onnxruntime target) vs onnxruntime.quantization")
    lat.add_argument("--models", nargs="+", default=["resnet_mini", "mobilenet_mini"])
    lat.add_argument("--model", help="your own .onnx instead of the reference models")
    lat.add_argument("--calib", help=".npz calibration data for --model")
    lat.add_argument("--batch", type=int, default=32)
    lat.add_argument("--repeats", type=int, default=50)
    lat.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    {"latency": latency}[args.what](args)


if __name__ == "__main__":
    main()
