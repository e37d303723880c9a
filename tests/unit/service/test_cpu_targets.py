import platform

import pytest

from service.artifacts import cpu_targets
from service.artifacts.cpu_targets import LEVELS, NATIVE, PORTABLE


def test_each_level_needs_the_one_below_it() -> None:
    v3, v4 = LEVELS["x86-64-v3"][0], LEVELS["x86-64-v4"][0]
    assert v3 < v4
    assert {"avx2", "fma", "bmi2", "f16c", "movbe"} <= v3
    assert not any(flag.startswith("avx512") for flag in v3)


def test_a_level_compiles_for_its_own_march_and_vector_width() -> None:
    assert cpu_targets.inductor_options(PORTABLE) == {"cpp.march": "x86-64-v3", "cpp.simdlen": 256}
    assert cpu_targets.inductor_options("x86-64-v4")["cpp.simdlen"] == 512
    assert cpu_targets.inductor_options(NATIVE) == {}  # inductor's own: -march=native


def test_a_native_build_needs_the_instruction_sets_of_the_cpu_that_built_it() -> None:
    cpu = {"fpu", "vmx", "ht", "hypervisor", "sse4_2", "avx2", "avx512f", "amx_tile", "pni"}
    assert cpu_targets.needed_flags(NATIVE, cpu) == {"sse4_2", "avx2", "avx512f", "amx_tile", "pni"}
    assert cpu_targets.needed_flags(PORTABLE, cpu) == LEVELS[PORTABLE][0]


def test_an_unknown_target_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown CPU target 'haswell': choose from x86-64-v3"):
        cpu_targets.check_target("haswell")
    cpu_targets.check_target(NATIVE)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the levels are x86-64's")
def test_this_machine_defaults_to_the_portable_level() -> None:
    assert cpu_targets.default_target() == PORTABLE
    cpu_targets.check_target("x86-64-v4")  # compiling for a level needs no such CPU here
