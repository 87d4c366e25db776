"""Native products for decode and verification passes: bf16 and int8 weights, AVX-512 and AVX2.

A decode or verification step is products of 1-9 rows with each weight read once, so its
speed is the bandwidth those products reach. On a 2-core AVX-512-BF16 host, one [2048, 2048]
bf16 product through oneDNN's packed layout moved 14 GB/s on one thread (PyTorch's unpacked
path 10); `native.c`'s loops move 27 (`benchmarks/results/cpu_paths_avx512.json`), and stay
near that up to 9 rows (`python benchmarks/cpu_paths.py --rows N`). One layout, made once at
load (`pack_pairs`), in groups of 64 output rows so a group streams from memory as one run:
[in / 2][64][2] per group, the weights of two consecutive inputs side by side.

- bf16: AVX-512-BF16 multiplies a pair of weights for 16 outputs by a broadcast pair of inputs
  with one `vdpbf16ps`; AVX2 splits the pairs into even and odd weights (a shift, a mask) and
  multiplies them by the broadcast inputs with FMA. Each output is one fp32 chain.
- int8 (one scale per output row, `moespec.kernels.quant`): each input row is quantized to
  int16 with one scale (its largest magnitude / 32767: an error of at most 2^-16 of that
  magnitude per input, within the bf16 rounding of the output), the weights are widened to
  int16, and `vpmaddwd` (`vpdpwssd` with AVX-512-VNNI; AVX2's `vpmaddwd` on 8 outputs)
  multiplies a pair of weights by a pair of inputs and adds them, exactly, in int32. Blocks
  of 128 pairs are summed in int32 (they cannot overflow), the blocks in fp32 in order, and
  each output is times its row's scale and the input's. That is half the instructions per
  weight of widening int8 to fp32 for FMA (the loops this layout replaced): a 2-layer
  OLMoE-shaped decode went from 1.52x to 1.80x the bf16 one at one thread
  (`benchmarks/int8_decode.py`); one product streamed from memory takes 196-198 us against
  237 for the fp32-widening row-by-row candidate, 633-730 against 1,849 at 9 rows
  (`benchmarks/cpu_paths.py`).

Whatever the number of rows and however the rows are tiled, each output is computed in one
fixed order from its own row alone, so a pass of n rows gives every row its one-row bits:
batch-invariant by construction, with no row chunking (`moespec.kernels.invariance`). The
layout holds the same bytes (padded to 64 rows and an even width), so nothing is held twice.
`batch_products` runs a layer's expert products in one call (one fork and join of the
threads); each product gets the bits a call of its own gives it.

`native.c` also holds row-by-row loops for bf16 (AVX2) and int8 (AVX-512F, AVX2; fp32
inputs, FMA): candidates `benchmarks/cpu_paths.py` times, not paths the engine takes (they
lose to the pair layout from two rows).

The library is built on first use with the system's C compiler (`$CC`, else cc, gcc or clang)
into the user's cache (`$MOESPEC_CACHE`, else `$XDG_CACHE_HOME/moespec` or `~/.cache/moespec`),
keyed by the source and the compiler, the way Inductor and Triton build their kernels; a later
process loads it in milliseconds. Each ISA's functions carry their own target attribute, so
one build serves any x86-64 CPU and the caller picks what the CPU has (`layout_function`).
Where there is no compiler, the build fails, or `MOESPEC_NATIVE=0`, the library paths run
instead and `moespec env` says why (`moespec.kernels.cpu`).

Every entry point checks the integers its loops trust (sizes, row ranges, thread counts; the
model pass that its positions fit the cache) before it touches memory, and returns minus the
position of one out of bounds: `refused` makes that a one-line ValueError naming the argument,
what it needs and the call's integers, where a bad call used to crash the process.
"""

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from moespec.buildcache import cache_dir, find_compiler
from moespec.kernels.isa import cpu_flags, this_cpu

SOURCE = Path(__file__).with_name("native.c")
# the model pass of moespec.models.native_step, built into the same library
SOURCES = (SOURCE, Path(__file__).with_name("step.c"), Path(__file__).with_name("suffix.c"))
VERSION = 4  # moespec_native_version() of the source this module speaks to
PAIR_GROUP = 64  # output rows per group of the pair layout (native.c)

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_PAIRS = ("P x out O I R threads", [_P, _P, _P, _I64, _I64, _I64, _INT])
_INT8_PAIRS = ("P scales x out O I R threads", [_P, _P, _P, _P, _I64, _I64, _I64, _INT])
# batches: product k multiplies rows xrow[k] .. xrow[k] + count[k] - 1 of X into rows orow[k] ..
# of out; int8 adds the scales after the weights
_BATCH = (
    "n weights X x_rows xrow count out orow O I threads",
    [_I64, _P, _P, _I64, *[_P] * 4, _I64, _I64, _INT],
)
_INT8_BATCH = (
    "n weights scales X x_rows xrow count out orow O I threads",
    [_I64, *[_P] * 3, _I64, *[_P] * 4, _I64, _I64, _INT],
)
# decode attention: H query heads, G per key head, over L positions (strides in elements)
_ATTEND = (
    "q k v out H G L D Dv k_head k_row v_head v_row scale threads",
    [_P] * 4 + [_I64] * 9 + [ctypes.c_float, _INT],
)
# a pass's T rows: row t at q + t q_row sees L0 + t positions
_ROWS = (
    "q q_row T k v out o_row H G L0 D Dv k_head k_row v_head v_row scale threads",
    [_P, _I64, _I64, _P, _P, _P] + [_I64] * 10 + [ctypes.c_float, _INT],
)
# {function: (its arguments' names, their types)}: the names are what a refused argument's
# error says (`refused`)
_SIGNATURES = {
    "moespec_pack_pairs32": ("W out groups units threads", [_P, _P, _I64, _I64, _INT]),
    "moespec_pack_pairs16": ("W out groups units threads", [_P, _P, _I64, _I64, _INT]),
    "moespec_quantize_pairs_bf16": ("W O I pairs scales threads", [_P, _I64, _I64, _P, _P, _INT]),
    "moespec_bf16_pairs": _PAIRS,
    "moespec_bf16_pairs_avx2": _PAIRS,
    "moespec_int8_pairs_avx512": _INT8_PAIRS,
    "moespec_int8_pairs_vnni": _INT8_PAIRS,
    "moespec_int8_pairs_avx2": _INT8_PAIRS,
    # the row-by-row candidates: weights [O, I] as they are
    "moespec_bf16_avx2": _PAIRS,
    "moespec_int8_avx512": _INT8_PAIRS,
    "moespec_int8_avx2": _INT8_PAIRS,
    "moespec_bf16_pairs_batch": _BATCH,
    "moespec_bf16_pairs_avx2_batch": _BATCH,
    "moespec_int8_pairs_avx512_batch": _INT8_BATCH,
    "moespec_int8_pairs_vnni_batch": _INT8_BATCH,
    "moespec_int8_pairs_avx2_batch": _INT8_BATCH,
    "moespec_attend_bf16_avx512": _ATTEND,
    "moespec_attend_bf16_avx2": _ATTEND,
    "moespec_attend_bf16_avx512_rows": _ROWS,
    "moespec_attend_bf16_avx2_rows": _ROWS,
    # the read-bandwidth probe: its sum written to *sum
    "moespec_read_sum": ("buffer n threads sum", [_P, _I64, _INT, _P]),
    # step.c: the model pass (called through its own function type, moespec.models.native_step)
    # and one layer's expert operation; m and L: its Model and Layer structures
    "moespec_step": (
        "m tokens T start cache capacity cos sin dedup all_logits logits ids weights threads "
        "attend_threads",
        [_P, _P, _I64, _I64, _P, _I64, _P, _P, _INT, _INT, _P, _P, _P, _INT, _INT],
    ),
    # several sequences in one pass: B segments (native_step._Segment), their tokens
    # concatenated
    "moespec_step_batch": (
        "m tokens B segments dedup all_logits logits ids weights threads",
        [_P, _P, _I64, _P, _INT, _INT, _P, _P, _P, _INT],
    ),
    "moespec_experts": (
        "m L x T k ids weights dedup out threads",
        [_P, _P, _P, _I64, _I64, _P, _P, _INT, _P, _INT],
    ),
    # the suffix drafter's index (suffix.c): new(levels, lengths*), free, extend(tokens*, n),
    # longest, occurrences(level, limit, out*), hash(n), length
    "moespec_suffix_new": ("n_levels levels", [_I64, _P]),
    "moespec_suffix_free": ("index", [_P]),
    "moespec_suffix_extend": ("index tokens n", [_P, _P, _I64]),
    "moespec_suffix_longest": ("index", [_P]),
    "moespec_suffix_occurrences": ("index level limit out", [_P, _I64, _I64, _P]),
    "moespec_suffix_hash": ("index n", [_P, _I64]),
    "moespec_suffix_length": ("index", [_P]),
}
_RESULTS = {
    "moespec_suffix_new": ctypes.c_void_p,
    "moespec_suffix_free": None,
    "moespec_suffix_longest": ctypes.c_int64,
    "moespec_suffix_occurrences": ctypes.c_int64,
    "moespec_suffix_hash": ctypes.c_uint64,
    "moespec_suffix_length": ctypes.c_int64,
}
# What the C checks ask of each argument they refuse (by its name; ("function", name) where
# one function asks otherwise)
_BOUNDS = {
    "n": "n >= 0",
    "x_rows": "x_rows >= 0",
    "xrow": "each product's input rows within X: 0 <= xrow[k] <= x_rows - count[k]",
    "count": "count[k] >= 0",
    "orow": "orow[k] >= 0",
    "O": "O >= 0",
    "I": "I >= 1",
    "R": "R >= 0",
    "threads": "threads >= 1",
    "attend_threads": "attend_threads >= 1",
    "groups": "groups >= 0",
    "units": "units >= 0",
    "H": "H >= 1",
    "G": "G >= 1, H a multiple of G",
    "L": "L >= 1",
    "L0": "L0 >= 1",
    "D": "D >= 1",
    "Dv": "Dv >= 1",
    "q_row": "q_row >= 0",
    "o_row": "o_row >= 0",
    "T": "T >= 0",
    "k": "k >= 0",
    ("moespec_read_sum", "n"): "n >= 0, a multiple of 128",
    ("moespec_step", "T"): "T >= 1",
    ("moespec_step", "start"): "start >= 0",
    ("moespec_step", "capacity"): "start + T <= capacity",
    ("moespec_step", "m"): (
        "the model's shapes: rotary dims even, within the head and at most 1024; heads a "
        "multiple of the key heads; each MoE layer's top k within 1 .. its experts"
    ),
    ("moespec_step_batch", "m"): (
        "the model's shapes: rotary dims even, within the head and at most 1024; heads a "
        "multiple of the key heads; each MoE layer's top k within 1 .. its experts"
    ),
    ("moespec_step_batch", "B"): "B >= 1",
    ("moespec_step_batch", "segments"): (
        "each segment's T >= 1, start >= 0, start + T <= capacity and attend_threads >= 1, "
        "and the segments' T summed at most 256"
    ),
    ("moespec_experts", "m"): "the hidden size >= 1",
    ("moespec_experts", "L"): "the layer's experts >= 1",
}
for _name in ("k_head", "k_row", "v_head", "v_row"):
    _BOUNDS[_name] = f"{_name} >= 0"


def refused(function: str, rc: int, args) -> ValueError:
    """The error of a call of `function` with `args` whose C checks refused the argument at
    position -rc: its name, what the check asks, and the call's integers, in one line."""
    names, types = _SIGNATURES[function]
    names = names.split()
    name = names[-rc - 1] if 0 < -rc <= len(names) else f"argument {-rc}"
    integers = ", ".join(
        f"{n} = {a}"
        for n, t, a in zip(names, types, args, strict=False)
        if t in (_I64, _INT) and isinstance(a, int)
    )
    bound = _BOUNDS.get((function, name)) or _BOUNDS.get(name, "out of bounds")
    return ValueError(f"{function} refused {name}: it needs {bound} (called with {integers})")


def call(name: str, *args) -> int:
    """A call of the native function `name`: an argument its C checks refuse raises the
    ValueError naming it; else its return code (0 done, 1 no memory, 2 shapes its loops do
    not take). For benchmarks and tests: the engine's paths make their calls inline."""
    rc = getattr(native().lib, name)(*args)
    if rc < 0:
        raise refused(name, rc, args)
    return rc


@dataclass(frozen=True)
class Native:
    """The loaded library (or why there is none) and whether it runs threaded."""

    lib: ctypes.CDLL | None
    reason: str | None  # why the native products are unavailable
    openmp: bool = False
    compiler: str | None = None

    def has(self, name: str) -> bool:
        return self.lib is not None and hasattr(self.lib, name)


# Tried in order: all ISAs threaded; all ISAs single-threaded (a compiler without OpenMP);
# AVX2 only (a compiler that does not know AVX-512-BF16). A failed attempt is tried again by
# the next process (a second or so of compiling) before the cached build of a later one loads.
ATTEMPTS = (
    (["-fopenmp"], True),
    ([], False),
    (["-fopenmp", "-DMOESPEC_NO_AVX512"], True),
    (["-DMOESPEC_NO_AVX512"], False),
)
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-std=c11", "-D_ISOC11_SOURCE"]


def build(compiler: str, out_dir: Path, sources=SOURCES) -> tuple[Path, bool]:
    """Compile native.c and step.c (`sources`) into out_dir (once per source and compiler);
    (library, threaded)."""
    source = b"".join(path.read_bytes() for path in sources)
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    errors = []
    for flags, openmp in ATTEMPTS:
        key = hashlib.sha256(source + version.encode() + " ".join(flags).encode()).hexdigest()
        target = out_dir / f"moespec_native_{key[:16]}.so"
        if target.exists():
            return target, openmp
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
        os.close(fd)
        cmd = [compiler, *BASE_FLAGS, *flags, *map(str, sources), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            os.replace(tmp, target)  # atomic: a concurrent build leaves one whole file
            return target, openmp
        os.unlink(tmp)
        errors.append(done.stderr.strip().splitlines()[-1:] or ["failed"])
    raise RuntimeError(f"{compiler} could not build {sources[0].name}: {errors[0][0]}")


def load(path: Path) -> ctypes.CDLL:
    """A built library, its functions typed."""
    lib = ctypes.CDLL(str(path))  # after torch: its libgomp is the OpenMP runtime used
    for name, (_, argtypes) in _SIGNATURES.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = _RESULTS.get(name, _INT)
    return lib


def unavailable_here() -> str | None:
    """Why this machine does not build the native library, by its own facts: turned off, not
    x86-64, no C compiler. None where it does: a build that then fails is a fault, not a
    reason (tests skip on these reasons alone)."""
    if os.environ.get("MOESPEC_NATIVE", "1").strip().lower() in ("0", "off", "no", "false"):
        return "turned off by MOESPEC_NATIVE"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"no native loops for {platform.machine()} (x86-64 only)"
    if find_compiler() is None:
        return "no C compiler found ($CC, cc, gcc or clang)"
    return None


@functools.cache
def native() -> Native:
    """The native library of this process, built or loaded on the first call."""
    if (why := unavailable_here()) is not None:
        return Native(None, why)
    compiler = find_compiler()
    try:
        path, openmp = build(compiler, cache_dir() / "native")
        lib = load(path)
        if lib.moespec_native_version() != VERSION:
            return Native(None, f"{path.name} is version {lib.moespec_native_version()}")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return Native(None, f"native build failed: {e}")
    return Native(lib, None, openmp, Path(compiler).name)


# The layout loops of each CPU family, best first (AMX hosts have AVX-512-BF16).
PAIRS = {
    "amx": ("moespec_bf16_pairs",),
    "avx512-bf16": ("moespec_bf16_pairs",),
    # AVX-512 without bf16: oneDNN's packed product, 2-2.5x faster than the AVX2 pair loops
    # from 4 rows (benchmarks/cpu_paths.py, measured with the AVX-512-BF16 flag ignored)
    "avx512": (),
    "avx2": ("moespec_bf16_pairs_avx2",),
}
INT8 = {
    "amx": ("moespec_int8_pairs_vnni", "moespec_int8_pairs_avx512"),
    "avx512-bf16": ("moespec_int8_pairs_vnni", "moespec_int8_pairs_avx512"),
    "avx512": ("moespec_int8_pairs_vnni", "moespec_int8_pairs_avx512"),
    "avx2": ("moespec_int8_pairs_avx2",),
}
# functions that need a flag beyond their family's
NEEDS = {"moespec_int8_pairs_vnni": "avx512_vnni"}


def family_lacks(kind: str, family: str) -> str | None:
    """Why a CPU of this family, by its own flags, has no native loops for "bf16" or "int8"
    weights (or, kind "attention", no native attention); None where it has them."""
    if kind == "attention":
        candidates = (ATTENTION[family],) if family in ATTENTION else ()
    else:
        candidates = (PAIRS if kind == "bf16" else INT8).get(family)
    if not candidates:
        return f"no native {kind} loops for CPU family {family}"
    if family == "avx2" and not {"avx2", "fma"} <= set(cpu_flags()):
        return "the AVX2 loops need AVX2 and FMA, which this CPU lacks"
    return None


def layout_function(kind: str, family: str) -> tuple[str | None, str | None]:
    """(the native function for "bf16" or "int8" weights in the pair layout on this CPU family,
    or None with the reason)."""
    if (why := family_lacks(kind, family)) is not None:
        return None, why
    if native().lib is None:
        return None, native().reason
    candidates = (PAIRS if kind == "bf16" else INT8)[family]
    for name in candidates:
        if native().has(name) and NEEDS.get(name, "avx2") in cpu_flags():
            return name, None
    return None, f"the {native().compiler} build lacks {candidates[-1]}"


ATTENTION = {
    "amx": "moespec_attend_bf16_avx512",
    "avx512-bf16": "moespec_attend_bf16_avx512",
    "avx512": "moespec_attend_bf16_avx512",
    "avx2": "moespec_attend_bf16_avx2",
}


@functools.cache
def attention_function():
    """The native decode attention for this CPU family, or None (no loops, no FMA on AVX2)."""
    family = this_cpu()[2]
    if family_lacks("attention", family) is not None or not native().has(ATTENTION[family]):
        return None
    return getattr(native().lib, ATTENTION[family])


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """Attention of one query row: q bf16 [1, 1, H, D] over keys [1, K, L, D] and values
    [1, K, L, Dv] (bf16, each position's values contiguous: the cache's views), head h on key
    head h // (H / K); returns [1, 1, H Dv]. fp32 scores, softmax and sums in position order,
    one rounding per output: the same bits whatever else the pass holds. Callers check
    `attention_function()` first."""
    heads, dim = q.shape[2], q.shape[3]
    kv, length, dv = keys.shape[1], keys.shape[2], values.shape[3]
    q = q.contiguous()
    out = torch.empty(1, 1, heads * dv, dtype=torch.bfloat16)
    strides = (keys.stride(1), keys.stride(2), values.stride(1), values.stride(2))
    shape = (heads, heads // kv, length, dim, dv, *strides)
    ptrs = (q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr())
    args = (*ptrs, *shape, scale, _threads(None))
    if rc := attention_function()(*args):
        name = attention_function().__name__
        raise refused(name, rc, args) if rc < 0 else MemoryError(f"{name}: no memory")
    return out


def attend_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    family: str | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Attention of a pass's T query rows in one call: q bf16 [T, H, D] over keys [1, K, L, D]
    and values [1, K, L, Dv] (the cache's views, bf16), row t over the first L - T + 1 + t
    positions (itself and the rows before it); returns [T, H Dv] bf16, each row the bits
    `attend_one` gives it over its positions. family: whose loops (this CPU's)."""
    name = ATTENTION[family or this_cpu()[2]] + "_rows"
    rows, heads, dim = q.shape
    kv, length, dv = keys.shape[1], keys.shape[2], values.shape[3]
    q = q.contiguous()
    out = torch.empty(rows, heads * dv, dtype=torch.bfloat16)
    strides = (keys.stride(1), keys.stride(2), values.stride(1), values.stride(2))
    shape = (heads, heads // kv, length - rows + 1, dim, dv, *strides)
    ptrs = (keys.data_ptr(), values.data_ptr(), out.data_ptr())
    args = (q.data_ptr(), heads * dim, rows, *ptrs, heads * dv, *shape, scale, _threads(threads))
    if rc := getattr(native().lib, name)(*args):
        raise refused(name, rc, args) if rc < 0 else MemoryError(f"{name}: no memory")
    return out


class PairWeight:
    """A bf16 [out, in] weight in the pair layout (`pack_pairs`): the same bytes, products of
    1-9 rows at 1-1.5x the time of one (AVX-512-BF16), each row with its one-row bits."""

    __slots__ = ("packed", "shape", "dtype", "nbytes")

    def __init__(self, weight: torch.Tensor):
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise ValueError(f"pair layout wants a bf16 [out, in] weight, got {weight.dtype}")
        self.packed = pack_pairs(weight)
        self.shape, self.dtype, self.nbytes = tuple(weight.shape), weight.dtype, weight.nbytes

    def dense(self) -> torch.Tensor:
        """The weight in its ordinary [out, in] layout (a copy)."""
        return unpack_pairs(self.packed, self.shape)

    def holding(self, packed: torch.Tensor) -> "PairWeight":
        """A weight of this shape whose pair-layout bytes are `packed` (a slot's, or a pinned
        copy of these)."""
        if packed.shape != self.packed.shape or packed.dtype != self.packed.dtype:
            raise ValueError(f"pair layout {tuple(self.packed.shape)} wanted, got {packed.shape}")
        other = PairWeight.__new__(PairWeight)
        other.packed = packed
        other.shape, other.dtype, other.nbytes = self.shape, self.dtype, self.nbytes
        return other

    def empty_like(self) -> "PairWeight":
        """A weight of the same shape and layout, its bytes uninitialised (a slot to copy
        another such weight's `packed` into)."""
        return self.holding(torch.empty_like(self.packed))


def pairs_product(x: torch.Tensor, weight: PairWeight, threads: int | None = None):
    """x @ weight.T for bf16 x [..., in]: bf16 out, accumulated in fp32."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"pair-layout product wants bf16 input, got {x.dtype}")
    return _call(_function("bf16"), weight.packed, x, weight.shape[0], threads=threads)


def native_product(name: str, weight, x, out_size: int, scales=None, threads=None):
    """One product by the native function `name` (a layout's or a row-by-row candidate's):
    weight in that function's layout, x bf16 [..., in], scales for int8 (benchmarks, tests)."""
    return _call(getattr(native().lib, name), weight, x, out_size, scales, threads)


def _call(function, weight, x, out_size: int, scales=None, threads=None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], out_size, dtype=torch.bfloat16)
    head = (weight.data_ptr(),) if scales is None else (weight.data_ptr(), scales.data_ptr())
    shape = (out_size, x.shape[-1], rows.shape[0], _threads(threads))
    if rc := function(*head, rows.data_ptr(), out.data_ptr(), *shape):
        if rc < 0:
            raise refused(function.__name__, rc, (*head, rows.data_ptr(), out.data_ptr(), *shape))
        raise MemoryError(f"{function.__name__}: no memory for its widened or padded input")
    return out.view(*x.shape[:-1], out_size)


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [out, in] weight (or int8 [out, in] values) in the pair layout the native loops
    read: groups of 64 output rows, each [in / 2][64][2] (pairs of consecutive inputs side by
    side), zero-padded to a multiple of 64 rows and 2 columns."""
    out, inp = weight.shape
    if weight.is_meta:  # a converted model's skeleton: the shape alone
        shape = (-(-out // PAIR_GROUP), -(-inp // 2), PAIR_GROUP, 2)
        return torch.empty(shape, dtype=weight.dtype, device="meta")
    pad = (0, inp % 2, 0, -out % PAIR_GROUP)
    padded = torch.nn.functional.pad(weight, pad) if any(pad) else weight
    groups = padded.reshape(-1, PAIR_GROUP, padded.shape[1] // 2, 2)  # [G, 64, JP, 2]
    lib = native().lib if padded.device.type == "cpu" else None
    function = getattr(lib, f"moespec_pack_pairs{padded.element_size() * 16}", None)
    if function is None:  # no native library
        return groups.permute(0, 2, 1, 3).contiguous()  # [G, JP, 64, 2]
    padded = padded.contiguous()
    packed = torch.empty(groups.shape[0], groups.shape[2], PAIR_GROUP, 2, dtype=padded.dtype)
    args = (padded.data_ptr(), packed.data_ptr(), groups.shape[0], groups.shape[2], _threads(None))
    if rc := function(*args):
        raise refused(function.__name__, rc, args)
    return packed


def unpack_pairs(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The [out, in] weight `pack_pairs` laid out (a copy)."""
    out, inp = shape
    rows = packed.permute(0, 2, 1, 3).reshape(-1, packed.shape[1] * 2)
    return rows[:out, :inp].contiguous()


def unpack_pairs_into(out: torch.Tensor, packed: torch.Tensor) -> None:
    """Write the [out, in] weight that `pack_pairs` laid out as `packed` into `out`, on
    whatever device both are (one strided copy where no padding was added)."""
    rows, cols = out.shape
    groups, pairs = packed.shape[:2]
    if rows == groups * PAIR_GROUP and cols == 2 * pairs:
        out.view(groups, PAIR_GROUP, pairs, 2).copy_(packed.permute(0, 2, 1, 3))
    else:
        out.copy_(packed.permute(0, 2, 1, 3).reshape(-1, 2 * pairs)[:rows, :cols])


def _threads(threads: int | None) -> int:
    n = torch.get_num_threads() if threads is None else threads
    return n if native().openmp else 1


def has_read_probe() -> bool:
    """Whether `read_sum` runs here: the library is built and the CPU has AVX2."""
    return native().has("moespec_read_sum") and "avx2" in cpu_flags()


def read_sum(buffer: torch.Tensor, threads: int | None = None) -> int:
    """The native read probe: the 64-bit sum of `buffer`'s bytes as 32-byte vectors (its
    first multiple of 128 bytes), read by `threads` threads each streaming one contiguous run."""
    if not buffer.is_contiguous() or buffer.device.type != "cpu":
        raise ValueError("the read probe reads one contiguous CPU buffer")
    n = buffer.numel() * buffer.element_size() // 128 * 128
    total = ctypes.c_uint64()
    call("moespec_read_sum", buffer.data_ptr(), n, _threads(threads), ctypes.byref(total))
    return total.value


def int8_pairs_product(x: torch.Tensor, pairs: torch.Tensor, scales: torch.Tensor, threads=None):
    """(x @ values.T) * scales for bf16 x [..., in], int8 values in the pair layout, bf16
    scales; x is quantized per row to int16 first (native.c's `quantize_rows`)."""
    if x.dtype != torch.bfloat16 or scales.dtype != torch.bfloat16:
        raise TypeError(f"int8 pair-layout product wants bf16 input and scales, got {x.dtype}")
    return _call(_function("int8"), pairs, x, scales.shape[0], scales, threads)


@functools.cache
def _function(kind: str, batch: bool = False):
    name, why = layout_function(kind, this_cpu()[2])
    if name is None:
        raise RuntimeError(f"no native {kind} product here: {why}")
    return getattr(native().lib, name + ("_batch" if batch else ""))


def batch_products(x: torch.Tensor, weights: list, xrow, count, orow, out_rows: int, threads=None):
    """A layer's products in one native call: product k multiplies rows xrow[k] ..
    xrow[k] + count[k] - 1 of x [rows, in] (bf16) by weights[k] into rows orow[k] .. of one
    [out_rows, out] result, each row with the bits `linear` gives it alone. weights: all
    PairWeight or all int8 in the pair layout, of one shape. None where they are not (or a
    bf16 width is odd): the caller then takes its products one at a time."""
    first = weights[0]
    pairs = isinstance(first, PairWeight)
    if not pairs and getattr(first, "pairs", None) is None:
        return None
    if pairs and first.shape[1] % 2 or x.dtype != torch.bfloat16:
        return None
    out_size, in_size = first.shape
    n = len(weights)
    # the loops trust these: check them here, once per batch
    if x.dim() != 2 or x.shape[1] != in_size or any(w.shape != first.shape for w in weights):
        raise ValueError(f"batch of products: weights {first.shape} and input {tuple(x.shape)}")
    if not len(xrow) == len(count) == len(orow) == n or min(count, default=1) < 1:
        raise ValueError("batch of products: one row start, count and output start per weight")
    ends = [(a + c, b + c) for a, b, c in zip(xrow, orow, count, strict=True)]
    if (
        min(xrow) < 0
        or min(orow) < 0
        or max(a for a, _ in ends) > x.shape[0]
        or (max(b for _, b in ends) > out_rows)
    ):
        raise ValueError(f"batch of products: rows outside the input ({x.shape[0]}) or output")
    x = x.contiguous()
    out = torch.empty(out_rows, out_size, dtype=torch.bfloat16)
    ints = ctypes.c_int64 * n
    at = (x.data_ptr(), x.shape[0], ints(*xrow), ints(*count), out.data_ptr(), ints(*orow))
    shape = (out_size, in_size, _threads(threads))
    if pairs:
        ptrs = ((ctypes.c_uint64 * n)(*[w.packed.data_ptr() for w in weights]),)
    else:
        ptrs = (
            (ctypes.c_uint64 * n)(*[w.pairs.data_ptr() for w in weights]),
            (ctypes.c_uint64 * n)(*[w.scales.data_ptr() for w in weights]),
        )
    function = _function("bf16" if pairs else "int8", batch=True)
    if rc := function(n, *ptrs, *at, *shape):
        if rc < 0:
            raise refused(function.__name__, rc, (n, *ptrs, *at, *shape))
        raise MemoryError("native batch of products: no memory for its widened or quantized input")
    return out
