"""Saturation benchmark: u8 x s8 pair saturation on x86 CPUs without VNNI (printed numbers, never a timed test).

    python -m benchmarks.saturation [--models resnet_mini mobilenet_mini transformer transformer_wide] [--batch 32]
                                    [--qemu]

Accuracy (SQNR vs fp32) and latency of oq's onnxruntime-target output for cpu=auto and cpu=avx2, and of
quantize_static (per channel) with and without reduce_range; each judged with onnxruntime's default optimisations
on this CPU (fused integer kernels), with optimisations off (the QDQ graph's float semantics), emulated as an x86
CPU without VNNI computes it (oq.saturation.emulate), and with --qemu really run on AVX2 kernels under
`qemu-x86_64 -cpu Haswell` when it is installed. Needs the reference models (`models/`, run from the repository
root).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

import numpy as np
import onnxruntime as ort

from .common import cpu_flags, median_latency, ort_quantize_static

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
                    ort_quantize_static(path, calib, p, reduce_range=v.endswith("reduce_range"))
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.saturation",
                                description="u8 x s8 pair saturation without VNNI: oq cpu=auto/avx2 vs "
                                            "quantize_static (+reduce_range), accuracy and latency")
    p.add_argument("--models", nargs="+", default=["resnet_mini", "mobilenet_mini", "transformer", "transformer_wide"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--qemu", action="store_true",
                   help="also run each model on real AVX2 kernels under qemu-x86_64 -cpu Haswell (slow)")
    saturation(p.parse_args(argv))


if __name__ == "__main__":
    main()
