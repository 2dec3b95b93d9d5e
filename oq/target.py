"""Targets as data: a validated schema loaded from TOML, built in (backends/) or from a user's file."""
from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .errors import OqError
from .opinfo import op_names, weighted_op
from .spec import QuantSpec

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

OUTPUT_MODES = ("float", "quantized", "shared")
BIAS_MODES = ("float", "int32")
TOP_KEYS = {"name", "description", "extends", "fusions", "quantize_fusion_side_inputs", "quantize_graph_outputs",
            "bias", "opset_min", "specs", "ops", "activation_spec", "side_files", "u8s8_saturation", "format",
            "cross_layer_equalization", "float_output_layers"}
FORMATS = ("qdq", "fakequant")  # fakequant: oq.FakeQuant model-local functions, any bit width
SATURATION_MODES = ("ignore", "guard")  # guard: see oq/passes/saturation.py (x86 CPUs without VNNI)
SPEC_KEYS = {"dtype", "symmetric", "narrow_range", "granularity", "observer", "power_of_two", "quant_min",
             "quant_max", "min_scale", "zero_point", "rounding", "block_size"}
# dtypes that QuantizeLinear/DequantizeLinear accept only from this opset on
DTYPE_MIN_OPSET = {"int16": 21, "uint16": 21, "float8e4m3": 19, "int4": 21, "uint4": 21}
OP_KEYS = {"inputs", "output", "bias", "when", "min_input_channels"}
# always: quantize wherever the op appears; inputs_quantized: only where every run-time input already arrives
# quantized (e.g. a residual Add between quantized convs, not one on a transformer's float residual stream)
WHEN_MODES = ("always", "inputs_quantized")

# a sentence ends at . ! or ? followed by a space or the end, unless the word is one of these abbreviations
_SENTENCE_END = re.compile(r"(?<!\.\.)[.!?](?= |$)")  # not the last dot of "..."
_ABBREVIATIONS = {"e.g.", "i.e.", "cf.", "vs.", "approx.", "(e.g.", "(i.e.", "(cf."}
# words a cut summary does not end on
_DANGLING = {"a", "an", "and", "as", "at", "by", "for", "from", "in", "into", "of", "on", "or", "the", "to", "with"}


@dataclass(frozen=True)
class OpRule:
    inputs: dict[int | str, str]  # input index (or "*" for all) -> spec name
    output: str = "float"
    bias: str | None = None
    when: str = "always"
    # Conv/ConvTranspose with fewer input channels stay float: the backend's int8 kernel is slower there (an RGB stem)
    min_input_channels: int = 0

    def spec_name_for(self, index: int) -> str | None:
        return self.inputs.get(index, self.inputs.get("*"))


@dataclass
class Target:
    name: str
    description: str
    specs: dict[str, QuantSpec]
    ops: dict[str, OpRule]
    fusions: list[str] = field(default_factory=list)
    quantize_fusion_side_inputs: bool = False
    quantize_graph_outputs: bool = False
    bias: str = "float"
    opset_min: int = 13
    activation_spec: str = "activation"
    side_files: list[str] = field(default_factory=list)
    format: str = "qdq"
    u8s8_saturation: str = "ignore"
    # rescale channels between consecutive layers before quantizing (passes/equalize.py): pays with per-tensor weights
    cross_layer_equalization: bool = False
    # keep the weighted layers that produce the graph outputs in float (where the format's error lands unfiltered)
    float_output_layers: bool = False
    source: str = "built-in"

    def spec(self, name: str) -> QuantSpec:
        return self.specs[name]

    @property
    def activation(self) -> QuantSpec:
        return self.specs[self.activation_spec]

    def summary(self, width: int = 85) -> str:
        """The description's first sentence on one line, or, when longer than `width` characters, its words up to a
        word boundary followed by "…". (`oq targets` prints it after a 15-character name column: 100 in all.)"""
        text = " ".join(self.description.split())
        end = next((m.end() for m in _SENTENCE_END.finditer(text)
                    if text[:m.end()].rsplit(" ", 1)[-1].lower() not in _ABBREVIATIONS), len(text))
        sentence = text[:end]
        if len(sentence) <= width:
            return sentence
        # whole words that end before the last space within `width` characters: at most width - 1, then "…"
        head = sentence[:width]
        words = head.split(" ")[:-1] if " " in head else [sentence[:width - 1]]
        while len(words) > 1 and words[-1].lower().strip(",;:(") in _DANGLING:
            words.pop()
        return " ".join(words).rstrip(" ,;:([-/") + "…"

    def describe(self) -> str:
        lines = [f"target {self.name} ({self.source})", f"  {self.description}", "",
                 f"  bias: {self.bias}; opset >= {self.opset_min}; fusions: {', '.join(self.fusions) or 'none'}",
                 f"  fusion side inputs quantized: {self.quantize_fusion_side_inputs}; "
                 f"graph outputs quantized: {self.quantize_graph_outputs}",
                 f"  format: {self.format}; side files: {', '.join(self.side_files) or 'none'}; "
                 f"u8s8 saturation: {self.u8s8_saturation}; "
                 f"cross-layer equalization: {self.cross_layer_equalization}; "
                 f"output layers float: {self.float_output_layers}", "", "  specs:"]
        for name, s in self.specs.items():
            qmin, qmax = s.qrange
            lines.append(f"    {name:<12} {s.dtype:<6} {'symmetric' if s.symmetric else 'asymmetric':<10} "
                         f"{s.granularity:<11} range=[{qmin}, {qmax}] pow2={s.power_of_two} observer={s.observer}"
                         + (f" min_scale={s.min_scale}" if s.min_scale else "")
                         + (f" zero_point={s.zero_point}" if s.zero_point is not None else ""))
        lines += ["", "  ops:"]
        for op, r in self.ops.items():
            ins = ", ".join(f"{k}:{v}" for k, v in r.inputs.items())
            lines.append(f"    {op:<22} inputs[{ins}] output={r.output}" + (f" bias={r.bias}" if r.bias else "")
                         + (f" when={r.when}" if r.when != "always" else "")
                         + (f" min_input_channels={r.min_input_channels}" if r.min_input_channels else ""))
        return "\n".join(lines)


def with_bits(target: Target, weight_bits: int | None = None, act_bits: int | None = None) -> Target:
    """The target with its weight and/or activation specs narrowed to N-bit integer grids (2..16 bits), in 8-bit
    containers up to 8 bits and 16-bit ones beyond."""
    import dataclasses

    specs = dict(target.specs)
    for role, bits in (("weight", weight_bits), ("activation", act_bits)):
        if bits is None:
            continue
        if not 2 <= bits <= 16:
            raise OqError(f"--{'weight' if role == 'weight' else 'act'}-bits must be between 2 and 16, got {bits}")
        names = [target.activation_spec] if role == "activation" else \
            [n for n in specs if n != target.activation_spec]
        for name in names:
            spec = specs[name]
            container = ("int" if spec.signed else "uint") + ("8" if bits <= 8 else "16")
            qmin, qmax = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if spec.signed else (0, 2 ** bits - 1)
            if spec.narrow_range and spec.signed:
                qmin += 1
            specs[name] = spec.with_(dtype=container, quant_min=qmin, quant_max=qmax)
            need = DTYPE_MIN_OPSET.get(container, 13)
            if target.format == "qdq" and need > target.opset_min:
                raise OqError(f"{bits}-bit {role}s need {container} Q/DQ (opset >= {need}) but target {target.name} "
                              f"emits opset {target.opset_min}; use --target academic (FakeQuant) or a target "
                              f"with opset_min = {need}")
    return dataclasses.replace(target, specs=specs)


def builtin_names() -> list[str]:
    root = resources.files("oq.backends")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def _read_builtin(name: str) -> dict:
    path = resources.files("oq.backends") / f"{name}.toml"
    if not path.is_file():
        raise OqError(f"unknown target {name!r}; built-in targets: {', '.join(builtin_names())}")
    return tomllib.loads(path.read_text())


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "inputs":
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _resolve_extends(raw: dict, where: str, seen: tuple[str, ...] = ()) -> dict:
    """Merge a target's overrides onto the built-in target it `extends` (recursively)."""
    if "extends" not in raw:
        return raw
    base = raw["extends"]
    if not isinstance(base, str):
        raise OqError(f"{where}: key 'extends': must be the name of a built-in target")
    if base in seen:
        raise OqError(f"{where}: key 'extends': cycle through {' -> '.join(seen + (base,))}")
    if base not in builtin_names():
        raise OqError(f"{where}: key 'extends': unknown target {base!r}; built-in targets: "
                      f"{', '.join(builtin_names())}")
    parent = _resolve_extends(_read_builtin(base), f"built-in target {base!r}", seen + (base,))
    return _merge(parent, {k: v for k, v in raw.items() if k != "extends"})


def load_target(ref: "str | os.PathLike | Target") -> Target:
    """A built-in target by name, or a TOML file that may `extends` a built-in one."""
    if isinstance(ref, Target):
        return ref
    ref_str = str(ref)
    if ref_str.endswith(".toml") or os.sep in ref_str:
        path = Path(ref_str)
        if not path.is_file():
            raise OqError(f"{path}: target file not found")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise OqError(f"{path}: not valid TOML ({exc})") from None
        where = str(path)
    else:
        raw, where = _read_builtin(ref_str), f"built-in target {ref_str!r}"
    return parse_target(_resolve_extends(raw, where, (raw.get("name", ""),)), where)


def parse_target(raw: dict, where: str) -> Target:
    def fail(key: str, why: str):
        raise OqError(f"{where}: key '{key}': {why}")

    for k in raw:
        if k not in TOP_KEYS:
            fail(k, f"unknown key (known: {', '.join(sorted(TOP_KEYS))})")
    if not isinstance(raw.get("name"), str) or not raw["name"]:
        fail("name", "a target needs a non-empty string name")
    specs: dict[str, QuantSpec] = {}
    for sname, sraw in raw.get("specs", {}).items():
        if not isinstance(sraw, dict):
            fail(f"specs.{sname}", "must be a table")
        for k in sraw:
            if k not in SPEC_KEYS:
                fail(f"specs.{sname}.{k}", f"unknown key (known: {', '.join(sorted(SPEC_KEYS))})")
        try:
            specs[sname] = QuantSpec(**sraw)
        except (OqError, TypeError) as exc:
            fail(f"specs.{sname}", str(exc))
    act = raw.get("activation_spec", "activation")
    if act not in specs:
        fail("activation_spec", f"spec {act!r} is not defined under [specs]")
    if specs[act].granularity != "per_tensor":
        fail(f"specs.{act}.granularity", "activations are quantized per tensor")
    if specs[act].dtype in ("int4", "uint4"):
        fail(f"specs.{act}.dtype", "4-bit dtypes are for weights; for 4-bit activations use int8/uint8 with "
                                   "quant_min/quant_max (or --act-bits 4)")
    ops: dict[str, OpRule] = {}
    for op, oraw in raw.get("ops", {}).items():
        key = f"ops.{op}"
        weighted = weighted_op(op)
        if not isinstance(oraw, dict):
            fail(key, "must be a table")
        for k in oraw:
            if k not in OP_KEYS:
                fail(f"{key}.{k}", f"unknown key (known: {', '.join(sorted(OP_KEYS))})")
        inputs: dict[int | str, str] = {}
        for idx, sname in oraw.get("inputs", {}).items():
            if idx != "*" and not str(idx).isdigit():
                fail(f"{key}.inputs.{idx}", "input keys are input indices (\"0\", \"1\", ...) or \"*\"")
            if sname not in specs:
                fail(f"{key}.inputs.{idx}", f"spec {sname!r} is not defined under [specs]")
            index = idx if idx == "*" else int(idx)
            not_weight = weighted is None or weighted.weight_input != index
            if specs[sname].granularity in ("per_channel", "per_block") and not_weight:
                kind = specs[sname].granularity.replace("_", "-")
                fail(f"{key}.inputs.{idx}", f"{kind} spec {sname!r} on an input that is not a weight of {op}")
            inputs[index] = sname
        output = oraw.get("output", "float")
        if output not in OUTPUT_MODES:
            fail(f"{key}.output", f"must be one of {', '.join(OUTPUT_MODES)}")
        bias = oraw.get("bias")
        if bias is not None and bias not in BIAS_MODES:
            fail(f"{key}.bias", f"must be one of {', '.join(BIAS_MODES)}")
        when = oraw.get("when", "always")
        if when not in WHEN_MODES:
            fail(f"{key}.when", f"must be one of {', '.join(WHEN_MODES)}")
        min_channels = oraw.get("min_input_channels", 0)
        if not isinstance(min_channels, int) or isinstance(min_channels, bool) or min_channels < 0:
            fail(f"{key}.min_input_channels", "must be a non-negative integer")
        if min_channels and (weighted is None or not weighted.convolution):
            fail(f"{key}.min_input_channels", f"applies to {op_names(lambda w: w.convolution, ' and ')} only")
        ops[op] = OpRule(inputs, output, bias, when, min_channels)
    bias = raw.get("bias", "float")
    if bias not in BIAS_MODES:
        fail("bias", f"must be one of {', '.join(BIAS_MODES)}")
    from oq.emit import SIDE_FILES
    from oq.fusions import PATTERNS as FUSION_PATTERNS

    side_files = list(raw.get("side_files", []))
    for f in side_files:
        if f not in SIDE_FILES:
            fail("side_files", f"unknown side file {f!r} (known: {', '.join(SIDE_FILES)})")
    fmt = raw.get("format", "qdq")
    if fmt not in FORMATS:
        fail("format", f"must be one of {', '.join(FORMATS)}")
    opset_min = raw.get("opset_min", 13)
    if not isinstance(opset_min, int) or not 13 <= opset_min <= 23:
        fail("opset_min", "must be an integer between 13 and 23")
    for sname, spec in specs.items():
        need = max(DTYPE_MIN_OPSET.get(spec.dtype, 13), 21 if spec.granularity == "per_block" else 13)
        if need > opset_min and fmt == "qdq":
            what = "per-block Q/DQ" if spec.granularity == "per_block" else f"{spec.dtype} Q/DQ"
            fail(f"specs.{sname}.dtype", f"{what} needs opset >= {need}; set opset_min = {need}")
    saturation = raw.get("u8s8_saturation", "ignore")
    if saturation not in SATURATION_MODES:
        fail("u8s8_saturation", f"must be one of {', '.join(SATURATION_MODES)}")
    flags = {}
    for key in ("cross_layer_equalization", "float_output_layers"):
        flags[key] = raw.get(key, False)
        if not isinstance(flags[key], bool):
            fail(key, "must be true or false")
    fusions = list(raw.get("fusions", []))
    for f in fusions:
        if f not in FUSION_PATTERNS:
            fail("fusions", f"unknown fusion pattern {f!r} (known: {', '.join(FUSION_PATTERNS)})")
    return Target(name=raw["name"], description=raw.get("description", ""), specs=specs, ops=ops, fusions=fusions,
                  quantize_fusion_side_inputs=bool(raw.get("quantize_fusion_side_inputs", False)),
                  quantize_graph_outputs=bool(raw.get("quantize_graph_outputs", False)), bias=bias,
                  opset_min=opset_min, activation_spec=act, side_files=side_files, format=fmt,
                  u8s8_saturation=saturation, source=where, **flags)
