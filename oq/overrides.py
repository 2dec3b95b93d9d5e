"""Per-run spec overrides: `--override NODE_OR_OP=[weight.|activation.]key:value[,...]`.

NODE_OR_OP matches like --exclude (node name, op type, or a regex over node names). Keys are QuantSpec fields
(dtype, symmetric, narrow_range, granularity, observer, power_of_two, quant_min, quant_max, min_scale,
zero_point, rounding); `weight.` or `activation.` limits an entry to that role, no prefix means both.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields

import onnx_graphsurgeon as gs

from .errors import OqError
from .spec import QuantSpec

SPEC_FIELDS = {f.name: f.type for f in fields(QuantSpec)}
ROLES = ("weight", "activation")


def matches(node: gs.Node, pattern: str) -> bool:
    """A node name, an op type, or (as a regex) a node name."""
    if pattern in (node.name, node.op):
        return True
    try:
        return re.fullmatch(pattern, node.name) is not None
    except re.error:
        return False


def _value(key: str, text: str):
    kind = SPEC_FIELDS[key]
    if "bool" in str(kind):
        if text.lower() not in ("true", "false"):
            raise OqError(f"--override: {key} takes true or false, got {text!r}")
        return text.lower() == "true"
    if "int" in str(kind) and "float" not in str(kind):
        try:
            return int(text)
        except ValueError:
            raise OqError(f"--override: {key} takes an integer, got {text!r}") from None
    if "float" in str(kind):
        try:
            return float(text)
        except ValueError:
            raise OqError(f"--override: {key} takes a number, got {text!r}") from None
    return text


@dataclass(frozen=True)
class Override:
    pattern: str
    role: str | None  # "weight", "activation" or None for both
    changes: tuple[tuple[str, object], ...]
    text: str

    def applies(self, node: gs.Node, role: str) -> bool:
        return (self.role is None or self.role == role) and matches(node, self.pattern)

    def apply(self, spec: QuantSpec) -> QuantSpec:
        try:
            return spec.with_(**dict(self.changes))
        except OqError as exc:
            raise OqError(f"--override {self.text}: {exc}") from None


def parse_override(text: str) -> list[Override]:
    if "=" not in text:
        raise OqError(f"--override {text!r}: expected NODE_OR_OP=key:value[,key:value...]")
    pattern, _, body = text.partition("=")
    if not pattern.strip():
        raise OqError(f"--override {text!r}: no node name or op type before '='")
    by_role: dict[str | None, list] = {}
    for item in filter(None, (p.strip() for p in body.split(","))):
        if ":" not in item:
            raise OqError(f"--override {text!r}: '{item}' is not key:value")
        key, _, value = item.partition(":")
        role = None
        if "." in key:
            role, _, key = key.partition(".")
            if role not in ROLES:
                raise OqError(f"--override {text!r}: role '{role}' is not one of {', '.join(ROLES)}")
        if key not in SPEC_FIELDS:
            raise OqError(f"--override {text!r}: unknown key '{key}' (keys: {', '.join(SPEC_FIELDS)})")
        by_role.setdefault(role, []).append((key, _value(key, value)))
    if not by_role:
        raise OqError(f"--override {text!r}: no key:value given")
    return [Override(pattern, role, tuple(changes), text) for role, changes in by_role.items()]
