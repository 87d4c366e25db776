"""The CPU capability and the product path chosen per weight format: detected, used, reported."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moespec.cli import main
from moespec.kernels.cpu import CpuPaths, cpu_flags, cpu_paths
from moespec.kernels.linear import PackedWeight, pack
from moespec.kernels.native import PairWeight, unavailable_here

ROOT = Path(__file__).resolve().parent.parent
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def paths(capability: str, flags: tuple[str, ...], bf16: bool = True) -> CpuPaths:
    return CpuPaths(
        capability=capability,
        flags=flags,
        onednn_max_isa=None,
        onednn_bf16=bf16,
        onednn_fp32=True,
        native="turned off by MOESPEC_NATIVE",
        native_bf16=None,
        native_int8=None,
        bf16="onednn-packed" if bf16 else "aten-linear",
        fp32="onednn-packed",
        int8="aten-int8pack-mm",
    )


def test_cpu_flags_are_read_from_the_first_processor():
    cpuinfo = "processor : 0\nflags : fpu sse avx2 avx512f avx512_bf16 amx_bf16\n\nflags : avx2\n"
    assert cpu_flags(cpuinfo) == ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    assert cpu_flags("processor : 0\n") == ()


@pytest.mark.parametrize(
    "capability, flags, family",
    [
        ("AVX512", ("avx2", "avx512f", "avx512_bf16", "amx_bf16"), "amx"),
        ("AVX512", ("avx2", "avx512f", "avx512_bf16"), "avx512-bf16"),
        ("AVX512", ("avx2", "avx512f"), "avx512"),
        ("AVX2", ("avx2", "avx512f", "avx512_bf16"), "avx2"),  # dispatch lowered by env
        ("DEFAULT", (), "other"),
    ],
)
def test_family_follows_the_flags_as_the_dispatch_level_lowers_them(capability, flags, family):
    assert paths(capability, flags).family == family


def test_the_chosen_path_of_each_format_and_why_it_fell_back():
    fallback = paths("AVX2", ("avx2",), bf16=False)
    assert fallback.path(torch.bfloat16) == "aten-linear"
    assert "does not pack bf16" in fallback.fallback("bf16")
    assert fallback.path("int8") == "aten-int8pack-mm" and fallback.fallback("int8") is None
    assert fallback.path(torch.float16) == "aten-linear"


def test_packing_follows_the_chosen_bf16_path():
    packed = pack(torch.zeros(16, 16, dtype=torch.bfloat16))
    assert isinstance(packed, PackedWeight) == (cpu_paths().bf16 == "onednn-packed")
    assert isinstance(packed, PairWeight) == (cpu_paths().bf16 == "native-pairs")


def test_env_prints_one_line_per_fact(capsys):
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    keys = [line.split(":", 1)[0] for line in lines]
    assert keys == [
        "torch",
        "cpu capability",
        "onednn max isa",
        "native loops",
        "native model pass",
        "bf16 path",
        "fp32 path",
        "int8 path",
        "threads",
        "memory",
        "resident",
    ]
    assert lines[0] == f"torch: {torch.__version__}"
    assert lines[1].startswith(f"cpu capability: {torch.backends.cpu.get_cpu_capability()} ")
    assert lines[4] == f"native model pass: {cpu_paths().native_pass or 'available'}"


def test_env_with_a_model_adds_its_footprint_line(capsys):
    from moespec.demo import demo_paths

    assert main(["env", "--model", str(demo_paths()[0]), "--weights", "int8"]) == 0
    model = [line for line in capsys.readouterr().out.splitlines() if line.startswith("model:")]
    assert len(model) == 1 and "GB of int8 weights" in model[0]
    assert "context that fits: 1024 of 1024" in model[0]


def run_avx2(code: str, **env) -> str:
    env = {**os.environ, **AVX2_ONLY, "PYTHONPATH": str(ROOT), **env}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


AVX2_FACTS = (
    "import json, torch\n"
    "from moespec.cli import main\n"
    "from moespec.kernels import ExpertWeights\n"
    "main(['env', '--json'])\n"
    "e = ExpertWeights(torch.zeros(2, 32, 16).bfloat16(), torch.zeros(2, 16, 16).bfloat16())\n"
    "print(json.dumps({'packed': e.pack().is_packed}))\n"
)


def test_on_an_avx2_dispatch_bf16_takes_the_avx2_native_loops():
    if "avx2" not in cpu_flags() or "fma" not in cpu_flags():
        pytest.skip("this CPU has no AVX2 with FMA: there is no AVX2 path to force")
    facts, used = (json.loads(line) for line in run_avx2(AVX2_FACTS).splitlines())
    assert facts["capability"] == "AVX2" and facts["family"] == "avx2"
    assert facts["onednn_max_isa"] == "AVX2"
    if (why := unavailable_here()) is not None:
        pytest.skip(f"no native loops on this machine: {why}")
    assert facts["native"] == facts["native_pass"] == "available"  # else the build failed
    assert facts["paths"] == {
        "bf16": "native-pairs",
        "fp32": "onednn-packed",
        "int8": "native-int8-pairs",
    }
    assert facts["native_functions"] == {
        "bf16": "moespec_bf16_pairs_avx2",
        "int8": "moespec_int8_pairs_avx2",
        "attention": "moespec_attend_bf16_avx2",
        "pass": "moespec_step",
    }
    assert used == {"packed": True}


def test_on_an_avx2_dispatch_without_native_loops_bf16_falls_back_and_says_so(tmp_path):
    if "avx2" not in cpu_flags():
        pytest.skip("this CPU has no AVX2: there is no AVX2 path to force")
    out = run_avx2(AVX2_FACTS, MOESPEC_NATIVE="0", MOESPEC_CACHE=str(tmp_path))
    facts, used = (json.loads(line) for line in out.splitlines())
    assert facts["capability"] == "AVX2" and facts["family"] == "avx2"
    assert facts["paths"]["bf16"] == "aten-linear" and "bf16" in facts["fallbacks"]
    assert "turned off by MOESPEC_NATIVE" in facts["fallbacks"]["bf16"]
    assert facts["paths"]["int8"] == "aten-int8pack-mm"
    assert used == {"packed": False}
