"""OpenVINO benchmark (printed ratios, never a timed test).

    python -m benchmarks.openvino [--models resnet_mini mobilenet_mini transformer] [--batch 32] [--repeats 50]

fp32 vs oq's openvino-target output, both compiled by OpenVINO for its CPU plugin; latency medians and SQNR vs fp32.
Needs OpenVINO (`pip install openvino`; without it the benchmark says so and measures nothing) and the reference
models (`models/`, run from the repository root).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from .common import cpu_flags


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
    p = argparse.ArgumentParser(prog="python -m benchmarks.openvino",
                                description="fp32 vs oq's openvino-target output run by OpenVINO (if installed)")
    p.add_argument("--models", nargs="+", default=["resnet_mini", "mobilenet_mini", "transformer"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    openvino_bench(p.parse_args(argv))


if __name__ == "__main__":
    main()
