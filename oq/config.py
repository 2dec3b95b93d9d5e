"""One typed run configuration: every option of `oq run` / `oq.quantize`, validated once.

The CLI and the Python API both build a RunConfig; passes receive the values they need through their constructors
and never see the whole configuration or the command line. Errors name the option as the user spelled it on the
command line (and its keyword in the API).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from .errors import OqError

CPU_CHOICES = ("auto", "vnni", "avx2", "avx512", "arm64")
EXPORT_FORMATS = ("qdq", "qoperator")
# weight rounding (one at most): None or "rtn" round to nearest; "adaround" learns up/down per weight, "brecq" and
# "qdrop" per block with activation steps, from calibration data (torch)
ROUNDING_ALGOS = ("rtn", "adaround", "brecq", "qdrop")
# combinable with any rounding (numpy and onnxruntime only): smoothquant before calibration, bias-correction after
# the weights are final
EXTRA_ALGOS = ("smoothquant", "bias-correction")
ALGO_CHOICES = ROUNDING_ALGOS + EXTRA_ALGOS
TORCH_ALGOS = ("adaround", "brecq", "qdrop")
ALGO_SEPARATORS = re.compile(r"[+,]")
DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")

# keyword -> command-line flag, so one message serves both entry points
FLAGS = {"target": "--target", "calib": "--calib", "batch_size": "--batch-size", "calib_size": "--calib-size",
         "calib_method": "--calib-method", "percentile": "--percentile", "max_memory_mb": "--max-memory",
         "preprocess": "--preprocess", "exclude": "--exclude", "overrides": "--override",
         "weight_bits": "--weight-bits", "act_bits": "--act-bits", "cpu": "--cpu", "equalize": "--equalize",
         "export_format": "--format", "progress": "--quiet", "plugins": "--plugin", "algo": "--algo",
         "device": "--device", "algo_iters": "--algo-iters", "smoothquant_alpha": "--smoothquant-alpha"}


def option_error(name: str, problem: str) -> OqError:
    flag = FLAGS.get(name)
    where = f"{flag} ({name})" if flag and flag.lstrip("-").replace("-", "_") != name else (flag or name)
    return OqError(f"{where}: {problem}")


@dataclass(frozen=True)
class RunConfig:
    """Everything a quantization run is told. Build with keywords; `validate()` runs on construction."""

    target: Any = "tensorrt"  # built-in name, a .toml path, or an oq.target.Target
    calib: Any = None  # .npz / folder / "module:function" / "random" / callable / oq.data.CalibrationData
    batch_size: int = 16
    calib_size: int | None = None
    calib_method: str | None = None  # an observer name; None: the target's choice per spec
    percentile: float | None = None
    max_memory_mb: float | None = None
    preprocess: str | None = None
    exclude: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()
    weight_bits: int | None = None
    act_bits: int | None = None
    cpu: str = "auto"
    equalize: bool | None = None  # None: as the target says
    export_format: str = "qdq"
    # None: a progress bar only when stderr is a terminal; True: always; False: never
    progress: bool | str | None = None
    plugins: tuple[str, ...] = ()  # modules imported before anything else (they may register observers)
    pipeline: str = "oq.passes.pipeline"  # module providing preparation() and quantization() pass lists
    # None / "rtn": round to nearest; "adaround" (per layer), "brecq", "qdrop" (per block): learned from the
    # calibration data with torch
    algo: str | None = None
    device: str = "cpu"  # where torch runs the reconstruction: "cpu" or "cuda"
    algo_iters: int | None = None  # optimisation steps per layer or block; None: the algorithm's default
    # SmoothQuant's migration strength (0 < alpha < 1); None: searched per layer on the calibration data
    smoothquant_alpha: float | None = None

    def __post_init__(self):
        for name in ("exclude", "overrides", "plugins"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            object.__setattr__(self, name, tuple(value or ()))
        self.validate()

    def validate(self) -> None:
        from .plugins import load_plugins

        load_plugins(self.plugins)  # first: what they register (observers) is then known to the checks below
        for name in ("batch_size", "calib_size", "weight_bits", "act_bits", "algo_iters"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise option_error(name, f"must be an integer, got {value!r}")
        if self.batch_size < 1:
            raise option_error("batch_size", f"must be >= 1, got {self.batch_size}")
        if self.algo_iters is not None and self.algo_iters < 1:
            raise option_error("algo_iters", f"must be >= 1, got {self.algo_iters}")
        if self.calib_size is not None and self.calib_size < 1:
            raise option_error("calib_size", f"must be >= 1, got {self.calib_size}")
        for name in ("weight_bits", "act_bits"):
            bits = getattr(self, name)
            if bits is not None and not 2 <= bits <= 16:
                raise option_error(name, f"must be between 2 and 16, got {bits}")
        if self.percentile is not None and not 50.0 <= self.percentile <= 100.0:
            raise option_error("percentile", f"must be between 50 and 100, got {self.percentile}")
        if self.max_memory_mb is not None and not self.max_memory_mb > 0:
            raise option_error("max_memory_mb", f"must be a positive number of MB, got {self.max_memory_mb}")
        if not (self.progress is None or isinstance(self.progress, bool) or self.progress == "auto"):
            raise OqError(f"progress must be None or 'auto' (a bar on a terminal only), True or False, got "
                          f"{self.progress!r}")
        if self.cpu not in CPU_CHOICES:
            raise option_error("cpu", f"unknown cpu {self.cpu!r}; choose from {', '.join(CPU_CHOICES)}")
        if self.export_format not in EXPORT_FORMATS:
            raise option_error("export_format", f"unknown export format {self.export_format!r}; choose "
                               f"{' or '.join(EXPORT_FORMATS)}")
        self._validate_algo()
        for pattern in self.exclude:
            if not pattern:
                raise option_error("exclude", "empty pattern")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise option_error("exclude", f"{pattern!r} is not a valid regular expression ({exc})") from None
        from .overrides import parse_override

        for text in self.overrides:
            parse_override(text)  # its errors name --override and the entry
        if self.calib_method is not None:
            from .observers import observer_names

            if self.calib_method not in observer_names():
                raise option_error("calib_method", f"unknown method {self.calib_method!r}; available: "
                                   f"{', '.join(observer_names())} (register your own with oq.register_observer, "
                                   f"from the CLI through --plugin MODULE)")

    def _validate_algo(self) -> None:
        algos = parse_algo(self.algo)
        if not isinstance(self.device, str) or not DEVICE_RE.fullmatch(self.device):
            raise option_error("device", f"unknown device {self.device!r}; choose cpu or cuda")
        alpha = self.smoothquant_alpha
        if alpha is not None:
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
                raise option_error("smoothquant_alpha", f"must be a number between 0 and 1 (exclusive), got "
                                   f"{alpha!r}")
            if "smoothquant" not in algos:
                raise option_error("smoothquant_alpha", "applies to --algo smoothquant only")
        rounding = self.rounding_algo
        if rounding not in TORCH_ALGOS:
            return  # torch is neither needed nor imported
        try:
            import torch
        except ImportError:
            raise option_error("algo", f"{rounding} needs torch: pip install 'oq-quant[torch]'") from None
        if self.device != "cpu" and not torch.cuda.is_available():
            raise option_error("device", f"{self.device} asked for but torch sees no CUDA device (torch "
                               f"{torch.__version__}); use --device cpu")

    @property
    def algos(self) -> tuple[str, ...]:
        """The --algo names, each once, in the order given ("rtn" included when named)."""
        return parse_algo(self.algo)

    @property
    def rounding_algo(self) -> str | None:
        """The weight-rounding algorithm asked for (adaround, brecq, qdrop), None for round to nearest."""
        return next((a for a in self.algos if a in TORCH_ALGOS), None)

    @property
    def parsed_overrides(self) -> list:
        """The --override texts as oq.overrides.Override objects (what passes receive)."""
        from .overrides import parse_override

        return [o for text in self.overrides for o in parse_override(text)]

    @property
    def observer_args(self) -> dict[str, Any]:
        """Options an observer may take; each observer gets those its signature names."""
        return {} if self.percentile is None else {"percentile": self.percentile}

    def as_dict(self) -> dict[str, Any]:
        """The options as plain values (for the report)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "target" and not isinstance(value, str):
                value = getattr(value, "name", str(value))
            elif f.name == "calib" and not isinstance(value, (str, type(None))):
                value = getattr(value, "where", None) or getattr(value, "__name__", type(value).__name__)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def parse_algo(algo: str | None) -> tuple[str, ...]:
    """'smoothquant+adaround' (or with ',') as ('smoothquant', 'adaround'); refuses unknown names and two
    weight-rounding algorithms at once."""
    if algo is None:
        return ()
    if not isinstance(algo, str):
        raise option_error("algo", f"must be a string such as 'adaround' or 'smoothquant+bias-correction', got "
                           f"{algo!r}")
    names = [a.strip().lower() for a in ALGO_SEPARATORS.split(algo)]
    for name in names:
        if name not in ALGO_CHOICES:
            raise option_error("algo", f"unknown algorithm {name!r}; choose {', '.join(ALGO_CHOICES)} (one weight "
                               f"rounding at most, others joined with '+' or ',')")
    rounding = list(dict.fromkeys(a for a in names if a in ROUNDING_ALGOS))
    if len(rounding) > 1:
        raise option_error("algo", f"{' and '.join(rounding)} are both weight-rounding algorithms; choose one")
    return tuple(dict.fromkeys(names))


def keyword_names() -> list[str]:
    return [f.name for f in fields(RunConfig)]


__all__ = ["RunConfig", "CPU_CHOICES", "EXPORT_FORMATS", "ALGO_CHOICES", "option_error", "keyword_names",
           "parse_algo"]
