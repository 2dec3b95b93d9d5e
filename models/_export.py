"""torch -> ONNX export of the reference models, with an on-disk cache.

The cache is per user (:func:`default_cache_dir`), so a fresh clone reuses the
models another checkout already exported; the file name carries
:func:`cache_key`, a hash of everything that determines the exported bytes.

Exporter choice (torch 2.13): the TorchScript exporter (``dynamo=False``) with
``training=TrainingMode.PRESERVE`` on an eval-mode model.

* The dynamo exporter (the default since torch 2.9) always runs its graph
  optimizer, which folds BatchNormalization into the preceding Conv/Gemm --
  but the quantizer's own BN-folding pass must be exercised, so BN has to stay.
  It also only targets opset >= 18 and reaches 17 by version conversion.
* The TorchScript exporter fuses Conv+BN only in its "eval peephole" pass,
  which runs when constant folding is on *and* ``training`` is EVAL.  With
  PRESERVE (model in eval mode) the peephole is skipped, BN is exported as a
  plain inference BatchNormalization (one output, training_mode=0), and
  constant folding still runs, so Linear weights on 3-D inputs are stored
  pre-transposed for MatMul instead of behind a Transpose node.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from importlib import metadata
from pathlib import Path

from ._weights import write_atomic
from .specs import OPSET, get_spec

_PKG_DIR = Path(__file__).resolve().parent
# Every source file whose content determines the exported model (the weight
# fixture models/weights/NAME.npz is hashed too, see cache_key).
_SOURCE_FILES = ("specs.py", "zoo.py", "data.py", "_weights.py", "_export.py")
CACHE_ENV = "OQ_MODEL_CACHE"


def default_cache_dir() -> Path:
    """``$OQ_MODEL_CACHE``, else ``$XDG_CACHE_HOME/oq/models``, else ``~/.cache/oq/models``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "oq" / "models"


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # pragma: no cover - unusual installs
        import torch

        return torch.__version__


def cache_key(name: str) -> str:
    """Hash of the model name, its sources, its weight fixture's bytes, the torch version and the opset."""
    from ._weights import weights_path

    get_spec(name)
    h = hashlib.sha256()
    h.update(f"{name}\0torch={_torch_version()}\0opset={OPSET}\0".encode())
    for fname in _SOURCE_FILES:
        h.update(fname.encode() + b"\0")
        h.update((_PKG_DIR / fname).read_bytes())
    fixture = weights_path(name)
    h.update(b"weights\0" + (fixture.read_bytes() if fixture.is_file() else b"none"))
    return h.hexdigest()[:16]


def cached_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    d = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return d / f"{name}-{cache_key(name)}.onnx"


def _dynamic_axes(spec) -> dict[str, dict[int, str]]:
    axes = {}
    for tname, shape in {**spec.inputs, **spec.outputs}.items():
        axes[tname] = {i: d for i, d in enumerate(shape) if isinstance(d, str)}
    return axes


def _rename_anonymous_initializers(model) -> None:
    """Give folded initializers (``onnx::MatMul_64``) readable names (``attn.q.MatMul.B``)."""
    graph = model.graph
    consumers: dict[str, list[tuple[object, int]]] = {}
    for node in graph.node:
        for idx, inp in enumerate(node.input):
            consumers.setdefault(inp, []).append((node, idx))
    taken = {i.name for i in graph.initializer} | {n for node in graph.node for n in node.output}
    for init in graph.initializer:
        uses = consumers.get(init.name, [])
        if not init.name.startswith("onnx::") or len(uses) != 1:
            continue
        node, idx = uses[0]
        base = node.name.strip("/").replace("/", ".") or node.op_type
        new = f"{base}.{'ABCDEFGH'[idx] if idx < 8 else idx}"
        if new in taken:
            continue
        taken.add(new)
        node.input[idx] = new
        init.name = new


def _materialise_shared_initializers(model) -> None:
    """Replace ``Identity(initializer)`` nodes by a copy of the initializer.

    The TorchScript exporter deduplicates parameters with identical values and
    feeds the duplicates through Identity nodes.  Training produces such
    twins: the two BatchNorm betas that feed the same residual Add always
    receive the same gradient, so from the same (zero) init they stay equal.
    Each consumer gets its own initializer again, as in the torch model.
    """
    import onnx

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    for node in list(graph.node):
        if node.op_type == "Identity" and node.input[0] in inits and node.output[0] not in outputs:
            copy = onnx.TensorProto()
            copy.CopyFrom(inits[node.input[0]])
            copy.name = node.output[0]
            graph.initializer.append(copy)
            graph.node.remove(node)


def export_model(name: str):
    """Export reference model ``name`` and return the checked ``onnx.ModelProto``."""
    import onnx
    import torch

    from .data import make_inputs
    from .zoo import load_torch

    spec = get_spec(name)
    model = load_torch(name)
    example = torch.from_numpy(make_inputs(name, 2, seed=0)[spec.input_name])
    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        # legacy-exporter deprecation notice and the "constant folding with
        # PRESERVE" advice (harmless here: the model is in eval mode).
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (example,),
            buf,
            dynamo=False,
            input_names=[spec.input_name],
            output_names=[spec.output_name],
            dynamic_axes=_dynamic_axes(spec),
            opset_version=OPSET,
            training=torch.onnx.TrainingMode.PRESERVE,
            do_constant_folding=True,
        )
    proto = onnx.load_from_string(buf.getvalue())
    _materialise_shared_initializers(proto)
    _rename_anonymous_initializers(proto)
    proto.graph.name = name
    proto.doc_string = f"oq reference model {name!r}: {spec.description}"
    for key, value in (("oq.model", name), ("oq.cache_key", cache_key(name)), ("torch", _torch_version())):
        prop = proto.metadata_props.add()
        prop.key, prop.value = key, value
    onnx.checker.check_model(proto, full_check=True)
    bad = {n.op_type for n in proto.graph.node if n.domain not in ("", "ai.onnx")}
    assert not bad, f"non-standard ops in {name}: {bad}"
    if spec.has_batchnorm:
        assert any(n.op_type == "BatchNormalization" for n in proto.graph.node), "BN was folded away"
    return proto


def build(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the path of the ONNX file for ``name``, exporting it on a cache miss.

    The cache directory defaults to :func:`default_cache_dir`, shared by every
    checkout of this user.  The file name carries :func:`cache_key`, so any
    change to the model sources, the weight fixture or the torch version
    produces a new file.  Writes go to a temp file in the
    same directory followed by ``os.replace``, so concurrent builders never
    expose a partial file (the last writer wins with identical content).
    """
    path = cached_path(name, cache_dir)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    data = export_model(name).SerializeToString()
    write_atomic(path, data)
    return path
