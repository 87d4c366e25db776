"""The native products (moespec.kernels.native): the pair layout, its bits, the fallback, and
the C entry points' checks of their arguments. Tests skip only with the machine's own reasons
(tests.native): where it can build the loops, a build that fails fails them."""

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch

from moespec.calibrate.timing import read_bandwidth
from moespec.kernels import native as nat
from moespec.kernels.cpu import cpu_paths
from moespec.kernels.isa import cpu_flags
from moespec.kernels.linear import linear, pack
from moespec.kernels.native import (
    _SIGNATURES,
    PairWeight,
    batch_products,
    call,
    family_lacks,
    int8_pairs_product,
    native,
    native_product,
    pack_pairs,
    pairs_product,
    read_sum,
    unavailable_here,
    unpack_pairs,
)
from moespec.kernels.quant import int8_reference, quantize_int8, quantize_reference
from tests.native import needs_function

FAMILY = cpu_paths().family
# the machine's own reasons only: where it has none, a failed build fails these tests
NO_LIBRARY = unavailable_here()
NO_PAIRS = NO_LIBRARY or family_lacks("bf16", FAMILY)
NO_INT8 = NO_LIBRARY or family_lacks("int8", FAMILY)
needs_pairs = pytest.mark.skipif(NO_PAIRS is not None, reason=str(NO_PAIRS))
needs_int8 = pytest.mark.skipif(NO_INT8 is not None, reason=str(NO_INT8))
needs_native = pytest.mark.skipif(NO_LIBRARY is not None, reason=str(NO_LIBRARY))
# odd widths, heights off the 64-row groups, and a real expert half
SHAPES = [(1, 2), (5, 3), (63, 31), (64, 64), (130, 97), (256, 2048)]


def exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in float64: the value a bf16 result is one rounding away from."""
    return x.double() @ weight.double().T


@pytest.mark.parametrize("shape", SHAPES)
def test_pair_layout_holds_the_weight_exactly(shape):
    weight = torch.randn(*shape).bfloat16()
    packed = pack_pairs(weight)
    assert packed.shape == (-(-shape[0] // 64), -(-shape[1] // 2), 64, 2)
    assert torch.equal(unpack_pairs(packed, shape), weight)
    # element (o, j) sits at [o // 64, j // 2, o % 64, j % 2]
    o, j = shape[0] - 1, shape[1] - 1
    assert packed[o // 64, j // 2, o % 64, j % 2] == weight[o, j]


@needs_pairs
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_pair_products_are_within_one_rounding_of_the_exact_product(shape, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(*shape, generator=generator).bfloat16()
    x = torch.randn(rows, shape[1], generator=generator).bfloat16()
    got = pairs_product(x, PairWeight(weight)).double()
    want = exact(x, weight)
    # fp32 accumulation over `in` terms, then one bf16 rounding (relative 2^-8)
    scale = x.double().abs() @ weight.double().abs().T
    bound = want.abs() * 2.0**-8 + scale * shape[1] * 2.0**-24 + 1e-30
    assert (got - want).abs().le(bound).all()
    assert got.shape == (rows, shape[0])


@needs_pairs
@pytest.mark.parametrize("shape", [(130, 97), (2048, 256)])
def test_pair_products_give_each_row_its_one_row_bits(shape):
    weight = PairWeight(torch.randn(*shape).bfloat16())
    x = torch.randn(13, shape[1]).bfloat16()  # two full tiles of six rows and one more
    alone = torch.cat([pairs_product(x[i : i + 1], weight) for i in range(13)])
    for n in range(1, 14):
        assert torch.equal(pairs_product(x[:n], weight), alone[:n]), n


@needs_pairs
def test_pair_products_do_not_depend_on_the_threads():
    weight = PairWeight(torch.randn(512, 256).bfloat16())
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(pairs_product(x, weight, threads=1), pairs_product(x, weight, threads=2))


@needs_pairs
def test_linear_takes_pair_weights_with_a_bias_and_leading_dims():
    weight = torch.randn(96, 40).bfloat16()
    bias = torch.randn(96).bfloat16()
    x = torch.randn(2, 3, 40).bfloat16()
    got = linear(x, PairWeight(weight), bias)
    assert got.shape == (2, 3, 96)
    want = pairs_product(x.reshape(6, 40), PairWeight(weight)).view(2, 3, 96) + bias
    assert torch.equal(got, want)


@needs_pairs
def test_pair_products_refuse_other_input_dtypes():
    with pytest.raises(TypeError, match="wants bf16 input"):
        pairs_product(torch.randn(1, 8), PairWeight(torch.randn(4, 8).bfloat16()))


def test_pair_weights_refuse_other_dtypes():
    with pytest.raises(ValueError, match="bf16"):
        PairWeight(torch.randn(4, 8))


def test_the_paths_are_the_native_layouts_exactly_where_they_are_available():
    assert (cpu_paths().bf16 == "native-pairs") == (NO_PAIRS is None)
    assert (cpu_paths().int8 == "native-int8-pairs") == (NO_INT8 is None)
    assert isinstance(pack(torch.zeros(64, 64).bfloat16()), PairWeight) == (NO_PAIRS is None)
    q = quantize_int8(torch.randn(64, 64).bfloat16())
    assert (q.pairs is not None) == (NO_INT8 is None)
    assert (q.values is None) == (NO_INT8 is None)  # held once, in one layout
    assert quantize_int8(torch.randn(64, 64)).pairs is None  # fp32 scales: PyTorch's kernel


@pytest.mark.parametrize("shape", [(1, 3), (63, 31), (130, 97)])
def test_the_pair_layout_holds_int8_values_exactly(shape):
    values = torch.randint(-127, 128, shape, dtype=torch.int8)
    packed = pack_pairs(values)
    assert packed.dtype == torch.int8
    assert packed.shape == (-(-shape[0] // 64), -(-shape[1] // 2), 64, 2)
    assert torch.equal(unpack_pairs(packed, shape), values)


def int16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 loops' input quantization, spelled out in PyTorch: per row, m = max |x|,
    q = round-half-even(x * (32767 / m)) in fp32, scale m / 32767 (all-zero rows: 0, 0)."""
    m = x.float().abs().amax(dim=1, keepdim=True)
    inv = torch.where(m > 0, torch.tensor(32767.0) / m, torch.zeros_like(m))
    return torch.round(x.float() * inv).clamp(-32767, 32767), m / 32767


INT8_SHAPES = [(1, 3), (63, 31), (130, 97), (256, 2048), (64, 600)]


@needs_int8
@pytest.mark.parametrize("shape", INT8_SHAPES)
def test_int8_products_are_the_int16_input_math_within_one_rounding(shape):
    generator = torch.Generator().manual_seed(shape[1])
    q = quantize_int8(torch.randn(*shape, generator=generator).bfloat16())
    x = torch.randn(13, shape[1], generator=generator).bfloat16()
    x[5] = 0  # an all-zero row gives zeros
    xq, xs = int16_rows(x)
    dot = xq.double() @ q.rows().double().T  # exact: the loops' int32 blocks hold it exactly
    want = dot * q.scales.double() * xs.double()
    got = int8_pairs_product(x, q.pairs, q.scales).double()
    # one bf16 rounding, fp32 sums of the 128-pair blocks, two fp32 products
    mag = (xq.double().abs() @ q.rows().double().abs().T) * q.scales.double() * xs.double()
    blocks = -(-shape[1] // 256)
    bound = want.abs() * 2.0**-8 + mag * (blocks + 3) * 2.0**-24 + 1e-30
    assert (got - want).abs().le(bound).all()
    assert got[5].eq(0).all()
    x[7, -1] = float("nan")
    x[8, 0] = float("inf")
    broken = int8_pairs_product(x, q.pairs, q.scales)
    assert broken[7:9].isnan().all()  # a NaN or an infinite input shows in its row's outputs
    assert torch.equal(broken[:7], int8_pairs_product(x[:7], q.pairs, q.scales))


@needs_int8
@pytest.mark.parametrize("shape", INT8_SHAPES)
def test_int8_products_are_within_the_input_quantization_of_the_reference_with_one_row_bits(
    shape,
):
    generator = torch.Generator().manual_seed(shape[0])
    q = quantize_int8(torch.randn(*shape, generator=generator).bfloat16())
    x = torch.randn(13, shape[1], generator=generator).bfloat16()
    got = int8_pairs_product(x, q.pairs, q.scales).double()
    want = exact(x, q.rows()) * q.scales.double()  # the int8 math on the bf16 inputs
    # each input moves by at most half a step of its row's int16 grid: max |x| / 65534
    step = x.double().abs().amax(dim=1, keepdim=True) / 65534
    moved = step * (q.rows().double().abs().sum(dim=1) * q.scales.double())
    mag = (x.double().abs() @ q.rows().double().abs().T) * q.scales.double()
    bound = want.abs() * 2.0**-8 + moved * 1.001 + mag * 2.0**-18
    assert (got - want).abs().le(bound).all()
    alone = torch.cat([int8_pairs_product(x[i : i + 1], q.pairs, q.scales) for i in range(13)])
    for n in range(1, 14):
        assert torch.equal(int8_pairs_product(x[:n], q.pairs, q.scales), alone[:n]), n
    assert torch.equal(linear(x, q), alone)  # linear takes them, unchunked


INT8_FUNCTIONS = [
    ("moespec_int8_pairs_avx2", ("avx2", "fma")),
    ("moespec_int8_pairs_avx512", ("avx512f", "avx512bw", "avx512vl")),
    ("moespec_int8_pairs_vnni", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")),
]


@needs_native
@pytest.mark.parametrize("function, flags", INT8_FUNCTIONS, ids=[f for f, _ in INT8_FUNCTIONS])
def test_every_int8_pair_function_gives_the_same_bits(function, flags):
    """The AVX2, AVX-512BW and VNNI loops compute the same integers in the same order."""
    needs_function(function, flags)
    q = quantize_int8(torch.randn(130, 600).bfloat16())
    pairs = pack_pairs(q.rows())
    x = torch.randn(9, 600).bfloat16()
    xq, xs = int16_rows(x)
    want = (xq.double() @ q.rows().double().T) * q.scales.double() * xs.double()
    got = native_product(function, pairs, x, 130, q.scales)
    assert (got.double() - want).abs().le(want.abs() * 2.0**-8 + 1e-30).all()
    if native().has("moespec_int8_pairs_avx2") and "fma" in cpu_paths().flags:
        assert torch.equal(got, native_product("moespec_int8_pairs_avx2", pairs, x, 130, q.scales))


# The row-by-row candidates (timed by benchmarks/cpu_paths.py): right values and one-row bits.
CANDIDATES = [
    ("moespec_bf16_avx2", "bf16", ("avx2", "fma")),
    ("moespec_int8_avx2", "int8", ("avx2", "fma")),
    ("moespec_int8_avx512", "int8", ("avx512f", "avx512bw", "avx512vl")),
]


@needs_native
@pytest.mark.parametrize("function, kind, flags", CANDIDATES, ids=[c[0] for c in CANDIDATES])
@pytest.mark.parametrize("shape", [(63, 31), (130, 97), (64, 2048)])
def test_row_by_row_candidates_match_the_reference_with_one_row_bits(function, kind, flags, shape):
    needs_function(function, flags)
    weight = torch.randn(*shape).bfloat16()
    x = torch.randn(9, shape[1]).bfloat16()
    if kind == "bf16":
        got = native_product(function, weight, x, shape[0])
        want = exact(x, weight)
        scale = x.double().abs() @ weight.double().abs().T
    else:
        q = quantize_int8(weight)
        got = native_product(function, q.rows(), x, shape[0], q.scales)
        want = int8_reference(x, q).double()
        scale = (x.double().abs() @ q.rows().double().abs().T) * q.scales.double()
    bound = want.abs() * 2.0**-7 + scale * shape[1] * 2.0**-23 + 1e-30
    assert (got.double() - want).abs().le(bound).all()
    if kind == "bf16":
        call = lambda a: native_product(function, weight, a, shape[0])  # noqa: E731
    else:
        call = lambda a: native_product(function, q.rows(), a, shape[0], q.scales)  # noqa: E731
    alone = torch.cat([call(x[i : i + 1]) for i in range(9)])
    assert torch.equal(call(x), alone)


def _facts(env: dict) -> dict:
    """`moespec env --json` in a fresh process with `env` added (less the memory figures,
    which move from one process to the next)."""
    done = subprocess.run(
        [sys.executable, "-m", "moespec", "env", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    assert facts.pop("memory")["available_bytes"] > 0
    return facts


def test_turning_the_native_loops_off_takes_the_library_path_and_says_so(tmp_path):
    facts = _facts({"MOESPEC_NATIVE": "0", "MOESPEC_CACHE": str(tmp_path)})
    cpu = facts
    assert cpu["paths"]["bf16"] in ("onednn-packed", "aten-linear")
    assert cpu["paths"]["int8"] == "aten-int8pack-mm"
    assert cpu["native"] == "turned off by MOESPEC_NATIVE"
    assert not list(tmp_path.iterdir())  # nothing was built


@pytest.mark.skipif(
    __import__("platform").machine().lower() not in ("x86_64", "amd64"),
    reason="the native loops are x86-64 only: there the reason is the architecture",
)
def test_without_a_compiler_the_library_path_runs_and_says_why(tmp_path):
    env = {"PATH": str(tmp_path), "CC": "", "MOESPEC_CACHE": str(tmp_path / "c")}
    facts = _facts({**env, "MOESPEC_NATIVE": "1"})  # on, whatever this process was given
    cpu = facts
    assert cpu["paths"]["bf16"] in ("onednn-packed", "aten-linear")
    assert cpu["native"] == "no C compiler found ($CC, cc, gcc or clang)"


@needs_native
def test_the_build_is_cached_and_loads_again_without_compiling(tmp_path):
    facts = _facts({"MOESPEC_CACHE": str(tmp_path)})
    built = sorted((tmp_path / "native").glob("*.so"))
    assert len(built) == 1 and not list((tmp_path / "native").glob("*.tmp"))
    stamp = built[0].stat().st_mtime_ns
    assert _facts({"MOESPEC_CACHE": str(tmp_path)}) == facts
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_batch_of_products_gives_each_product_its_own_bits(kind):
    if (NO_PAIRS if kind == "bf16" else NO_INT8) is not None:
        pytest.skip(str(NO_PAIRS if kind == "bf16" else NO_INT8))
    make = pack if kind == "bf16" else quantize_int8
    weights = [make(torch.randn(130, 96).bfloat16()) for _ in range(5)]
    x = torch.randn(7, 96).bfloat16()
    xrow, count, orow = [0, 3, 3, 6, 1], [3, 1, 2, 1, 4], [0, 3, 4, 6, 7]
    got = batch_products(x, weights, xrow, count, orow, 11)
    parts = zip(weights, xrow, count, strict=True)
    want = torch.cat([linear(x[a : a + c], w) for w, a, c in parts])
    assert torch.equal(got, want)


@needs_pairs
def test_a_batch_of_products_refuses_rows_outside_its_input_or_output():
    weights = [pack(torch.randn(64, 32).bfloat16()) for _ in range(2)]
    x = torch.randn(3, 32).bfloat16()
    with pytest.raises(ValueError, match="rows outside"):
        batch_products(x, weights, [0, 3], [1, 1], [0, 1], 2)  # input row 3 of 3
    with pytest.raises(ValueError, match="rows outside"):
        batch_products(x, weights, [0, 1], [1, 2], [0, 1], 2)  # output rows 1-2 of 2
    with pytest.raises(ValueError, match="weights"):
        batch_products(
            x, [weights[0], pack(torch.randn(64, 16).bfloat16())], [0, 1], [1, 1], [0, 1], 2
        )


needs_read_probe = pytest.mark.skipif(
    NO_LIBRARY is not None or "avx2" not in cpu_flags(),
    reason=f"no native read probe on this machine: {NO_LIBRARY or 'a CPU without AVX2'}",
)


@needs_read_probe
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_read_probe_sums_every_byte_it_reads(threads):
    # 2.5 items of 512 KiB and a ragged tail: the probe reads the first multiple of 128 bytes,
    # as 64-bit lanes summed modulo 2^64
    generator = torch.Generator().manual_seed(3)
    data = torch.randint(-(2**62), 2**62, (163_850,), dtype=torch.int64, generator=generator)
    counted = data[: data.numel() * 8 // 128 * 16]
    want = sum(int(v) for v in counted.tolist()) % 2**64
    assert read_sum(data, threads) == want
    data[counted.numel() - 1] += 1  # the last byte read is read
    assert read_sum(data, threads) == (want + 1) % 2**64
    data[-1] += 1  # the tail past it is not
    assert read_sum(data, threads) == (want + 1) % 2**64


def test_the_read_probe_refuses_a_strided_buffer():
    with pytest.raises(ValueError, match="contiguous"):
        read_sum(torch.zeros(64, 64).T)


@needs_read_probe
def test_read_bandwidth_times_the_native_read(monkeypatch):
    calls = []
    real = read_sum
    monkeypatch.setattr("moespec.kernels.native.read_sum", lambda b: calls.append(1) or real(b))
    beta = read_bandwidth(1 << 24, repeats=2)
    assert len(calls) == 3 and beta > 0  # one warm-up and two timed reads


def _pairs_reference(weight: torch.Tensor) -> torch.Tensor:
    """The pair layout by tensor operations: pad, group 64 rows, swap rows and pairs."""
    out, inp = weight.shape
    padded = torch.nn.functional.pad(weight, (0, inp % 2, 0, -out % 64))
    return padded.reshape(-1, 64, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("shape", [(2048, 512), (130, 33), (64, 2), (1, 7), (200, 1)])
def test_the_native_pair_layout_equals_the_tensor_reference(dtype, shape):
    weight = (torch.randn(shape) * 40).to(dtype)
    packed = pack_pairs(weight)
    assert packed.dtype == dtype and torch.equal(packed, _pairs_reference(weight))
    assert torch.equal(unpack_pairs(packed, shape), weight)


@needs_int8
@pytest.mark.parametrize("shape", [(2048, 512), (130, 33), (64, 2), (1, 7), (3, 1), (70, 1000)])
def test_native_int8_quantization_equals_the_tensor_reference_bit_for_bit(shape):
    torch.manual_seed(0)
    weight = (torch.randn(shape) * torch.rand(shape[0], 1) * 3).to(torch.bfloat16)
    weight[0] = 0  # an all-zero row keeps scale 0
    weight[-1, 0] = 1e-30  # a tiny scale, below the smallest normal fp32 once divided
    native_weight, reference = quantize_int8(weight), quantize_reference(weight, paired=True)
    assert native_weight.values is None  # made straight in the pair layout
    assert torch.equal(native_weight.pairs, reference.pairs)
    assert torch.equal(native_weight.scales, reference.scales)
    assert native_weight.nbytes == reference.nbytes and native_weight.shape == reference.shape


def test_the_native_library_builds_wherever_the_machine_can_build_it():
    # not x86-64, no compiler or turned off are the machine's reasons; any other is a fault
    if NO_LIBRARY is not None:
        assert native().reason == NO_LIBRARY
    else:
        assert native().lib is not None, native().reason


def test_env_says_the_native_pass_runs_exactly_where_the_machine_has_what_it_needs():
    from moespec.kernels.cpu import native_pass_lacks

    facts = cpu_paths().to_dict()
    lacks = native_pass_lacks()
    assert facts["native_pass"] == (lacks or "available")
    assert facts["native_functions"]["pass"] == (None if lacks else "moespec_step")


def test_turning_the_native_loops_off_turns_the_native_pass_off_and_says_so(tmp_path):
    facts = _facts({"MOESPEC_NATIVE": "0", "MOESPEC_CACHE": str(tmp_path)})
    assert facts["native_pass"] == "turned off by MOESPEC_NATIVE"
    assert facts["native_functions"]["pass"] is None


# Each C entry point called with one argument out of bounds: a ValueError naming it, nothing
# read or written (the pointers are null: the checks come first). {kind: (names' values)}
_ONE = ctypes.c_int64 * 1
_BASES = {
    "pairs": {"O": 64, "I": 8, "R": 1, "threads": 1},
    "batch": {
        "n": 1,
        "x_rows": 2,
        "xrow": [0],
        "count": [1],
        "orow": [0],
        "O": 64,
        "I": 8,
        "threads": 1,
    },
    "attend": {"H": 4, "G": 2, "L": 8, "D": 16, "Dv": 16, "k_head": 128, "k_row": 16},
    "rows": {"q_row": 64, "T": 2, "o_row": 64, "H": 4, "G": 2, "L0": 8, "D": 16, "Dv": 16},
    "read": {"n": 128, "threads": 1},
    "pack": {"groups": 1, "units": 4, "threads": 1},
    "quantize": {"O": 4, "I": 8, "threads": 1},
}
for _base in ("attend", "rows"):
    _BASES[_base].update(k_head=128, k_row=16, v_head=128, v_row=16, scale=0.25, threads=1)
_REFUSALS = {
    "pairs": [({"O": -1}, "O"), ({"I": 0}, "I"), ({"R": -1}, "R"), ({"threads": 0}, "threads")],
    "batch": [
        ({"n": -1}, "n"),
        ({"x_rows": -1}, "x_rows"),
        ({"xrow": [2]}, "xrow"),  # row 2 of 2
        ({"xrow": [-1]}, "xrow"),
        ({"count": [3]}, "xrow"),  # rows 0-2 of 2
        ({"count": [-1]}, "count"),
        ({"orow": [-1]}, "orow"),
        ({"O": -1}, "O"),
        ({"I": 0}, "I"),
        ({"threads": 0}, "threads"),
    ],
    "attend": [
        ({"H": 0}, "H"),
        ({"G": 0}, "G"),
        ({"G": 3}, "G"),  # 4 query heads are not groups of 3
        ({"L": 0}, "L"),
        ({"D": 0}, "D"),
        ({"Dv": 0}, "Dv"),
        ({"k_row": -1}, "k_row"),
        ({"v_head": -1}, "v_head"),
        ({"threads": 0}, "threads"),
    ],
    "rows": [
        ({"q_row": -1}, "q_row"),
        ({"T": -1}, "T"),
        ({"o_row": -1}, "o_row"),
        ({"H": 0}, "H"),
        ({"G": 3}, "G"),
        ({"L0": 0}, "L0"),
        ({"v_row": -1}, "v_row"),
        ({"threads": 0}, "threads"),
    ],
    "read": [({"n": 100}, "n"), ({"n": -128}, "n"), ({"threads": 0}, "threads")],
    "pack": [({"groups": -1}, "groups"), ({"units": -1}, "units"), ({"threads": 0}, "threads")],
    "quantize": [({"O": -1}, "O"), ({"I": 0}, "I"), ({"threads": 0}, "threads")],
}
AVX2, AVX512 = ("avx2", "fma"), ("avx512f", "avx512bw", "avx512vl")
# {entry point: (its kind, the CPU flags its code needs)}
_ENTRY_POINTS = {
    "moespec_bf16_pairs": ("pairs", (*AVX512, "avx512_bf16")),
    "moespec_bf16_pairs_avx2": ("pairs", AVX2),
    "moespec_bf16_avx2": ("pairs", AVX2),
    "moespec_int8_pairs_avx512": ("pairs", AVX512),
    "moespec_int8_pairs_vnni": ("pairs", (*AVX512, "avx512_vnni")),
    "moespec_int8_pairs_avx2": ("pairs", AVX2),
    "moespec_int8_avx512": ("pairs", AVX512),
    "moespec_int8_avx2": ("pairs", AVX2),
    "moespec_bf16_pairs_batch": ("batch", (*AVX512, "avx512_bf16")),
    "moespec_bf16_pairs_avx2_batch": ("batch", AVX2),
    "moespec_int8_pairs_avx512_batch": ("batch", AVX512),
    "moespec_int8_pairs_vnni_batch": ("batch", (*AVX512, "avx512_vnni")),
    "moespec_int8_pairs_avx2_batch": ("batch", AVX2),
    "moespec_attend_bf16_avx512": ("attend", AVX512),
    "moespec_attend_bf16_avx2": ("attend", AVX2),
    "moespec_attend_bf16_avx512_rows": ("rows", AVX512),
    "moespec_attend_bf16_avx2_rows": ("rows", AVX2),
    "moespec_read_sum": ("read", AVX2),
    "moespec_pack_pairs32": ("pack", ()),
    "moespec_pack_pairs16": ("pack", ()),
    "moespec_quantize_pairs_bf16": ("quantize", AVX2),
}
_CASES = [
    pytest.param(function, changes, name, id=f"{function}-{name}={list(changes.values())[0]}")
    for function, (kind, _) in _ENTRY_POINTS.items()
    for changes, name in _REFUSALS[kind]
]


def _arguments(function: str, changes: dict) -> list:
    names = _SIGNATURES[function][0].split()
    values = {**dict.fromkeys(names, 0), **_BASES[_ENTRY_POINTS[function][0]], **changes}
    if function == "moespec_read_sum":
        values["sum"] = ctypes.byref(ctypes.c_uint64())
    for name in ("weights", "scales"):  # the batches' arrays of addresses: one null
        values[name] = (ctypes.c_uint64 * 1)(0)
    return [_ONE(*v) if isinstance(v, list) else v for v in (values[n] for n in names)]


@pytest.mark.parametrize("function, changes, name", _CASES)
def test_every_c_entry_point_refuses_an_argument_out_of_bounds_by_name(function, changes, name):
    needs_function(function, _ENTRY_POINTS[function][1])
    with pytest.raises(ValueError, match=f"^{function} refused {name}: it needs ") as refused:
        call(function, *_arguments(function, changes))
    assert "\n" not in str(refused.value) and "--" not in str(refused.value)


def test_every_c_entry_point_but_the_suffix_index_and_step_c_has_refusal_cases():
    # step.c's (moespec_step, moespec_step_batch, moespec_experts) are in the model pass's,
    # the batched pass's and NativeExperts' tests; the suffix index's checks return their own
    # values (moespec.decoding.suffix)
    checked = {n for n in _SIGNATURES if not n.startswith("moespec_suffix")}
    step_c = {"moespec_step", "moespec_step_batch", "moespec_experts"}
    assert checked - step_c == set(_ENTRY_POINTS)


@needs_native
def test_a_call_the_c_checks_refuse_reaches_the_caller_as_one_value_error():
    # through the wrapper: an attention of no query heads, the call's integers named
    needs_function(nat.ATTENTION[FAMILY] + "_rows", ())
    keys = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"_rows refused H: it needs H >= 1 \(called with .*H = 0"):
        nat.attend_rows(torch.zeros(2, 0, 8, dtype=torch.bfloat16), keys, keys, 0.5)
