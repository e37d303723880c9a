"""The CPU an AOTInductor package is compiled for, and what a CPU needs to run it.

Left to itself, Inductor compiles with ``-march=native`` and the widest vector instructions of
the machine that exports: a package built on an AVX-512 machine may use AVX-512 anywhere, not
only in the kernels its metadata names (``AOTI_CPU_ISA``), and dies of an illegal instruction on
an older CPU. ``tensorgate export`` compiles for an x86-64 microarchitecture level instead,
``x86-64-v3`` unless told otherwise (AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE: every x86-64 server
CPU since 2013–2015), and writes into the package the CPU flags that level needs, which the
server checks before it loads the package. The matrix products and attention are libtorch's own
kernels (oneDNN, MKL), which pick this CPU's best instructions when they run, so the level costs
little (docs/performance.md#artifacts). ``native`` compiles for the exporting machine and records
its instruction-set flags.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Collection
from pathlib import Path

PORTABLE = "x86-64-v3"
NATIVE = "native"

_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}
_V4 = _V3 | {"avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"}
LEVELS: dict[str, tuple[frozenset[str], int]] = {"x86-64-v3": (_V3, 256), "x86-64-v4": (_V4, 512)}
"""gcc's x86-64 levels: the /proc/cpuinfo flags each needs, and its vector width in bits."""
TARGETS = (*LEVELS, NATIVE)

# The instruction-set extensions among /proc/cpuinfo's flags (not features such as ht or vmx):
# what a native build may have used.
_ISA_PREFIXES = (
    "abm",
    "adx",
    "aes",
    "amx",
    "avx",
    "bmi",
    "clflushopt",
    "clwb",
    "cx16",
    "f16c",
    "fma",
    "gfni",
    "lahf_lm",
    "movbe",
    "pclmulqdq",
    "pni",
    "popcnt",
    "rdrand",
    "rdseed",
    "sha_ni",
    "sse",
    "ssse",
    "vaes",
    "vpclmulqdq",
    "xsave",
)


def default_target() -> str:
    """``x86-64-v3`` on x86-64, where the levels are defined; ``native`` elsewhere."""
    return PORTABLE if platform.machine().lower() in ("x86_64", "amd64") else NATIVE


def check_target(target: str) -> None:
    """Raise ValueError, naming the choices, for a target this machine cannot compile for."""
    if target not in TARGETS:
        raise ValueError(f"unknown CPU target {target!r}: choose from {', '.join(TARGETS)}")
    if target != NATIVE and default_target() == NATIVE:
        raise ValueError(
            f"{target} is an x86-64 level and this machine is {platform.machine()}: use native"
        )


def inductor_options(target: str) -> dict[str, object]:
    """Inductor's configuration for compiling for ``target``."""
    if target == NATIVE:
        return {}
    return {"cpp.march": target, "cpp.simdlen": LEVELS[target][1]}


def needed_flags(target: str, cpu: Collection[str] | None = None) -> frozenset[str]:
    """The /proc/cpuinfo flags a CPU needs to run code compiled for ``target``; for ``native``,
    the instruction-set flags of ``cpu`` (this CPU's by default)."""
    if target != NATIVE:
        return LEVELS[target][0]
    flags = cpu_flags() if cpu is None else cpu
    return frozenset(f for f in flags if f.startswith(_ISA_PREFIXES))


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's flags from /proc/cpuinfo; empty (nothing checked) where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()
