"""``auto`` dtype: bfloat16 only on CPUs that compute it natively; explicit settings pass through."""

from __future__ import annotations

from node_agent.dtype import cpu_flags, resolve_dtype
from node_agent.node import engine_command
from node_agent.settings import NodeSettings

AVX2_EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse sse2 avx avx2 fma bmi2 f16c\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_auto_is_float32_without_native_bf16_and_bfloat16_with_it() -> None:
    assert resolve_dtype("auto", cpu_build=True, cpuinfo=AVX2_EPYC) == "float32"
    assert resolve_dtype("auto", cpu_build=True, cpuinfo=SAPPHIRE) == "bfloat16"
    assert resolve_dtype("auto", cpu_build=False, cpuinfo=AVX2_EPYC) == "auto"  # vLLM decides on GPUs


def test_an_explicit_dtype_is_kept_whatever_the_cpu() -> None:
    assert resolve_dtype("bfloat16", cpu_build=True, cpuinfo=AVX2_EPYC) == "bfloat16"
    assert resolve_dtype("float32", cpu_build=True, cpuinfo=SAPPHIRE) == "float32"


def test_flags_are_read_from_the_first_processor() -> None:
    assert "avx2" in cpu_flags(AVX2_EPYC) and "avx512_bf16" not in cpu_flags(AVX2_EPYC)
    assert cpu_flags("no flags here") == frozenset()


def test_the_engine_command_carries_the_resolved_dtype(tmp_path) -> None:  # noqa: ANN001
    cmd = engine_command(NodeSettings(dtype="auto", log_dir=tmp_path), tmp_path)
    assert cmd[cmd.index("--dtype") + 1] == resolve_dtype("auto")
