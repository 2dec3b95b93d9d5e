"""Writing the reports: checked before any work, then written whole to temporaries and renamed into place."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import OqError
from ..ir import TEMP_PREFIX, match_file_mode
from ..outputs import remove_stale_temporaries


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_outputs(paths: dict[str, "str | os.PathLike | None"], inputs: list[Path]) -> None:
    """Each report path (role -> path) must name a file in an existing, writable folder and no input file."""
    seen: dict[Path, str] = {}
    for role, path in paths.items():
        if path is None:
            continue
        path = Path(path)
        folder = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            raise OqError(f"{role} {path}: is a directory; give a file path")
        if not folder.is_dir():
            raise OqError(f"{role} {path}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise OqError(f"{role} {path}: folder {folder} is not writable")
        for source in inputs:
            if _same_file(path, source):
                raise OqError(f"{role} {path} is the input file {source}; oq never overwrites its inputs")
        key = path.resolve()
        if key in seen:
            raise OqError(f"{role} {path} is also the {seen[key]}")
        seen[key] = role


def write_outputs(files: dict["str | os.PathLike", bytes]) -> None:
    """Write every file in full to a temporary beside it, then rename them all into place: all of them or none."""
    staged: list[tuple[Path, Path]] = []
    try:
        for path, content in files.items():
            path = Path(path)
            folder = path.parent if str(path.parent) else Path(".")
            remove_stale_temporaries(folder)
            tmp = folder / f"{TEMP_PREFIX}{os.getpid()}-{path.name}"
            tmp.write_bytes(content)
            match_file_mode(tmp)
            staged.append((tmp, path))
        for tmp, path in staged:
            os.replace(tmp, path)
    except OSError as exc:
        raise OqError(f"cannot write {exc.filename or 'the report'}: {exc.strerror or exc}") from None
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
