"""Writing the reports: checked before any work, then written whole to temporaries and renamed into place."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import OqError
from ..ir import TEMP_PREFIX, match_file_mode
from ..outputs import check_paths, remove_stale_temporaries


def check_outputs(paths: dict[str, "str | os.PathLike | None"], inputs: list[Path]) -> None:
    """Each report path (role -> path) must name a file in an existing, writable folder and no input file."""
    check_paths([(role, Path(path)) for role, path in paths.items() if path is not None], inputs)


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
