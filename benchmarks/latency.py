"""Latency benchmark (printed ratios, never a timed test).

    python -m benchmarks.latency [--models resnet_mini mobilenet_mini transformer_wide] [--batch 32] [--repeats 50]
    python -m benchmarks.latency --model M.onnx --calib DATA.npz

fp32 vs oq's onnxruntime-target output vs onnxruntime.quantization.quantize_static (its CPU defaults), all run with
onnxruntime's default optimisations on this CPU; medians and ratios to fp32. Needs the reference models (`models/`,
run from the repository root) or --model/--calib for your own.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .common import cpu_flags, median_latency, ort_quantize_static


def latency(args) -> None:
    import oq

    print(f"CPU: {cpu_flags()}; onnxruntime {ort.__version__}; threads {args.threads}; batch {args.batch}; "
          f"median of {args.repeats} runs")
    print(f"{'model':<18}{'fp32 ms':>10}{'oq ms':>10}{'ort-q ms':>10}{'oq/fp32':>10}{'oq/ort-q':>10}")
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
            ort_quantize_static(path, calib, ortq_path)
            # interleave repeats of the three so machine noise hits them alike
            t = {k: [] for k in ("fp32", "oq", "ortq")}
            for _ in range(3):
                for k, p in (("fp32", path), ("oq", oq_path), ("ortq", ortq_path)):
                    t[k].append(median_latency(p, feed, args.repeats, args.threads))
            fp, q, oq_ = (statistics.median(t[k]) * 1e3 for k in ("fp32", "oq", "ortq"))
            print(f"{name:<18}{fp:>10.3f}{q:>10.3f}{oq_:>10.3f}{q / fp:>10.2f}{q / oq_:>10.2f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.latency",
                                description="fp32 vs oq (onnxruntime target) vs onnxruntime.quantization")
    p.add_argument("--models", nargs="+", default=["resnet_mini", "mobilenet_mini", "transformer_wide"])
    p.add_argument("--model", help="your own .onnx instead of the reference models")
    p.add_argument("--calib", help=".npz calibration data for --model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    latency(p.parse_args(argv))


if __name__ == "__main__":
    main()
