"""The Triton expert kernels: against the reference under Triton's interpreter on the CPU (on the
device where CUDA is present), compiled for an H100/H200 (sm_90) without one, and dispatched only
where they can run.

Triton reads TRITON_INTERPRET when it is imported (its own library functions are decorated then),
so on a machine without CUDA this module sets it before anything imports Triton; a test session
there has no other use for Triton.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import moespec.kernels.triton as triton_kernels
from moespec.kernels import ExpertWeights, dedup_experts, get_kernel, reference_experts
from moespec.kernels.slot import slot_experts
from moespec.kernels.triton.settings import (
    TUNED,
    KernelSettings,
    StageSettings,
    load_table,
    settings_for,
)
from tests.test_kernels import routing

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_CUDA = torch.cuda.is_available()
if HAS_TRITON and not ON_CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and "triton" not in sys.modules

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

HIDDEN, INTER = 32, 64
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
# Whole rows and reductions in one tile keep the interpreter's program count small; the
# dedup down stage still splits, so its partial sums are exercised everywhere.
SMALL = {
    "slot": KernelSettings(StageSettings(64, 32), StageSettings(32, 64)),
    "dedup": KernelSettings(StageSettings(64, 32, split=2), StageSettings(32, 64, split=2)),
}
KERNEL_NAMES = ("slot", "dedup")


@pytest.fixture(scope="module")
def device_kernels():
    """(launch module, device): interpreted on the CPU, compiled on a CUDA device."""
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    if not ON_CUDA and not INTERPRETING:
        pytest.skip("Triton was imported before TRITON_INTERPRET could be set")
    from moespec.kernels.triton import launch

    return launch, torch.device("cuda" if ON_CUDA else "cpu")


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def make_pass(
    n, top_k, num_experts, kind="random", dtype=torch.float32, hidden=HIDDEN, inter=INTER, seed=0
):
    generator = torch.Generator().manual_seed(seed)
    experts = ExpertWeights(
        (torch.randn(num_experts, 2 * inter, hidden, generator=generator) * 0.2).to(dtype),
        (torch.randn(num_experts, hidden, inter, generator=generator) * 0.2).to(dtype),
    )
    x = torch.randn(n, hidden, generator=generator).to(dtype)
    ids = routing(kind, n, top_k, num_experts, generator)
    weights = torch.softmax(torch.randn(n, top_k, generator=generator), -1)
    return x, ids, weights, experts


def assert_matches_reference(got, x, ids, weights, experts):
    expected = reference_experts(x.float(), ids, weights, experts.to(torch.float32))
    assert got.dtype == x.dtype and got.shape == x.shape
    scale = max(expected.abs().max().item(), 1.0)
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[x.dtype] * scale


def run_kernel(device_kernels, name, x, ids, weights, experts, settings=None):
    """Run on the kernels' device (small tiles under the interpreter, tuned ones on CUDA)."""
    launch, device = device_kernels
    kernel = {"slot": launch.slot_experts_triton, "dedup": launch.dedup_experts_triton}[name]
    if device.type == "cpu":
        settings = settings or SMALL[name]
    experts = ExpertWeights(experts.gate_up.to(device), experts.down.to(device))
    return kernel(x.to(device), ids.to(device), weights.to(device), experts, settings).cpu()


# (top_k, experts, routing) rotated over n = 1-9 and 16 and both dtypes: every n, top-k, expert
# count and routing kind appears, in a grid small enough for the interpreter.
COMBOS = [
    (1, 4, "random"),
    (2, 8, "same"),
    (4, 16, "distinct"),
    (8, 64, "random"),
    (2, 8, "random"),
    (4, 16, "same"),
    (8, 64, "distinct"),
    (1, 4, "same"),
]


def _grid():
    cases = []
    for i, n in enumerate([*range(1, 10), 16]):
        for d, dtype in enumerate([torch.float32, torch.bfloat16]):
            top_k, num_experts, kind = COMBOS[(i + 3 * d) % len(COMBOS)]
            if kind == "distinct" and n * top_k > num_experts:
                kind = "random"  # not enough experts for every slot to differ
            cases.append((n, top_k, num_experts, kind, dtype))
    return [*cases, (3, 2, 8, "random", torch.float16)]


GRID = _grid()


@needs_triton
@pytest.mark.parametrize("name", KERNEL_NAMES)
@pytest.mark.parametrize("n, top_k, num_experts, kind, dtype", GRID)
def test_triton_kernel_matches_reference(device_kernels, name, n, top_k, num_experts, kind, dtype):
    x, ids, weights, experts = make_pass(n, top_k, num_experts, kind, dtype, seed=n * 10 + top_k)
    got = run_kernel(device_kernels, name, x, ids, weights, experts)
    assert_matches_reference(got, x, ids, weights, experts)


def test_dedup_sorts_the_most_slots_of_a_pass(device_kernels):
    # 16 tokens x 8 slots: the largest sort (S_PAD = 128), the dedup kernel's limit.
    x, ids, weights, experts = make_pass(16, 8, 64, "random", torch.bfloat16, seed=16)
    got = run_kernel(device_kernels, "dedup", x, ids, weights, experts)
    assert_matches_reference(got, x, ids, weights, experts)


@needs_triton
@pytest.mark.parametrize("name", KERNEL_NAMES)
@pytest.mark.parametrize("split", [1, 3])
def test_partial_tiles_and_splits_match_reference(device_kernels, name, split):
    # H and I not multiples of the tiles: masked rows and columns; 3 splits of 4 slots.
    x, ids, weights, experts = make_pass(5, 4, 8, hidden=40, inter=24, seed=split)
    stage = StageSettings(16, 16, split=split)
    got = run_kernel(device_kernels, name, x, ids, weights, experts, KernelSettings(stage, stage))
    assert_matches_reference(got, x, ids, weights, experts)


@needs_triton
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_an_expert_named_twice_by_one_token_counts_twice(device_kernels, name):
    x, _, weights, experts = make_pass(3, 3, 8, seed=1)
    ids = torch.tensor([[2, 2, 5], [5, 2, 2], [7, 1, 0]])
    got = run_kernel(device_kernels, name, x, ids, weights, experts)
    assert_matches_reference(got, x, ids, weights, experts)


@needs_triton
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_experts_no_token_selects_are_never_read(device_kernels, name):
    x, ids, weights, experts = make_pass(4, 2, 16, seed=2)
    unused = torch.ones(16, dtype=torch.bool)
    unused[ids.flatten()] = False
    poisoned = ExpertWeights(experts.gate_up.clone(), experts.down.clone())
    poisoned.gate_up[unused] = float("nan")
    poisoned.down[unused] = float("nan")
    got = run_kernel(device_kernels, name, x, ids, weights, poisoned)
    assert torch.isfinite(got).all()
    assert_matches_reference(got, x, ids, weights, experts)


def test_dedup_sorts_the_pass_experts_on_the_device(device_kernels):
    launch, device = device_kernels
    x, _, weights, experts = make_pass(3, 4, 32, seed=3)
    ids = torch.tensor([[9, 3, 30, 1], [3, 9, 12, 1], [30, 3, 7, 9]])
    experts = ExpertWeights(experts.gate_up.to(device), experts.down.to(device))
    launches, _ = launch.plan_dedup(
        x.to(device), ids.to(device), weights.to(device), experts, SMALL["dedup"]
    )
    launch.run(launches)
    distinct = launches[0].args[4].cpu()  # [U, e_0, ..., e_{U-1}], written by the gate_up kernel
    expected = sorted(set(ids.flatten().tolist()))
    assert distinct[0].item() == len(expected)
    assert distinct[1 : 1 + len(expected)].tolist() == expected


def test_dedup_refuses_a_pass_longer_than_its_tile(device_kernels):
    x, ids, weights, experts = make_pass(17, 1, 4)
    with pytest.raises(ValueError, match="2..16 tokens, got 17"):
        device_kernels[0].dedup_experts_triton(x, ids, weights, experts)


def test_usable_passes_dispatch_to_triton(device_kernels, monkeypatch):
    calls = []
    original = triton_kernels.KERNELS["dedup"]
    monkeypatch.setattr(triton_kernels, "usable", lambda *args: True)
    monkeypatch.setitem(
        triton_kernels.KERNELS,
        "dedup",
        lambda *args: calls.append(1) or original(*args, SMALL["dedup"]),
    )
    x, ids, weights, experts = make_pass(3, 2, 8)
    device = device_kernels[1]
    on_device = ExpertWeights(experts.gate_up.to(device), experts.down.to(device))
    got = get_kernel("dedup")(x.to(device), ids.to(device), weights.to(device), on_device)
    assert calls == [1]
    assert_matches_reference(got.cpu(), x, ids, weights, experts)


@needs_triton
def test_every_bf16_kernel_compiles_for_sm90_with_its_tuned_settings():
    # A fresh process, since this one may have imported Triton to interpret. OLMoE's expert
    # shape matters only through divisibility, so two experts suffice.
    result = _run_python("""
        import os
        os.environ["TRITON_INTERPRET"] = "0"
        import torch
        from moespec.kernels import ExpertWeights
        from moespec.kernels.triton import launch
        from moespec.kernels.triton.compile import compile_launch
        hidden, inter, top_k = 2048, 1024, 8
        experts = ExpertWeights(torch.zeros(2, 2 * inter, hidden, dtype=torch.bfloat16),
                                torch.zeros(2, hidden, inter, dtype=torch.bfloat16))
        x = torch.zeros(9, hidden, dtype=torch.bfloat16)
        ids, weights = torch.zeros(9, top_k, dtype=torch.long), torch.ones(9, top_k)
        for plan in (launch.plan_slot, launch.plan_dedup):
            for one in plan(x, ids, weights, experts)[0]:
                assert compile_launch(one, arch=90).asm["cubin"]
        print("compiled")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "compiled"


def test_cpu_passes_run_the_torch_kernels(monkeypatch):
    def refuse(*args):
        raise AssertionError("a CPU pass reached the Triton kernels")

    monkeypatch.setitem(triton_kernels.KERNELS, "slot", refuse)
    monkeypatch.setitem(triton_kernels.KERNELS, "dedup", refuse)
    x, ids, weights, experts = make_pass(4, 2, 8)
    assert torch.equal(
        get_kernel("slot")(x, ids, weights, experts), slot_experts(x, ids, weights, experts)
    )
    assert torch.equal(
        get_kernel("dedup")(x, ids, weights, experts), dedup_experts(x, ids, weights, experts)
    )


def test_the_triton_kernels_take_verification_passes_of_matching_dtypes():
    x, ids, weights, experts = make_pass(16, 2, 8, dtype=torch.bfloat16)
    assert triton_kernels.fits(x, ids, experts)
    assert not triton_kernels.fits(x.float(), ids, experts)  # dtypes differ
    long_x, long_ids, _, _ = make_pass(17, 2, 8, dtype=torch.bfloat16)
    assert not triton_kernels.fits(long_x, long_ids, experts)  # a prompt, not a verification
    transposed = ExpertWeights(experts.gate_up.mT.contiguous().mT, experts.down)
    assert not triton_kernels.fits(x, ids, transposed)
    assert not triton_kernels.usable(x, ids, experts)  # on the CPU


def test_importing_the_kernels_does_not_import_triton():
    result = _run_python("""
        import sys
        import moespec.kernels
        print("triton" in sys.modules)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_without_triton_every_kernel_still_runs():
    result = _run_python("""
        import sys
        sys.modules["triton"] = None  # as if not installed: find_spec None, import fails
        import torch
        from moespec.kernels import ExpertWeights, get_kernel
        from moespec.kernels.triton import available
        experts = ExpertWeights(torch.randn(4, 8, 6), torch.randn(4, 6, 4))
        x, ids, w = torch.randn(3, 6), torch.tensor([[0, 1], [1, 2], [3, 0]]), torch.ones(3, 2)
        assert not available()
        for name in ("reference", "slot", "dedup", "dedup-linear"):
            get_kernel(name)(x, ids, w, experts)
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_settings_fall_back_from_shape_to_device_to_default():
    table = {
        "default": TUNED["default"],
        "devices": {
            "GPU A": {
                "*": {"slot": {"down": {"split": 2}}},
                "2048x768": {"slot": {"down": {"block_n": 8}}},
            }
        },
    }
    default = settings_for("slot", 2048, 768, None, table)
    assert default.down == StageSettings(**TUNED["default"]["slot"]["down"])
    device = settings_for("slot", 4096, 768, "GPU A", table)
    assert (device.down.split, device.down.block_n) == (2, default.down.block_n)
    shape = settings_for("slot", 2048, 768, "GPU A", table)
    assert (shape.down.split, shape.down.block_n) == (2, 8)
    assert shape.gate_up == default.gate_up


@pytest.mark.parametrize(
    "stage, message",
    [
        ({"block_n": 12}, "block_n must be a power of two"),
        ({"split": 0}, "split must be a positive integer"),
        ({"block_n": 8}, "dedup gate_up: block_n and block_k must be >= 16"),
    ],
)
def test_bad_settings_are_refused_by_name(stage, message):
    table = {"default": TUNED["default"], "devices": {"GPU": {"*": {"dedup": {"gate_up": stage}}}}}
    with pytest.raises(ValueError, match=message):
        settings_for("dedup", 64, 32, "GPU", table)


def test_a_settings_file_merges_over_the_built_in_table(tmp_path):
    path = tmp_path / "tuned.json"
    path.write_text('{"devices": {"GPU": {"64x32": {"dedup": {"down": {"split": 2}}}}}}')
    table = load_table(path)
    assert settings_for("dedup", 64, 32, "GPU", table).down.split == 2
    path.write_text('{"devices": {"GPU": {"wide": {}}}}')
    with pytest.raises(ValueError, match="tuned.json: shape key 'wide'"):
        load_table(path)
