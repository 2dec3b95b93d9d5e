"""Resolving user code by name: `module` (a plugin that registers observers, targets, ...) or `module:attr`.

One loader for every place oq runs code the user named: --plugin modules, `module:function` calibration sources,
and the pass pipeline provider. Modules in the current folder can be named, as with `python -m`.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

from .errors import OqError


def load_module(name: str, what: str = "plugin") -> ModuleType:
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise OqError(f"{what} {name!r}: not a module name")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        return importlib.import_module(name)
    except SystemExit as exc:
        raise OqError(f"{what} {name!r}: importing it raised SystemExit({exc.code})") from None
    except Exception as exc:
        raise OqError(f"{what}: cannot import module '{name}' ({type(exc).__name__}: {str(exc)[:160]})") from None


def resolve(ref: str, what: str = "plugin") -> Any:
    """The object named by `module:attr` (attr may be dotted)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not attr:
        raise OqError(f"{what} {ref!r}: expected module:name")
    obj: Any = load_module(module_name, what)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise OqError(f"{what} {ref!r}: module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


def load_plugins(names) -> list[ModuleType]:
    """Import each plugin module once; importing it is how it registers what it provides."""
    return [load_module(n) for n in names]
