"""Long runs kept out of the default suite (`python -m pytest -m slow tests/test_slow.py`).

Interrupted runs: a model of a few hundred MB is quantized again and again with options that change the output, and
each run gets SIGINT or SIGKILL at a seeded random point (start-up, preparation, calibration, the final save, after
the model is in place). After each one the output folder must hold the previous output set or the new one, whole.
The few microseconds between renaming the side files and the model into place are widened in a child (each rename
pauses) to check that an interrupt there too leaves one whole set.

Models over 2 GB: large initializers kept in external data, quantized for tensorrt and onnxruntime with and
without `--exclude '.*'`; each output must load in onnxruntime and agree with the float model.

Both print what they measured (run with `-s` to see it).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
TEMP_PREFIX = ".oq-tmp-"

pytestmark = pytest.mark.slow


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def oq_command(*args) -> list[str]:
    return [sys.executable, "-m", "oq.cli", *map(str, args)]


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def plain_mode(folder: Path) -> int:
    """The mode a plain open() gives in `folder` (what oq's outputs must have)."""
    probe = folder / "plain-mode-probe"
    probe.write_bytes(b"x")
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    return mode


# ---------------------------------------------------------------------------------------------------------------
# interrupted runs


def build_chain(path: Path, width: int, layers: int, samples: int, seed: int = 0) -> Path:
    """Gemm+Relu layers of width x width float32 weights (layers * width**2 * 4 bytes) and an .npz of samples."""
    rng = np.random.default_rng(seed)
    inits, nodes, cur = [], [], "x"
    for i in range(layers):
        w = rng.standard_normal((width, width), dtype=np.float32) / np.float32(np.sqrt(width))
        b = rng.standard_normal(width, dtype=np.float32) * np.float32(0.1)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        out = "y" if i == layers - 1 else f"h{i}"
        nodes += [helper.make_node("Gemm", [cur, f"w{i}", f"b{i}"], [f"g{i}"], name=f"fc{i}"),
                  helper.make_node("Relu", [f"g{i}"], [out], name=f"relu{i}")]
        cur = out
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", width])], inits)
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    calib = path.with_suffix(".npz")
    np.savez(calib, x=rng.standard_normal((samples, width), dtype=np.float32))
    return calib


def normalized_report(path: Path) -> str:
    """The report without its timings (pass and calibration seconds vary from run to run)."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "seconds"}
        if isinstance(value, list):
            return [strip(v) for v in value]
        if isinstance(value, str):
            return re.sub(r"\b\d+\.\d+s\b", "<t>s", value)
        return value

    data = strip(json.loads(path.read_text()))
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


class OutputSet:
    """out.onnx, its two tensorrt side files and the report, in one folder."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.model = folder / "out.onnx"
        self.report = folder / "r.json"
        self.side = [folder / "out.calib.cache", folder / "out.ranges.json"]

    def files(self) -> list[Path]:
        return [self.model, *self.side, self.report]

    def raw(self) -> dict[str, str | None]:
        return {p.name: sha(p) if p.exists() else None for p in self.files()}

    def fingerprint(self) -> dict[str, str | None]:
        """Byte hashes of the model and side files, the report's hash without timings."""
        out = {p.name: sha(p) if p.exists() else None for p in [self.model, *self.side]}
        out[self.report.name] = normalized_report(self.report) if self.report.exists() else None
        return out

    def temporaries(self) -> list[str]:
        return sorted(p.name for p in self.folder.iterdir() if p.name.startswith(TEMP_PREFIX))


def temp_pid(name: str) -> int:
    return int(name[len(TEMP_PREFIX):].split("-", 1)[0])


class Watched:
    """One `oq run` child, with the moments its save started (its staging folder appeared) and its model was put
    in place (out.onnx replaced), as seen by polling the output folder."""

    def __init__(self, outputs: OutputSet, args: list[str], log: Path):
        self.outputs = outputs
        self.ino = outputs.model.stat().st_ino if outputs.model.exists() else None
        self.stderr = open(log, "w+")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(oq_command(*args), stdout=subprocess.DEVNULL, stderr=self.stderr, cwd=ROOT,
                                     env=child_env())
        self.stage_at: float | None = None
        self.placed_at: float | None = None

    def poll_folder(self) -> None:
        now = time.monotonic() - self.t0
        if self.stage_at is None:
            mine = f"{TEMP_PREFIX}{self.proc.pid}-"
            if any(name.startswith(mine) for name in os.listdir(self.outputs.folder)):
                self.stage_at = now
        if self.placed_at is None:
            try:
                if self.outputs.model.stat().st_ino != self.ino:
                    self.placed_at = now
                    self.stage_at = now if self.stage_at is None else self.stage_at
            except FileNotFoundError:
                pass

    def phase(self) -> str:
        self.poll_folder()
        if self.proc.poll() is not None:
            return "exited"
        if self.placed_at is not None:
            return "after-rename"
        return "save" if self.stage_at is not None else "before-save"

    def wait_until(self, predicate, deadline: float) -> None:
        """Poll every few ms until predicate() holds, the child exits or `deadline` (seconds since the start)."""
        while time.monotonic() - self.t0 < deadline and self.proc.poll() is None:
            self.poll_folder()
            if predicate():
                return
            time.sleep(0.003)
        self.poll_folder()

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        rc = self.proc.wait(timeout)
        self.poll_folder()
        self.stderr.seek(0)
        err = self.stderr.read()
        self.stderr.close()
        return rc, err


def startup_interrupt(err: str) -> bool:
    """A KeyboardInterrupt traceback raised while the interpreter was still importing, before oq's main() ran."""
    return (err.rstrip().endswith("KeyboardInterrupt") and "oq: " not in err
            and not re.search(r'oq/cli\.py", line \d+, in (main|_run)', err))


def test_interrupted_runs_leave_the_previous_outputs_or_the_new_ones(tmp_path):
    started = time.monotonic()
    seed = int(os.environ.get("OQ_SLOW_SEED", "20240611"))
    runs, budget_s = 30, 720
    rng = random.Random(seed)
    inputs, folder, logs = tmp_path / "in", tmp_path / "out", tmp_path / "logs"
    for d in (inputs, folder, logs):
        d.mkdir()
    model = inputs / "chain.onnx"
    calib = build_chain(model, width=4096, layers=5, samples=64)  # 336 MB of float32 weights
    outputs = OutputSet(folder)
    options = {"a": ["--calib-size", "32"], "b": ["--calib-size", "64"]}

    def args(key):
        return ["run", model, "--calib", calib, "-o", outputs.model, "--report", outputs.report, "-q", *options[key]]

    # the two output sets, from uninterrupted runs, and where the save falls in a run
    expected, timing = {}, {}
    for key in ("a", "b"):
        w = Watched(outputs, args(key), logs / f"ref-{key}.log")
        w.wait_until(lambda: False, 600)
        rc, err = w.finish()
        assert rc == 0, err
        expected[key] = outputs.fingerprint()
        timing[key] = (w.stage_at, w.placed_at, time.monotonic() - w.t0)
        assert not outputs.temporaries()
    for name in expected["a"]:
        assert expected["a"][name] != expected["b"][name], f"{name} does not depend on --calib-size"
    total = max(t[2] for t in timing.values())
    save = max(t[1] - t[0] for t in timing.values() if t[0] is not None and t[1] is not None)
    save = max(save, 0.05)
    print(f"\nreference runs (stage seen, model placed, exit) in s: {timing}; seed {seed}")

    current = "b"
    counts: dict[str, int] = {}
    rows, problems = [], []

    def count(key):
        counts[key] = counts.get(key, 0) + 1

    signals = [signal.SIGINT, signal.SIGKILL] * (runs // 2)
    rng.shuffle(signals)
    for i, sig in enumerate(signals):
        if time.monotonic() - started > budget_s:
            break
        new = "a" if current == "b" else "b"
        before_raw, before_temps = outputs.raw(), set(outputs.temporaries())
        mode = rng.choice(["anywhere", "anywhere", "save", "save", "tail"])
        w = Watched(outputs, args(new), logs / f"run-{i}.log")
        if mode == "anywhere":  # uniformly over the whole run, start-up included
            w.wait_until(lambda: False, rng.uniform(0, total * 1.05))
        elif mode == "save":  # a random point of the final save, from the moment its staging folder appears
            w.wait_until(lambda: w.stage_at is not None, total * 3)
            delay = rng.uniform(0, save * 1.2)
            w.wait_until(lambda: False, (w.stage_at or 0) + delay)
        else:  # around the renames and the exit that follows
            w.wait_until(lambda: w.placed_at is not None, total * 3)
            w.wait_until(lambda: False, (w.placed_at or 0) + rng.uniform(-0.05, 0.3))
        phase = w.phase()
        at = time.monotonic() - w.t0
        if phase != "exited":
            w.proc.send_signal(sig)
        rc, err = w.finish()
        w.poll_folder()

        raw, temps, fingerprint = outputs.raw(), outputs.temporaries(), outputs.fingerprint()
        if sig == signal.SIGKILL and raw != before_raw and fingerprint != expected[new]:
            # killed while renaming, after its commit record: the next run in the folder completes it first
            from oq.outputs import remove_stale_temporaries

            remove_stale_temporaries(outputs.folder)
            count("SIGKILL between the renames, completed from the commit record")
            raw, temps, fingerprint = outputs.raw(), outputs.temporaries(), outputs.fingerprint()
        if raw == before_raw:
            outcome = "previous"
        elif fingerprint == expected[new]:
            outcome = "new"
        else:
            outcome = "MIXED"
        row = dict(run=i, signal=sig.name, mode=mode, at=round(at, 3), phase=phase, rc=rc, outcome=outcome,
                   temporaries=len(temps))
        if outcome == "MIXED":  # which file is which
            row["files"] = {name: "previous" if raw[name] == before_raw[name] else
                            "new" if fingerprint[name] == expected[new][name] else "neither" for name in raw}
        rows.append(row)
        print(row, flush=True)
        detail = (f"run {i} ({sig.name} at {at:.3f}s, phase {phase}, rc {rc}, outcome {outcome}): files {raw}, "
                  f"expected previous {before_raw} or new {expected[new]}; stderr tail: {err[-1500:]}")

        def problem(what):
            problems.append(f"{what}: {detail}")
            row.setdefault("problems", []).append(what)

        if outcome == "MIXED":
            problem("a mix of the previous and the new outputs")
        try:
            onnx.load(str(outputs.model))  # whole, and parses
        except Exception as exc:  # noqa: BLE001 - recorded, the loop goes on
            problem(f"out.onnx does not load ({type(exc).__name__}: {exc})")

        # temporaries: a run that reached its save removed every killed run's leftovers; an interrupted run left
        # none of its own
        reached_save = w.stage_at is not None or outcome == "new"
        stale = [t for t in temps if temp_pid(t) != w.proc.pid]
        if reached_save and stale:
            problem(f"a killed run's temporaries survived the next run's save: {stale}")
        elif not set(stale) <= before_temps:
            problem(f"temporaries of no known run: {stale}")
        if phase == "exited":
            if rc != 0:
                problem("exit code of an uninterrupted run")
        elif sig == signal.SIGINT:
            handled = rc == 130 and err.strip().splitlines()[-1:] == ["oq: interrupted"]
            if phase == "after-rename":
                # the outputs were complete: oq's handler (130), or the interpreter already exiting (killed by the
                # signal, which a shell shows as 130; or 0 when it came too late to matter) are all right
                if not (handled or (rc in (0, -signal.SIGINT) and "Traceback" not in err)):
                    problem("SIGINT after the outputs were in place gave an unexpected exit")
            elif outcome == "new" and phase == "save":
                # a Ctrl-C during the renames waits until the files are in place, then ends the run
                if not handled:
                    problem("SIGINT during the renames did not end the run with exit 130 and 'oq: interrupted'")
            elif outcome == "new":
                problem("SIGINT before the save was ignored: the run went on and wrote its outputs")
            elif startup_interrupt(err):
                count("SIGINT during interpreter start-up (traceback before oq's main)")
            elif not handled:
                problem("SIGINT did not end the run with exit 130 and 'oq: interrupted'")
            if [t for t in temps if temp_pid(t) == w.proc.pid]:
                problem(f"SIGINT left temporaries: {temps}")
        elif rc != -signal.SIGKILL:
            problem("SIGKILL did not end the run")
        count(f"{sig.name if phase != 'exited' else 'no signal'} / {phase} / {outcome} / rc {rc}")
        if outcome == "new":
            current = new

    elapsed = time.monotonic() - started
    print(f"\ninterrupted runs: {len(rows)} in {elapsed:.0f}s (seed {seed}, save phase ~{save:.2f}s of ~{total:.1f}s)")
    for key, n in sorted(counts.items()):
        print(f"  {n:3d}  {key}")

    # one more run, uninterrupted: it ends with the new set and no temporaries at all
    new = "a" if current == "b" else "b"
    w = Watched(outputs, args(new), logs / "final.log")
    rc, err = w.finish(600)
    if rc != 0 or outputs.fingerprint() != expected[new] or outputs.temporaries():
        problems.append(f"the last, uninterrupted run: exit {rc}, files {outputs.fingerprint()} (expected "
                        f"{expected[new]}), temporaries {outputs.temporaries()}; stderr tail: {err[-1500:]}")
    sent = [r for r in rows if r["phase"] != "exited"]
    assert not problems, f"{len(problems)} of {len(rows)} interrupted runs went wrong:\n\n" + "\n\n".join(problems)
    assert any(r["signal"] == "SIGINT" for r in sent) and any(r["signal"] == "SIGKILL" for r in sent)
    assert len(rows) >= 10, f"only {len(rows)} runs fitted in the time budget"


# oq's CLI in a child whose renames into the output folder (argv[1]) each pause a while: the window between the
# model's side files and the model being put in place, which is otherwise microseconds wide, made wide enough to hit
PAUSING_CLI = r"""
import os, sys, time
from pathlib import Path

replace, folder = os.replace, Path(sys.argv[1]).resolve()


def paused_replace(src, dst):
    replace(src, dst)
    dst = Path(dst)
    if dst.parent.resolve() == folder and not dst.name.startswith(".oq-tmp-"):
        print(f"placed {dst.name}", file=sys.stderr, flush=True)
        time.sleep(2)


os.replace = paused_replace
from oq.cli import main

sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_an_interrupt_between_the_final_renames_leaves_one_whole_output_set(tmp_path, sig):
    inputs, folder = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    folder.mkdir()
    model = inputs / "chain.onnx"
    calib = build_chain(model, width=256, layers=2, samples=32)
    outputs = OutputSet(folder)

    def args(size):
        return ["run", model, "--calib", calib, "-o", outputs.model, "--report", outputs.report, "-q",
                "--calib-size", size]

    for size in ("16", "8"):
        proc = subprocess.run(oq_command(*args(size)), capture_output=True, text=True, cwd=ROOT, env=child_env())
        assert proc.returncode == 0, proc.stderr
        if size == "16":
            new = outputs.fingerprint()
    previous = outputs.raw()
    proc = subprocess.Popen([sys.executable, "-c", PAUSING_CLI, folder, *map(str, args("16"))], cwd=ROOT,
                            env=child_env(), stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline().strip()
    proc.send_signal(sig)
    err = first + "\n" + proc.communicate(timeout=120)[1]
    state = "previous" if outputs.raw() == previous else "new" if outputs.fingerprint() == new else "mixed"
    print(f"\n{sig.name} after '{first}': exit {proc.returncode}, outputs {state}: {outputs.raw()}")
    if sig == signal.SIGKILL:
        # killed after its commit record: the next run in the folder completes it (here: the recovery it runs first)
        from oq.outputs import remove_stale_temporaries

        remove_stale_temporaries(folder)
        state = "previous" if outputs.raw() == previous else "new" if outputs.fingerprint() == new else "mixed"
        print(f"after recovery: outputs {state}")
        assert state == "new" and not outputs.temporaries(), outputs.raw()
    assert first.startswith("placed ") and first != "placed out.onnx", err
    assert state != "mixed", (f"{sig.name} between the renames left a mix: {outputs.raw()}; previous {previous}, "
                              f"new {new}; stderr: {err}")
    onnx.load(str(outputs.model))
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and err.strip().splitlines()[-1] == "oq: interrupted", err


# ---------------------------------------------------------------------------------------------------------------
# models over 2 GB


BIG_WIDTH, BIG_LAYERS = 11776, 4  # 4 * 11776**2 * 4 bytes = 2.22 GB of float32 weights


def build_big(folder: Path, width: int = BIG_WIDTH, layers: int = BIG_LAYERS, seed: int = 0) -> Path:
    """MatMul(+Add+Relu) layers whose weights are written straight to `big.onnx.data` (never all in memory)."""
    rng = np.random.default_rng(seed)
    path, data_name = folder / "big.onnx", "big.onnx.data"
    inits, nodes, cur, offset = [], [], "x", 0
    with open(folder / data_name, "wb") as data:
        for i in range(layers):
            for name, shape, scale in ((f"w{i}", (width, width), 1 / np.sqrt(width)), (f"b{i}", (width,), 0.1)):
                value = (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype("<f4")
                raw = value.tobytes()
                data.write(raw)
                tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
                tensor.data_location = TensorProto.EXTERNAL
                for key, val in (("location", data_name), ("offset", str(offset)), ("length", str(len(raw)))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, val
                inits.append(tensor)
                offset += len(raw)
                pad = (-offset) % 4096  # aligned, as onnx's own writer does
                data.write(b"\0" * pad)
                offset += pad
            out = "y" if i == layers - 1 else f"h{i}"
            nodes += [helper.make_node("MatMul", [cur, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                      helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}"),
                      helper.make_node("Relu", [f"a{i}"], [out], name=f"relu{i}")]
            cur = out
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path.write_bytes(model.SerializeToString())
    return path


def run_measured(cmd: list[str], log: Path) -> tuple[int, float, float]:
    """(exit code, wall seconds, peak RSS in MB) of one child process."""
    with open(log, "w") as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=child_env())
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, wall, usage.ru_maxrss / 1024


def run_model(path: Path, feed: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    out = sess.run(None, feed)[0]
    del sess
    return out


def sqnr_db(ref, x) -> float:
    ref = np.asarray(ref, np.float64)
    noise = ((ref - np.asarray(x, np.float64)) ** 2).sum()
    return float("inf") if noise == 0 else float(10 * np.log10((ref ** 2).sum() / noise))


def test_models_over_2gb_quantize_for_tensorrt_and_onnxruntime_with_and_without_exclusions(tmp_path):
    started = time.monotonic()
    inputs = tmp_path / "in"
    inputs.mkdir()
    model = build_big(inputs)
    weights = BIG_LAYERS * (BIG_WIDTH ** 2 + BIG_WIDTH) * 4
    assert weights > 2 ** 31 and (inputs / "big.onnx.data").stat().st_size > 2 ** 31
    rng = np.random.default_rng(1)
    calib = inputs / "calib.npz"
    np.savez(calib, x=rng.standard_normal((16, BIG_WIDTH), dtype=np.float32))
    feed = {"x": rng.standard_normal((2, BIG_WIDTH), dtype=np.float32)}
    t0 = time.monotonic()
    reference = run_model(model, feed)
    print(f"\nbuilt {weights / 1e9:.2f} GB model and ran it in float in {time.monotonic() - t0:.1f}s")
    assert np.isfinite(reference).all() and np.abs(reference).max() > 0
    session_dirs = set(Path(tempfile.gettempdir()).glob("oq-session-*"))

    results, failures = [], []
    for target in ("tensorrt", "onnxruntime"):
        for exclude in (False, True):
            name = f"{target}{'-float' if exclude else ''}"
            folder = tmp_path / name
            folder.mkdir()
            out = folder / "q.onnx"
            cmd = oq_command("--debug", "run", model, "--target", target, "--calib", calib, "-o", out, "-q",
                             *(["--exclude", ".*"] if exclude else []))
            rc, wall, peak = run_measured(cmd, folder.parent / f"{name}.log")
            err = (folder.parent / f"{name}.log").read_text()
            row = dict(run=name, rc=rc, seconds=round(wall, 1), peak_rss_mb=round(peak))
            if rc != 0:
                failures.append(f"{name}: exit {rc}\n{err[-4000:]}")
                results.append(row)
                print(row)
                continue
            data = out.with_name(out.name + ".data")
            mode = plain_mode(folder)
            row["onnx_mb"] = round(out.stat().st_size / 1e6, 1)
            row["data_mb"] = round(data.stat().st_size / 1e6, 1) if data.exists() else None
            got = run_model(out, feed)
            row["sqnr_db"] = round(sqnr_db(reference, got), 1)
            results.append(row)
            print(row)
            problems = []
            if not np.isfinite(got).all():
                problems.append("non-finite outputs")
            if got.shape != reference.shape:
                problems.append(f"output shape {got.shape}, float model {reference.shape}")
            elif exclude and not np.allclose(got, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max()):
                problems.append(f"kept in float, yet differs from the float model (max abs diff "
                                f"{np.abs(got - reference).max():.3g})")
            elif not exclude and row["sqnr_db"] < 20:
                problems.append(f"SQNR {row['sqnr_db']} dB against the float model")
            if exclude and not data.exists():
                problems.append("a model over 2 GB written without its external data file")
            if out.stat().st_mode & 0o777 != mode or (data.exists() and data.stat().st_mode & 0o777 != mode):
                problems.append(f"file modes .onnx {oct(out.stat().st_mode & 0o777)}, .data "
                                f"{oct(data.stat().st_mode & 0o777) if data.exists() else None}, plain {oct(mode)}")
            left = [p.name for p in folder.iterdir() if p.name.startswith(TEMP_PREFIX)]
            if left:
                problems.append(f"temporaries left: {left}")
            if problems:
                failures.append(f"{name}: " + "; ".join(problems))
            for p in folder.iterdir():  # keep the disk use to one output at a time
                p.unlink()

    (inputs / "big.onnx.data").unlink()  # 2.2 GB that pytest would otherwise keep among its last temp folders
    leaked = set(Path(tempfile.gettempdir()).glob("oq-session-*")) - session_dirs
    if leaked:
        failures.append(f"session temporaries left in {tempfile.gettempdir()}: {sorted(map(str, leaked))}")
    print(f"\n>2 GB runs, {time.monotonic() - started:.0f}s in all:")
    for row in results:
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))
    assert not failures, "\n\n".join(failures)
