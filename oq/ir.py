"""Model I/O and graph helpers on top of onnx-graphsurgeon.

gs tensors and nodes compare by name and are unhashable, so indexes here are keyed by name; node names are made
unique by the canonicalize pass before anything relies on them.
"""
from __future__ import annotations

import os
import tempfile
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from .errors import OqError

# protobuf cannot serialize a message over 2 GiB; stay clear of it with some headroom.
PROTOBUF_LIMIT = 2**31 - 1
EXTERNAL_DATA_THRESHOLD = 1_800_000_000
# temporaries carry the writer's pid, so a later run can tell a killed run's leftovers (oq.outputs) from live ones
TEMP_PREFIX = ".oq-tmp-"


def make_temp_dir(folder: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-", dir=folder))


def match_file_mode(path: Path) -> None:
    """The mode a plain open() would have given (temporaries and onnx's external-data writer use 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX file with its external data; raise OqError with the reason when it cannot be read."""
    return load_model_and_files(path)[0]


def load_model_and_files(path: str | os.PathLike) -> tuple[onnx.ModelProto, list[Path]]:
    """The model with its external data, and the files it was read from (the model file first), from one parse:
    loading the external data clears the locations the tensors named."""
    path = Path(path)
    if not path.exists():
        raise OqError(f"{path}: no such file")
    if path.is_dir():
        raise OqError(f"{path}: is a directory, expected an .onnx file")
    try:
        model = onnx.load(str(path), load_external_data=False)
        files = [path] + sorted({path.parent / e.value for init in model.graph.initializer
                                 for e in init.external_data if e.key == "location"})
        onnx.load_external_data_for_model(model, str(path.parent))
    except Exception as exc:  # protobuf raises several unrelated types
        raise OqError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'parse failed'})") from None
    if not model.graph.node and not model.graph.output:
        raise OqError(f"{path}: not an ONNX model (no graph found)")
    check_ir_version(model, str(path))
    return model, files


def checker_problem(source: "onnx.ModelProto | str | os.PathLike") -> str | None:
    """Why a model (in memory, or a file with its external data) fails onnx.checker, or None."""
    try:
        if not isinstance(source, onnx.ModelProto):
            onnx.checker.check_model(str(source))
        elif model_size(source) < EXTERNAL_DATA_THRESHOLD:
            onnx.checker.check_model(source)
    except Exception as exc:
        return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return None


def check_ir_version(model: onnx.ModelProto, name: str) -> None:
    if model.ir_version > onnx.IR_VERSION:
        raise OqError(f"{name}: IR version {model.ir_version} is newer than the installed onnx reads "
                      f"({onnx.IR_VERSION}); re-export the model with an older exporter or upgrade onnx")


def model_size(model: onnx.ModelProto) -> int:
    """Bytes the model would take serialized, counting initializer payloads without serializing them."""
    total = 0
    for init in model.graph.initializer:
        total += len(init.raw_data) or init.ByteSize()
    return total + sum(n.ByteSize() for n in model.graph.node)


def save_model(model: onnx.ModelProto, path: str | os.PathLike, external_data: bool | None = None) -> Path:
    """Write the model whole or not at all: temp files in the target folder, then atomic renames.

    Models near the protobuf limit are written with their tensors in `<name>.data` beside the model.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.exists():
        raise OqError(f"{path}: output folder {folder} does not exist")
    if external_data is None:
        external_data = model_size(model) > EXTERNAL_DATA_THRESHOLD
    tmpdir = make_temp_dir(folder)
    try:
        tmp_model = tmpdir / path.name
        if external_data:
            data_name = path.name + ".data"
            model = _copy(model)  # onnx.save_model rewrites initializers in place when externalising
            onnx.save_model(model, str(tmp_model), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=1024)
            if (tmpdir / data_name).exists():
                match_file_mode(tmpdir / data_name)
                os.replace(tmpdir / data_name, folder / data_name)
        else:
            onnx.save_model(model, str(tmp_model))
        match_file_mode(tmp_model)
        os.replace(tmp_model, path)
    finally:
        for leftover in tmpdir.iterdir():
            leftover.unlink()
        tmpdir.rmdir()
    return path


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def to_graph(model: onnx.ModelProto) -> gs.Graph:
    graph = gs.import_onnx(model)
    graph.ir_version = model.ir_version
    # gs keeps the model's own opset list and adds the domains of new nodes to it on export: the caller's
    # ModelProto would change
    graph.import_domains = [onnx.helper.make_opsetid(i.domain, i.version) for i in model.opset_import]
    return graph


def to_model(graph: gs.Graph, template: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """Export a gs graph; model-level fields (metadata, docs) are carried over from `template`."""
    model = gs.export_onnx(graph, do_type_check=False)
    if template is not None:
        model.doc_string = template.doc_string
        model.model_version = template.model_version
        model.domain = template.domain
        del model.metadata_props[:]
        model.metadata_props.extend(template.metadata_props)
    if model.ir_version < 7:
        model.ir_version = 7
    return model


def pack_4bit(model: onnx.ModelProto, packed: dict[str, str]) -> None:
    """Turn the named initializers (4-bit values held in int8/uint8) into INT4/UINT4 tensors, two values a byte."""
    if not packed:
        return
    import ml_dtypes

    kinds = {"int4": ml_dtypes.int4, "uint4": ml_dtypes.uint4}
    for i, init in enumerate(model.graph.initializer):
        if init.name in packed:
            value = onnx.numpy_helper.to_array(init).astype(kinds[packed[init.name]])
            model.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(value, init.name))


def opset_of(model: onnx.ModelProto, domain: str = "") -> int | None:
    for imp in model.opset_import:
        if imp.domain in (domain, "ai.onnx" if domain == "" else domain):
            return imp.version
    return None


@dataclass(frozen=True)
class Use:
    node: gs.Node
    index: int


class UseIndex:
    """tensor name -> [(consumer node, input index)], built once per pass; graph outputs are tracked separately."""

    def __init__(self, graph: gs.Graph):
        self.uses: dict[str, list[Use]] = defaultdict(list)
        for node in graph.nodes:
            for i, t in enumerate(node.inputs):
                if t.name:
                    self.uses[t.name].append(Use(node, i))
        self.graph_outputs = {t.name for t in graph.outputs}

    def consumers(self, tensor: gs.Tensor | str) -> list[Use]:
        name = tensor if isinstance(tensor, str) else tensor.name
        return self.uses.get(name, [])

    def sole_consumer(self, tensor: gs.Tensor) -> gs.Node | None:
        """The one node reading `tensor`, if exactly one reads it and it is not a graph output."""
        uses = self.consumers(tensor)
        if len(uses) != 1 or tensor.name in self.graph_outputs:
            return None
        return uses[0].node


def producer(tensor: gs.Tensor) -> gs.Node | None:
    return tensor.inputs[0] if tensor.inputs else None


def constant_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of a Constant tensor, or of a tensor produced by a Constant node; None otherwise."""
    if isinstance(tensor, gs.Constant):
        return np.asarray(tensor.values)
    node = producer(tensor)
    if node is not None and node.op == "Constant" and "value" in node.attrs:
        value = node.attrs["value"]
        return np.asarray(value.values if isinstance(value, gs.Constant) else value)
    return None


class Namer:
    """The one fresh-name generator: names that collide with nothing taken, `base`, then `base_1`, `base_2`, ...

    Namer(graph) takes every tensor and node name of a graphsurgeon graph; Namer.of_model(model) those of a
    ModelProto; Namer(taken=names) an explicit set (e.g. node names only)."""

    def __init__(self, graph: gs.Graph | None = None, *, taken=()):
        self.taken: set[str] = set(taken)
        if graph is not None:
            self.taken.update(graph.tensors().keys())
            self.taken.update(n.name for n in graph.nodes if n.name)

    @classmethod
    def of_model(cls, model: onnx.ModelProto) -> "Namer":
        g = model.graph
        names = {t for n in g.node for t in (*n.input, *n.output)} | {n.name for n in g.node if n.name}
        names |= {i.name for i in (*g.input, *g.output, *g.initializer)}
        return cls(taken=names)

    def __call__(self, base: str) -> str:
        name = base
        k = 1
        while name in self.taken:
            name = f"{base}_{k}"
            k += 1
        self.taken.add(name)
        return name


def replace_all_uses(old: gs.Tensor, new: gs.Tensor, graph: gs.Graph | None = None) -> int:
    """Make every node that reads `old` read `new` instead (and, given the graph, its outputs list too); returns
    how many inputs were rewired. The one replace-all-uses helper of the graphsurgeon layer."""
    count = 0
    for consumer in list(old.outputs):
        for i, t in enumerate(consumer.inputs):
            if t is old:
                consumer.inputs[i] = new
                count += 1
    if graph is not None and any(t is old for t in graph.outputs):
        graph.outputs = [new if t is old else t for t in graph.outputs]
    return count


def toposort(graph: gs.Graph) -> None:
    """Kahn's algorithm on the use index; keeps the original order among ready nodes. Raises on cycles."""
    produced_by: dict[str, int] = {}
    for idx, node in enumerate(graph.nodes):
        for t in node.outputs:
            produced_by[t.name] = idx
    deps: list[set[int]] = []
    for node in graph.nodes:
        d = set()
        for t in _all_inputs(node):
            j = produced_by.get(t)
            if j is not None:
                d.add(j)
        deps.append(d)
    users: dict[int, list[int]] = defaultdict(list)
    indeg = [0] * len(graph.nodes)
    for i, d in enumerate(deps):
        d.discard(i)
        indeg[i] = len(d)
        for j in d:
            users[j].append(i)
    ready = deque(i for i, k in enumerate(indeg) if k == 0)
    order = []
    while ready:
        i = ready.popleft()
        order.append(i)
        for u in sorted(users[i]):
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    if len(order) != len(graph.nodes):
        stuck = [graph.nodes[i].name for i, k in enumerate(indeg) if k > 0][:5]
        raise OqError(f"graph has a cycle through nodes {stuck}")
    graph.nodes = [graph.nodes[i] for i in order]


def _all_inputs(node: gs.Node) -> list[str]:
    """Input names of a node including those its subgraphs read from the outer scope."""
    names = [t.name for t in node.inputs if t.name]
    for value in node.attrs.values():
        subgraphs = value if isinstance(value, list) else [value]
        for sub in subgraphs:
            if isinstance(sub, gs.Graph):
                inner = set(sub.tensors().keys())
                produced = {t.name for n in sub.nodes for t in n.outputs} | {t.name for t in sub.inputs}
                for n in sub.nodes:
                    names.extend(x for x in _all_inputs(n) if x not in produced and x in inner)
    return names


def is_float(tensor: gs.Tensor) -> bool:
    dtype = tensor.dtype
    if dtype is None:
        return False
    try:
        return np.issubdtype(np.dtype(dtype), np.floating)
    except TypeError:
        return False


def has_subgraph(node: gs.Node) -> bool:
    return any(isinstance(v, gs.Graph) or (isinstance(v, list) and v and isinstance(v[0], gs.Graph))
               for v in node.attrs.values())
