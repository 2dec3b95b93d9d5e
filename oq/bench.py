"""Benchmarks that print ratios measured in one run (never timed tests).

    python -m oq.bench latency [--models resnet_mini mobilenet_mini transformer_wide] [--batch 32] [--repeats 50]
    python -m oq.bench saturation [--models resnet_mini mobilenet_mini transformer transformer_wide] [--batch 32] [--qemu]

latency: fp32 vs oq's onnxruntime-target output vs onnxruntime.quantization.quantize_static (its CPU defaults), all
run with onnxruntime's default optimisations on this CPU; medians and ratios to fp32.
saturation: accuracy (SQNR vs fp32) and latency of oq's onnxruntime-target output for cpu=auto and cpu=avx2, and of
quantize_static (per channel) with and without reduce_range; each judged with onnxruntime's default optimisations
on this CPU (fused integer kernels), with optimisations off (the QDQ graph's float semantics), emulated as an x86
CPU without VNNI computes it (oq.saturation.emulate), and with --qemu really run on AVX2 kernels under
`qemu-x86_64 -cpu Haswell` when it is installed.
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
    from .saturation.cpu import cpu_flag_set

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


def _ort_quantize_static(model_path: str, calib: dict, out: str, reduce_range: bool = False) -> None:
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
            _ort_quantize_static(path, calib, ortq_path)
            # interleave repeats of the three so machine noise hits them alike
            t = {k: [] for k in ("fp32", "oq", "ortq")}
            for _ in range(3):
                for k, p in (("fp32", path), ("oq", oq_path), ("ortq", ortq_path)):
                    t[k].append(median_latency(p, feed, args.repeats, args.threads))
            fp, q, oq_ = (statistics.median(t[k]) * 1e3 for k in ("fp32", "oq", "ortq"))
            print(f"{name:<18}{fp:>10.3f}{q:>10.3f}{oq_:>10.3f}{q / fp:>10.2f}{q / oq_:>10.2f}")


_QEMU_RUNNER = """
import sys, numpy as np, onnxruntime as ort
so = ort.SessionOptions(); so.log_severity_level = 3; so.intra_op_num_threads = 1
out = {}
for item in sys.argv[2:]:
    key, model, feed = item.split("::")
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    out[key] = sess.run(None, dict(np.load(feed)))[0]
np.savez(sys.argv[1], **out)
"""


def _run_on_avx2_qemu(jobs: dict[str, tuple[str, str]], tmp: str) -> dict[str, np.ndarray] | None:
    """Run each (model, feed .npz) with onnxruntime's default optimisations under qemu emulating a Haswell CPU
    (AVX2, no AVX-512, no VNNI): onnxruntime then picks its real AVX2 kernels. None when qemu is missing."""
    import shutil
    import subprocess
    import sys

    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        return None
    out = f"{tmp}/qemu_out.npz"
    cmd = [qemu, "-cpu", "Haswell", sys.executable, "-c", _QEMU_RUNNER, out] + \
          [f"{k}::{m}::{f}" for k, (m, f) in jobs.items()]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"qemu run failed: {proc.stderr.strip().splitlines()[-1:]}")
        return None
    return dict(np.load(out))


def saturation(args) -> None:
    import onnx

    import models
    import oq
    from oq import saturation as sat

    def sqnr(ref, x):
        ref = np.asarray(ref, np.float64)
        noise = float(((ref - np.asarray(x, np.float64)) ** 2).sum())
        return float("inf") if noise == 0 else 10 * np.log10(float((ref ** 2).sum()) / noise)

    def run(path, feed, optimize):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if not optimize:
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, feed)[0]

    kind, how = sat.detect_cpu()
    print(f"CPU: {cpu_flags()} -> {kind} ({how}); onnxruntime {ort.__version__}; threads {args.threads}; "
          f"batch {args.batch}; latency: median of {args.repeats} runs x3 interleaved")
    print("SQNR dB vs fp32 on held-out inputs. fused: onnxruntime default optimisations on this CPU; unfused: "
          "optimisations off; avx2-emul: fused kernels as an x86 CPU without VNNI computes them (numpy emulation, "
          "host-independent)" + ("; avx2-qemu: onnxruntime really run on AVX2 under qemu -cpu Haswell"
                                 if args.qemu else ""))
    head = f"{'model':<18}{'variant':<22}{'fused':>8}{'unfused':>9}{'avx2-emul':>11}"
    head += f"{'avx2-qemu':>11}" if args.qemu else ""
    head += f"{'ms':>9}{'/fp32':>7}  weight channels reduced"
    print(head)
    variants = ("oq cpu=auto", "oq cpu=avx2", "ort-q", "ort-q reduce_range")
    with tempfile.TemporaryDirectory() as tmp:
        rows, jobs = [], {}
        for name in args.models:
            path = str(models.build(name))
            calib = models.make_inputs(name, 64)
            feed = models.make_inputs(name, args.batch, seed=1)
            np.savez(f"{tmp}/{name}.calib.npz", **calib)
            np.savez(f"{tmp}/{name}.feed.npz", **feed)
            paths, notes = {"fp32": path}, {}
            for v in variants:
                p = f"{tmp}/{name}.{v.replace(' ', '_').replace('=', '_')}.onnx"
                if v.startswith("oq"):
                    r = oq.quantize(path, "onnxruntime", f"{tmp}/{name}.calib.npz", progress=False,
                                    cpu=v.split("=")[1])
                    r.save(p)
                    rec = r.report.calibration.get("saturation", {})
                    guarded = rec.get("layers_guarded", [])
                    n, n7 = (sum(e[k] for e in guarded) for k in ("channels_reduced", "channels_7bit"))
                    notes[v] = f"{n} ({n7} at 7 bits) in {len(guarded)} layers, cpu {rec.get('deployment_cpu')}"
                else:
                    _ort_quantize_static(path, calib, p, reduce_range=v.endswith("reduce_range"))
                    notes[v] = "all to 7 bits" if v.endswith("reduce_range") else "none"
                paths[v] = p
                jobs[f"{name}|{v}"] = (p, f"{tmp}/{name}.feed.npz")
            ref = run(path, feed, False)
            t = {k: [] for k in paths}
            for _ in range(3):
                for k, p in paths.items():
                    t[k].append(median_latency(p, feed, args.repeats, args.threads))
            ms = {k: statistics.median(v) * 1e3 for k, v in t.items()}
            for v in variants:
                m = onnx.load(paths[v])
                rows.append((name, v, sqnr(ref, run(paths[v], feed, True)), sqnr(ref, run(paths[v], feed, False)),
                             sqnr(ref, sat.emulate(m, feed)[0]), ms[v], ms[v] / ms["fp32"], notes[v], ref))
            rows.append((name, "fp32", None, None, None, ms["fp32"], 1.0, "", ref))
        measured = _run_on_avx2_qemu(jobs, tmp) if args.qemu else None
        if args.qemu and measured is None:
            print("(--qemu: qemu-x86_64 not found or failed; avx2-qemu column left empty)")
        for name, v, fused, unfused, emul, ms, ratio, note, ref in rows:
            cells = [f"{x:>8.2f}" if x is not None else f"{'':>8}" for x in (fused,)]
            line = f"{name:<18}{v:<22}{cells[0]}"
            line += f"{unfused:>9.2f}{emul:>11.2f}" if unfused is not None else f"{'':>9}{'':>11}"
            if args.qemu:
                got = measured.get(f"{name}|{v}") if measured else None
                line += f"{sqnr(ref, got):>11.2f}" if got is not None else f"{'':>11}"
            line += f"{ms:>9.3f}{ratio:>7.2f}  {note}"
            print(line)


def openvino_bench(args) -> None:
    """fp32 vs oq's openvino-target output, both compiled by OpenVINO for its CPU plugin; SQNR vs fp32."""
    try:
        import openvino as ov
    except ImportError:
        print("openvino is not installed (pip install openvino); nothing to measure")
        return
    import oq
    import models

    core = ov.Core()
    print(f"CPU: {cpu_flags()}; OpenVINO {ov.__version__}; threads {args.threads}; batch {args.batch}; "
          f"median of {args.repeats} runs")
    print(f"{'model':<18}{'fp32 ms':>10}{'int8 ms':>10}{'int8/fp32':>11}{'SQNR dB':>9}")
    config = {"INFERENCE_NUM_THREADS": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = str(models.build(name))
            calib_path = f"{tmp}/{name}.npz"
            np.savez(calib_path, **models.make_inputs(name, 64))
            q_path = f"{tmp}/{name}.ov.onnx"
            oq.quantize(path, "openvino", calib_path, progress=False).save(q_path)
            feed = models.make_inputs(name, args.batch, seed=1)
            compiled = {k: core.compile_model(core.read_model(p), "CPU", config) for k, p in (("fp32", path),
                                                                                             ("int8", q_path))}
            outputs, times = {}, {}
            for k, c in compiled.items():
                request = c.create_infer_request()
                for _ in range(5):
                    request.infer(feed)
                t = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    request.infer(feed)
                    t.append(time.perf_counter() - start)
                times[k] = statistics.median(t) * 1e3
                outputs[k] = np.array(request.get_output_tensor(0).data)
            ref, got = outputs["fp32"].astype(np.float64), outputs["int8"].astype(np.float64)
            sqnr = 10 * np.log10((ref ** 2).sum() / max(((ref - got) ** 2).sum(), 1e-30))
            print(f"{name:<18}{times['fp32']:>10.3f}{times['int8']:>10.3f}{times['int8'] / times['fp32']:>11.2f}"
                  f"{sqnr:>9.1f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m oq.bench")
    sub = p.add_subparsers(dest="what", required=True)
    lat = sub.add_parser("latency", help="fp32 vs oq (onnxruntime target) vs onnxruntime.quantization")
    lat.add_argument("--models", nargs="+", default=["resnet_mini", "mobilenet_mini", "transformer_wide"])
    lat.add_argument("--model", help="your own .onnx instead of the reference models")
    lat.add_argument("--calib", help=".npz calibration data for --model")
    lat.add_argument("--batch", type=int, default=32)
    lat.add_argument("--repeats", type=int, default=50)
    lat.add_argument("--threads", type=int, default=2)
    sat = sub.add_parser("saturation", help="u8 x s8 pair saturation without VNNI: oq cpu=auto/avx2 vs "
                                            "quantize_static (+reduce_range), accuracy and latency")
    sat.add_argument("--models", nargs="+",
                     default=["resnet_mini", "mobilenet_mini", "transformer", "transformer_wide"])
    sat.add_argument("--batch", type=int, default=32)
    sat.add_argument("--repeats", type=int, default=30)
    sat.add_argument("--threads", type=int, default=2)
    sat.add_argument("--qemu", action="store_true",
                     help="also run each model on real AVX2 kernels under qemu-x86_64 -cpu Haswell (slow)")
    ovb = sub.add_parser("openvino", help="fp32 vs oq's openvino-target output run by OpenVINO (if installed)")
    ovb.add_argument("--models", nargs="+", default=["resnet_mini", "mobilenet_mini", "transformer"])
    ovb.add_argument("--batch", type=int, default=32)
    ovb.add_argument("--repeats", type=int, default=50)
    ovb.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    {"latency": latency, "saturation": saturation, "openvino": openvino_bench}[args.what](args)


if __name__ == "__main__":
    main()
