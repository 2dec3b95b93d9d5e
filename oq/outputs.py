"""Where a run writes, checked before any work and committed as one unit.

Every output path (the model, its external data file, side files, the report) must name a file in an existing
folder, must not be a folder, and must not resolve (after symlinks) to any input file: the model, its external
data, the calibration data. The files are first written in full to hidden temporaries beside their targets, then
renamed into place one after the other with the model last, with Ctrl-C and SIGTERM held back meanwhile. Before the first
rename a commit record is written; a run killed during the renames is completed from it by the next run in that
folder, and a run killed earlier leaves its previous outputs, its temporaries removed by the next run.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from .errors import OqError
from .ir import TEMP_PREFIX, make_temp_dir, match_file_mode, save_model

JOURNAL = "commit.json"
_TEMP_RE = re.compile(rf"^{re.escape(TEMP_PREFIX)}(\d+)-")


def calibration_files(calib) -> list[Path]:
    if not isinstance(calib, (str, os.PathLike)):
        return []
    path = Path(calib)
    if path.is_file():
        return [path]
    if path.is_dir():
        return [p for p in path.iterdir() if p.is_file()]
    return []


def check_paths(paths: list[tuple[str, Path]], inputs: list[Path]) -> None:
    """Each (role, path) to be written must name a file in an existing, writable folder, no input file, and no
    path another role writes."""
    seen: dict[Path, str] = {}
    for role, path in paths:
        folder = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            raise OqError(f"{role} {path}: is a directory; give a file path")
        if not folder.exists():
            raise OqError(f"{role} {path}: folder {folder} does not exist")
        if not folder.is_dir():
            raise OqError(f"{role} {path}: {folder} is not a folder")
        if not os.access(folder, os.W_OK):
            raise OqError(f"{role} {path}: folder {folder} is not writable")
        for source in inputs:
            if _same_file(path, source):
                raise OqError(f"{role} {path} is the input file {source}; oq never overwrites its inputs")
        key = path.resolve()
        if key in seen:
            raise OqError(f"{role} {path} is also the {seen[key]}")
        seen[key] = role


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _roll_forward(stage: Path) -> None:
    """A killed run that had written its commit record had staged every file in full: finish its renames."""
    try:
        moves = json.loads((stage / JOURNAL).read_text())
    except (OSError, ValueError):
        return
    for src, dst in moves:
        if os.path.exists(src):
            os.replace(src, dst)


def remove_stale_temporaries(folder: Path) -> None:
    """Leftovers of runs that were killed (their process is gone): a run killed while placing its files is
    completed from its commit record, any other run's temporaries are removed (its previous outputs stand)."""
    try:
        entries = sorted(folder.iterdir(), key=lambda e: not e.is_dir())  # staging folders (with records) first
    except OSError:
        return
    for entry in entries:
        m = _TEMP_RE.match(entry.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            if entry.is_dir():
                _roll_forward(entry)
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


@contextlib.contextmanager
def _signals_deferred():
    """Ctrl-C and SIGTERM wait until the renames are done. Blocking the signal would not do: the kernel hands it to
    any thread that does not block it (onnxruntime's, numpy's), so the handlers are swapped for ones that only
    remember it, and the first remembered signal is raised once the files are in place."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if pending:
        if pending[0] == signal.SIGINT:
            raise KeyboardInterrupt
        signal.raise_signal(pending[0])


@dataclass
class OutputPlan:
    """The files one run will write: role -> path."""

    model: Path
    inputs: list[Path] = field(default_factory=list)
    side_suffixes: list[str] = field(default_factory=list)
    report: Path | None = None

    def paths(self) -> list[tuple[str, Path]]:
        out = [("output model (-o)", self.model), ("external data", self.model.with_name(self.model.name + ".data"))]
        out += [(f"side file {s}", self.model.with_name(self.model.stem + s)) for s in self.side_suffixes]
        if self.report is not None:
            out.append(("report (--report)", self.report))
        return out

    def validate(self) -> None:
        for folder in {p.parent if str(p.parent) else Path(".") for _, p in self.paths()}:
            if folder.is_dir():
                remove_stale_temporaries(folder)
        check_paths(self.paths(), self.inputs)

    def commit(self, model: onnx.ModelProto, side_files: dict[str, bytes], report=None, verify=None) -> list[Path]:
        """Write everything to temporaries, then rename into place with the model last. `report`: a callable
        giving the report's bytes once the side files are known; `verify(staged_model_path)` may refuse the
        written model before anything is in place. Returns the side files' paths."""
        self.validate()
        folder = self.model.parent if str(self.model.parent) else Path(".")
        stage = make_temp_dir(folder)
        moves: list[tuple[Path, Path]] = []
        written: list[Path] = []
        try:
            staged_model = save_model(model, stage / self.model.name)
            if verify is not None:
                verify(staged_model)
            data = stage / (self.model.name + ".data")
            if data.exists():
                moves.append((data, self.model.with_name(data.name)))
            for suffix, content in side_files.items():
                target = self.model.with_name(self.model.stem + suffix)
                (stage / target.name).write_bytes(content)
                moves.append((stage / target.name, target))
                written.append(target)
            if self.report is not None and report is not None:
                report_tmp = self.report.with_name(f"{TEMP_PREFIX}{os.getpid()}-{self.report.name}")
                report_tmp.write_bytes(report(written))
                moves.append((report_tmp, self.report))
            moves.append((staged_model, self.model))
            for src, _ in moves:
                match_file_mode(src)
            # the commit record: from here on a killed run is completed by the next one (remove_stale_temporaries)
            (stage / JOURNAL).write_text(json.dumps([[str(a.resolve()), str(b.resolve())] for a, b in moves]))
            with _signals_deferred():
                for src, dst in moves:
                    os.replace(src, dst)
        except OSError as exc:
            raise OqError(f"cannot write {self.model}: {exc.strerror or exc}") from None
        finally:
            shutil.rmtree(stage, ignore_errors=True)
            for src, _ in moves:
                if src.exists() and src.parent != stage:
                    src.unlink(missing_ok=True)
        return written
