"""Calibration benchmark: oq's streaming calibration vs onnxruntime.quantization, same model and data.

    python -m benchmarks.calibration [--samples 64 1024] [--batch-size 16] [--methods minmax entropy percentile mse]
                                     [--repeats 3] [--model M.onnx [--calib DATA.npz | --input NAME --shape C H W]]
                                     [--reference resnet_mini]

Each measurement runs in a fresh child process (so peak RSS belongs to that run alone). Data: by default the same
deterministic synthetic images, generated per batch, so the data set itself never sits in memory; with --calib, the
samples stacked along axis 0 of your .npz (every row loads it, so its size counts in every row alike; --samples is
capped at its length); --reference NAME takes a reference model and its own inputs. Rows: the plain fp32
onnxruntime pass over the data, oq (tensorrt target) with each method, onnxruntime.quantization.quantize_static
(QDQ, its defaults) with the matching CalibrationMethod. Default model: the trained mobilenet_mini re-exported at
224x224 (its convolutions and global pooling take any size). Run from the repository root: the default model and
--reference need `models/`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ORT_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile", "mse": None}


def synthetic_batch(seed: int, start: int, count: int, shape: tuple[int, ...]) -> np.ndarray:
    """Smooth random images: a coarse random field upsampled by repetition plus fine noise, per sample seed."""
    c, h, w = shape
    out = np.empty((count, c, h, w), np.float32)
    for k in range(count):
        rng = np.random.default_rng((seed, start + k))
        coarse = rng.standard_normal((c, h // 16 + 1, w // 16 + 1)).astype(np.float32)
        out[k] = np.repeat(np.repeat(coarse, 16, 1), 16, 2)[:, :h, :w] + 0.3 * rng.standard_normal((c, h, w))
    return out


def feeds(name: str, n: int, batch: int, shape):
    for start in range(0, n, batch):
        yield {name: synthetic_batch(0, start, min(batch, n - start), shape)}


def _stream(args, batch: int):
    """Feeds of `batch` samples (the last one shorter): from --calib when given, else synthetic images."""
    if not args.calib:
        yield from feeds(args.input, args.n, batch, tuple(args.shape))
        return
    with np.load(args.calib) as npz:
        data = {k: npz[k] for k in npz.files}
    for start in range(0, args.n, batch):
        yield {k: v[start:min(start + batch, args.n)] for k, v in data.items()}


def _child(args) -> dict:
    """One measurement; prints JSON with wall seconds and peak RSS."""
    import onnxruntime as ort

    start = time.perf_counter()
    if args.what == "fp32":
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(args.model, so, providers=["CPUExecutionProvider"])
        for feed in _stream(args, args.batch):
            sess.run(None, feed)
    elif args.what == "oq":
        import oq

        def source():  # one sample at a time: oq groups them into batches itself
            yield from _stream(args, 1)
        oq.quantize(args.model, "tensorrt", source, batch_size=args.batch, calib_method=args.method, progress=False)
    else:
        import logging

        logging.getLogger().setLevel(logging.ERROR)
        from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, quantize_static

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.it = _stream(args, args.batch)

            def get_next(self):
                return next(self.it, None)
        with tempfile.TemporaryDirectory() as tmp:
            quantize_static(args.model, f"{tmp}/q.onnx", Reader(), quant_format=QuantFormat.QDQ,
                            calibrate_method=getattr(CalibrationMethod, ORT_METHODS[args.method]))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_mb": _peak_rss_mb()}


def _peak_rss_mb() -> float:
    """VmHWM of this process image. (getrusage's ru_maxrss survives exec on Linux, so a child started from a big
    parent would report the parent's peak.)"""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _measure(what: str, method: str, model: str, data: list[str], n: int, batch: int, repeats: int = 1) -> dict:
    """Median seconds and median peak memory over `repeats` fresh processes (the machine is noisy). `data`: the
    child's data arguments (--calib, or --input and --shape)."""
    cmd = [sys.executable, "-m", "benchmarks.calibration", "--child", what, "--method", method, "--model", model,
           *data, "--n", str(n), "--batch", str(batch)]
    # the child imports this package from the repository root, whatever the current directory
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    runs = []
    for _ in range(repeats):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:120]}
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {key: float(np.median([r[key] for r in runs])) for key in ("seconds", "peak_mb")}


def export_mobilenet_224(path: Path) -> None:
    import torch

    import models

    model = models.load_torch("mobilenet_mini").eval()
    torch.onnx.export(model, torch.zeros(1, 3, 224, 224), str(path), input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17, dynamo=False,
                      training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.calibration")
    p.add_argument("--samples", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--methods", nargs="+", default=["minmax", "entropy", "percentile", "mse"])
    p.add_argument("--model", help="your .onnx; default: mobilenet_mini at 224x224")
    p.add_argument("--calib", help="an .npz of samples stacked along axis 0, keyed by input name (with --model)")
    p.add_argument("--reference", help="a reference model from models/ with its own inputs, instead of --model")
    p.add_argument("--input", default="input", help="synthetic data: the image input's name")
    p.add_argument("--shape", type=int, nargs=3, default=[3, 224, 224], help="synthetic data: C H W of one sample")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per row; medians are printed")
    p.add_argument("--ort-max-samples", type=int, default=256,
                   help="skip onnxruntime.quantization's histogram methods above this many samples: they keep every "
                        "batch's outputs and exhaust memory (about 45 MB per 224x224 sample here)")
    p.add_argument("--child", choices=["fp32", "oq", "ort"], help=argparse.SUPPRESS)
    p.add_argument("--method", default="minmax", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.what = args.child
        print(json.dumps(_child(args)))
        return
    from .common import cpu_flags

    with tempfile.TemporaryDirectory() as tmp:
        model, calib, label = args.model, args.calib, args.model or "mobilenet_mini@224"
        if args.reference:
            import models

            model, label = str(models.build(args.reference)), args.reference
            calib = f"{tmp}/{args.reference}.npz"
            np.savez(calib, **models.make_inputs(args.reference, max(args.samples)))
        elif model is None:
            model = f"{tmp}/mobilenet_224.onnx"
            export_mobilenet_224(Path(model))
        data = ["--input", args.input, "--shape", *map(str, args.shape)]
        samples = list(args.samples)
        if calib:
            data = ["--calib", str(calib)]
            with np.load(calib) as npz:
                available = min(npz[k].shape[0] for k in npz.files)
            samples = sorted({min(n, available) for n in samples})
        print(f"CPU: {cpu_flags()}; model {label}; data {calib or 'synthetic images'}; batch {args.batch_size}; "
              f"each row the median of {args.repeats} fresh processes")
        print(f"{'samples':>8} {'run':<18}{'seconds':>9}{'peak MB':>9}{'x fp32 time':>12}{'oq vs ort time':>16}"
              f"{'oq vs ort mem':>15}")
        for n in samples:
            rep = args.repeats
            base = _measure("fp32", "-", model, data, n, args.batch_size, rep)
            print(f"{n:>8} {'fp32 pass':<18}{base['seconds']:>9.2f}{base['peak_mb']:>9.0f}")
            for method in args.methods:
                mine = _measure("oq", method, model, data, n, args.batch_size, rep)
                if not ORT_METHODS[method]:
                    theirs = {"error": "no matching method"}
                elif method != "minmax" and n > args.ort_max_samples:
                    theirs = {"error": f"skipped above --ort-max-samples {args.ort_max_samples}"}
                else:
                    theirs = _measure("ort", method, model, data, n, args.batch_size, rep)
                if "error" in mine:
                    print(f"{n:>8} {'oq ' + method:<18} error: {mine['error']}")
                    continue
                line = (f"{n:>8} {'oq ' + method:<18}{mine['seconds']:>9.2f}{mine['peak_mb']:>9.0f}"
                        f"{mine['seconds'] / base['seconds']:>12.2f}")
                if "error" not in theirs:
                    line += (f"{theirs['seconds'] / mine['seconds']:>15.1f}x"
                             f"{theirs['peak_mb'] / mine['peak_mb']:>14.1f}x")
                print(line)
                if "error" in theirs:
                    print(f"{n:>8} {'ort ' + method:<18} {theirs['error']}")
                else:
                    print(f"{n:>8} {'ort ' + method:<18}{theirs['seconds']:>9.2f}{theirs['peak_mb']:>9.0f}"
                          f"{theirs['seconds'] / base['seconds']:>12.2f}")


if __name__ == "__main__":
    main()
