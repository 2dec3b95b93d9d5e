"""Reconstruction speed benchmark: oq's weight rounding on an EfficientNet-B0-shaped model (5.3 M parameters, 81
Conv nodes, models/efficientnet.py) for the tensorrt target, against round-to-nearest.

    python -m benchmarks.recon_speed [--algo qdrop] [--samples 256] [--resolution 224] [--device cpu]
                                     [--held-out 64] [--cores N] [--timeout S] [--cache-dir DIR]

The model (seeded random weights) and its data (seeded synthetic images: calibration seed 0, held-out seed 1) are
built once and cached in --cache-dir (default $XDG_CACHE_HOME/oq/bench, else ~/.cache/oq/bench), keyed by the
sources that determine them. Each algorithm ("rtn" first, as the baseline, then --algo) runs
`oq.quantize(model, target="tensorrt", calib=NPZ, algo=ALGO, device=DEVICE, output=OUT)` with every other option
at its default, in a fresh child process. Reported per run: the wall time of the oq.quantize call and of the whole
child process, the child's peak resident memory (VmHWM from its own /proc/self/status at the end; getrusage's
RUSAGE_CHILDREN would be a maximum over all children so far, the baseline's included), and the SQNR of the output
logits vs fp32 on the held-out samples (onnxruntime, graph optimisations disabled). An algorithm oq does not know
is reported with oq's message and skipped. The goal checked (PASS/FAIL, exit status 1 on FAIL): --algo qdrop on 256
samples at 224x224 finishes, child process included, in under 15 minutes on a 2-core CPU (--cores 2 pins the
child to two CPUs on a bigger machine; the load average printed first shows whether other work shared them;
--timeout S stops a run after S seconds and counts it as failed).

The weights are random, and a random B0 is far more fragile than a trained one: every quantized activation adds
noise that the following layers amplify, so round-to-nearest W8A8 gives only about 5-7 dB here. The SQNR column
shows whether reconstruction helps and that nothing broke; it says nothing about accuracy on trained models.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GOAL = {"algo": "qdrop", "samples": 256, "resolution": 224, "cores": 2, "seconds": 15 * 60}


def cpu_line() -> str:
    """Model name, the vector/VNNI flags (as grep -o -w 'avx2|avx512f|avx512_vnni|avx_vnni' | sort -u) and cores."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    flags = sorted(set(re.findall(r"\b(avx2|avx512f|avx512_vnni|avx_vnni)\b", text)))
    name = next((l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("model name")), "?")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"CPU: {name}; flags: {' '.join(flags) or 'none'}; cores: {os.cpu_count()} ({usable} usable); load {load}"


def cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache") / "oq" / "bench"


def prepare(folder: Path, samples: int, held_out: int, resolution: int) -> tuple[Path, Path, Path]:
    """(model, calibration .npz, held-out .npz), built on a cache miss."""
    from importlib import metadata

    from models import efficientnet

    h = hashlib.sha256(f"torch={metadata.version('torch')}\0res={resolution}\0".encode())
    for name in ("efficientnet.py", "data.py", "_export.py", "specs.py"):
        h.update((ROOT / "models" / name).read_bytes())
    stem = f"efficientnet_b0-{resolution}-{h.hexdigest()[:12]}"
    folder.mkdir(parents=True, exist_ok=True)
    model, calib, held = (folder / f"{stem}.onnx", folder / f"{stem}-calib{samples}.npz",
                          folder / f"{stem}-held{held_out}.npz")
    if not model.is_file():
        efficientnet.build_onnx(model, resolution)
    if not calib.is_file():
        efficientnet.write_images(calib, samples, resolution, seed=0)
    if not held.is_file():
        efficientnet.write_images(held, held_out, resolution, seed=1)
    return model, calib, held


def _child(args) -> dict:
    import oq

    start = time.perf_counter()
    oq.quantize(args.model, target="tensorrt", calib=args.calib, algo=args.algo, device=args.device,
                output=args.output, progress=False)
    seconds = time.perf_counter() - start
    hwm = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
    return {"seconds": seconds, "peak_mb": int(hwm.split()[1]) / 1024}


def run_child(args, algo: str, model: Path, calib: Path, output: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.recon_speed", "--child", "--algo", algo, "--device", args.device,
           "--model", str(model), "--calib", str(calib), "--output", str(output)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    pin = None
    if args.cores:
        env["OMP_NUM_THREADS"] = str(args.cores)
        cpus = sorted(os.sched_getaffinity(0))[:args.cores]
        pin = lambda: os.sched_setaffinity(0, cpus)  # noqa: E731
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, preexec_fn=pin,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after --timeout {args.timeout:g} s"}
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": wall}


def logits(model: Path, data: np.ndarray, batch: int = 16) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return np.concatenate([sess.run(None, {name: data[i:i + batch]})[0] for i in range(0, len(data), batch)])


def sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return float(10 * np.log10((ref ** 2).sum() / max(((ref - got) ** 2).sum(), 1e-30)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recon_speed")
    p.add_argument("--algo", default="qdrop", help="the reconstruction to time (rtn runs too, as the baseline)")
    p.add_argument("--samples", type=int, default=256, help="calibration samples")
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--device", default="cpu")
    p.add_argument("--held-out", type=int, default=64, help="samples the SQNR is measured on")
    p.add_argument("--cores", type=int, help="pin the quantizing process to this many CPUs (default: all)")
    p.add_argument("--timeout", type=float, help="seconds after which a run is stopped (default: none)")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: ~/.cache/oq/bench")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--calib", help=argparse.SUPPRESS)
    p.add_argument("--output", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    import oq

    cores = args.cores or len(os.sched_getaffinity(0))
    print(cpu_line() + (f"; quantizing on {cores} pinned" if args.cores else ""))
    start = time.perf_counter()
    model, calib, held = prepare(args.cache_dir or cache_dir(), args.samples, args.held_out, args.resolution)
    with np.load(held) as npz:
        held_data = next(iter(npz.values()))
    ref = logits(model, held_data)
    print(f"model: EfficientNet-B0-shaped, {args.resolution}x{args.resolution}, {model}; {args.samples} calibration "
          f"samples, {args.held_out} held out; ready in {time.perf_counter() - start:.1f} s")
    print(f"{'algo':<10}{'quantize s':>11}{'process s':>11}{'peak MB':>9}{'SQNR dB':>9}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in dict.fromkeys(["rtn", args.algo]):
            try:
                oq.RunConfig(algo=algo, device=args.device)
            except oq.OqError as exc:
                print(f"{algo:<10}oq: error: {exc}")
                continue
            out = Path(tmp) / f"q-{algo}.onnx"
            r = run_child(args, algo, model, calib, out)
            if "error" in r:
                print(f"{algo:<10}failed: {r['error']}")
                continue
            r["sqnr"] = sqnr_db(ref, logits(out, held_data))
            results[algo] = r
            print(f"{algo:<10}{r['seconds']:>11.1f}{r['process_s']:>11.1f}{r['peak_mb']:>9.0f}{r['sqnr']:>9.2f}")
    base, mine = results.get("rtn"), results.get(args.algo)
    if base and mine and args.algo != "rtn":
        print(f"{args.algo} / rtn: time x{mine['seconds'] / base['seconds']:.1f}, peak memory "
              f"x{mine['peak_mb'] / base['peak_mb']:.2f}, SQNR {mine['sqnr'] - base['sqnr']:+.2f} dB")
    setting = {"algo": args.algo, "samples": args.samples, "resolution": args.resolution, "cores": cores}
    differs = [f"{k} {v} (goal {GOAL[k]})" for k, v in setting.items() if v != GOAL[k]]
    note = f"; this run differs from the goal's setting: {', '.join(differs)}" if differs else ""
    if mine is None:
        print(f"goal ({GOAL['algo']}, {GOAL['samples']} samples, {GOAL['resolution']}x{GOAL['resolution']}, "
              f"{GOAL['cores']} cores, under {GOAL['seconds'] // 60} min): FAIL: {args.algo} did not run{note}")
        return 1
    ok = mine["process_s"] < GOAL["seconds"]
    print(f"goal ({GOAL['algo']}, {GOAL['samples']} samples, {GOAL['resolution']}x{GOAL['resolution']}, "
          f"{GOAL['cores']} cores, under {GOAL['seconds'] // 60} min): {'PASS' if ok else 'FAIL'}: {args.algo} took "
          f"{mine['process_s']:.1f} s{note}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
