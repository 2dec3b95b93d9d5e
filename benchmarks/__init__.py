"""oq's benchmarks: they print ratios measured in one run (never timed tests).

Run from the repository root, with oq installed (``pip install -e '.[dev]'``)::

    python -m benchmarks.latency        # fp32 vs oq's onnxruntime output vs onnxruntime.quantization
    python -m benchmarks.saturation     # u8 x s8 pair saturation without VNNI: accuracy and latency
    python -m benchmarks.openvino       # fp32 vs oq's openvino-target output run by OpenVINO
    python -m benchmarks.calibration    # calibration time and peak memory, oq vs onnxruntime.quantization

They use the reference models in ``models/`` (not installed with oq either) unless given a model of your own.
This package is part of the source tree only; it is not in oq's wheel.
"""
