"""The deployment CPU: which kernels onnxruntime will run (VNNI or not), detected or given."""
from __future__ import annotations

import platform
from pathlib import Path

from ..config import CPU_CHOICES  # noqa: F401  (one list of CPUs, validated with the run options)

SATURATING_CPUS = ("avx2", "avx512")
CPU_WORDS = {
    "vnni": "x86 with VNNI (VPDPBUSD: exact int32 accumulation)",
    "avx2": "x86 AVX2 without VNNI (VPMADDUBSW: pairs of u8*s8 products saturate in int16)",
    "avx512": "x86 AVX-512 without VNNI (VPMADDUBSW: pairs of u8*s8 products saturate in int16)",
    "arm64": "ARM64 (UDOT/SDOT or widening multiplies: exact int32 accumulation)",
}


def cpu_flag_set(cpuinfo_text: str) -> set[str]:
    """The flags of the first processor listed in /proc/cpuinfo text."""
    for line in cpuinfo_text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def detect_cpu(cpuinfo: "str | Path" = "/proc/cpuinfo", machine: str | None = None) -> tuple[str, str]:
    """(kind, how it was found) for this machine: kind is one of vnni, avx2, avx512, arm64."""
    machine = (machine or platform.machine() or "").lower()
    if machine in ("arm64", "aarch64") or machine.startswith("arm"):
        return "arm64", f"machine {machine}"
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return "avx2", "CPU flags unreadable (no /proc/cpuinfo): assumed avx2, the case that needs the guard"
    flags = cpu_flag_set(text)
    for f in ("avx512_vnni", "avx_vnni", "amx_int8"):
        if f in flags:
            return "vnni", f"{f} in /proc/cpuinfo"
    if "avx512bw" in flags:
        return "avx512", "avx512bw without vnni in /proc/cpuinfo"
    if "avx2" in flags:
        return "avx2", "avx2 without vnni in /proc/cpuinfo"
    return "avx2", "no avx2 in /proc/cpuinfo (SSE kernels, some also pair products): assumed avx2"


def resolve_cpu(choice: str) -> tuple[str, str]:
    """Map the `cpu` option (auto, vnni, avx2, avx512, arm64) to a CPU kind and a sentence saying why."""
    if choice not in CPU_CHOICES:
        raise ValueError(f"unknown cpu {choice!r}; choose from {', '.join(CPU_CHOICES)}")
    if choice == "auto":
        kind, how = detect_cpu()
        return kind, f"auto: this machine, {how}"
    return choice, "given"
