"""``python -m models export|freeze|list`` -- write reference models and their data, or freeze their weights.

``export NAME|all -o DIR`` writes, for every selected model, ``DIR/NAME.onnx``,
``DIR/NAME.calib.npz`` (64 samples, seed 0) and ``DIR/NAME.eval.npz`` (32
samples, seed 1); the npz keys are the ONNX input names.

``freeze [NAME|all]`` trains the selected models (all by default) on this
machine and writes their weight fixtures ``models/weights/NAME.npz``, which
``load_torch`` and ``build`` then use on every machine.  Run it after changing
``zoo.py``, ``data.py`` or ``specs.py``, and commit the fixtures.

``list`` prints the names.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

from . import BENCH_MODELS, REFERENCE_MODELS, SPECS, build, make_inputs

CALIB_SAMPLES, CALIB_SEED = 64, 0
EVAL_SAMPLES, EVAL_SEED = 32, 1
ALL_MODELS = (*REFERENCE_MODELS, *BENCH_MODELS)


def export(names: list[str], out_dir: Path, cache_dir: str | None = None) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        onnx_path = out_dir / f"{name}.onnx"
        shutil.copyfile(build(name, cache_dir), onnx_path)
        written.append(onnx_path)
        for tag, n, seed in (("calib", CALIB_SAMPLES, CALIB_SEED), ("eval", EVAL_SAMPLES, EVAL_SEED)):
            npz_path = out_dir / f"{name}.{tag}.npz"
            np.savez(npz_path, **make_inputs(name, n, seed=seed))
            written.append(npz_path)
    return written


def freeze(names: list[str]) -> list[Path]:
    from .zoo import evaluate, freeze as freeze_one, load_torch

    written = []
    for name in names:
        path, log = freeze_one(name)
        score = evaluate(name, load_torch(name))
        print(f"{path}  {path.stat().st_size / 1024:.0f} KiB, trained in {log['seconds']:.1f} s, "
              f"final loss {log['final_loss']:.4f}, held-out score {score:.3f}")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_exp = sub.add_parser("export", help="export model(s) to ONNX plus calibration/eval inputs")
    p_exp.add_argument("name", choices=[*ALL_MODELS, "all"])
    p_exp.add_argument("-o", "--out", type=Path, default=Path("."), help="output directory (default: .)")
    p_exp.add_argument(
        "--cache-dir", default=None,
        help="ONNX model cache (default: $OQ_MODEL_CACHE, else $XDG_CACHE_HOME/oq/models, else ~/.cache/oq/models)",
    )
    p_frz = sub.add_parser("freeze", help="train model(s) on this machine and write models/weights/NAME.npz")
    p_frz.add_argument("name", nargs="?", default="all", choices=[*ALL_MODELS, "all"])
    sub.add_parser("list", help="list the reference models")
    args = parser.parse_args(argv)

    if args.cmd == "list":
        for name in ALL_MODELS:
            print(f"{name:16s} {SPECS[name].description}")
        return 0
    if args.cmd == "freeze":
        freeze(list(ALL_MODELS) if args.name == "all" else [args.name])
        return 0
    names = list(REFERENCE_MODELS) if args.name == "all" else [args.name]
    for path in export(names, args.out, args.cache_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
