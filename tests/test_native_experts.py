"""One MoE layer's expert operation as the native pass runs it (NativeExperts), and the
calibration timing it where the engine's passes run natively; the CPU expert kernels on
passes of no tokens."""

import threading

import pytest
import torch
import torch.nn.functional as F

from moespec.calibrate.bench import BenchSettings, ExpertOpBenchmark
from moespec.errors import SettingError
from moespec.kernels import KERNELS, ExpertWeights
from moespec.kernels import native as nat
from moespec.models.native_step import NativeExperts, experts_unsupported
from tests.native import needs_library, needs_loops

E, H, I, TOP_K = 8, 64, 32, 2


def make_experts(dtype=torch.bfloat16, int8=False) -> ExpertWeights:
    g = torch.Generator().manual_seed(0)
    experts = ExpertWeights(
        (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype),
        (torch.randn(E, H, I, generator=g) * 0.1).to(dtype),
    )
    return experts.quantize_int8() if int8 else experts.pack()


def native_experts(**kwargs):
    """Experts and their native operation: skipped only where this machine has no native
    loops for their weights, a failure where it has them and the operation declines."""
    needs_loops("int8" if kwargs.get("int8") else "bf16")
    experts = make_experts(**kwargs)
    assert experts_unsupported(experts) is None
    return experts, NativeExperts(experts)


def routing(tokens, seed=1, top_k=TOP_K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
    ids[-1] = ids[0]  # a repeated expert set, so that dedup shares reads
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return x, ids, weights


def dense_reference(experts, x, ids, weights) -> torch.Tensor:
    """fp32 sum over slots of w * down(silu(gate x) * up x), from the dense weights."""
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for s in range(TOP_K):
            gate_up, down = experts.dense_weights(int(ids[t, s]))
            hidden = gate_up.float() @ x[t].float()
            act = F.silu(hidden[:I]) * hidden[I:]
            out[t] += weights[t, s] * (down.float() @ act)
    return out


@pytest.mark.parametrize("int8", [False, True])
def test_the_native_expert_operation_computes_the_layer(int8):
    experts, native = native_experts(int8=int8)
    x, ids, weights = routing(9)
    exact = dense_reference(experts, x, ids, weights)
    got = native(x, ids, weights, dedup=True).float()
    # bf16 rounding points (and int8 weights against their own dequantized values): measured
    # well under 1% of the largest output
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 0.02


def test_slot_and_dedup_give_each_row_its_one_row_bits():
    _, native = native_experts()
    x, ids, weights = routing(9)
    slot = native(x, ids, weights, dedup=False)
    assert torch.equal(native(x, ids, weights, dedup=True), slot)
    for t in range(9):
        row = native(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], dedup=False)
        assert torch.equal(row, slot[t : t + 1])


def test_expert_ids_outside_the_layer_and_misshapen_weights_are_refused():
    _, native = native_experts()
    x, ids, weights = routing(2)
    ids[1, 0] = E
    with pytest.raises(IndexError, match=f"outside 0-{E - 1}"):
        native(x, ids, weights, dedup=True)
    with pytest.raises(ValueError, match="routing weights"):
        native(x, ids[:, :1] % E, weights, dedup=True)  # weights of another shape


def test_experts_the_native_operation_cannot_take_are_named():
    needs_library()
    assert "bf16" in experts_unsupported(make_experts(dtype=torch.float32))
    with pytest.raises(ValueError, match="cannot run these experts"):
        NativeExperts(make_experts(dtype=torch.float32))


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dedup", [False, True])
def test_no_tokens_give_an_empty_output(int8, dedup):
    _, native = native_experts(int8=int8)
    x, ids, weights = routing(3)
    out = native(x[:0], ids[:0], weights[:0], dedup=dedup)
    assert out.shape == (0, H) and out.dtype == torch.bfloat16
    # and the module is as it was: a pass of tokens after it gets its bits
    assert torch.equal(native(x, ids, weights, dedup), native(x, ids, weights, not dedup))


def test_concurrent_calls_give_the_bits_of_serial_calls():
    # two threads call one module at once with other tokens and other top k: each call's k
    # goes with the call (a k kept in the module would be read by the other thread's call)
    _, native = native_experts()
    cases = [routing(9, seed=2, top_k=4), routing(4, seed=3, top_k=1)]
    serial = [native(*case, dedup=d) for case in cases for d in (False, True)]
    mismatches, errors = [], []

    def run(case, dedups, wanted):
        try:
            for _ in range(200):
                for d, want in zip(dedups, wanted, strict=True):
                    if not torch.equal(native(*case, dedup=d), want):
                        mismatches.append(case[1].shape)
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [
        threading.Thread(target=run, args=(case, (False, True), serial[2 * i : 2 * i + 2]))
        for i, case in enumerate(cases)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not mismatches


def _experts_arguments(native, **changes) -> list:
    """A call of moespec_experts that reads nothing before its checks (null tensors), with
    `changes` by argument name."""
    names = nat._SIGNATURES["moespec_experts"][0].split()
    args = dict.fromkeys(names, 0)
    args.update(zip(("m", "L"), native._structures, strict=True))
    args.update({"T": 1, "k": 1, "threads": 1})
    args.update(changes)
    return [args[n] for n in names]


@pytest.mark.parametrize(
    "changes, refused",
    [({"T": -1}, "T"), ({"k": -2}, "k"), ({"threads": 0}, "threads")],
)
def test_the_c_expert_operation_refuses_arguments_out_of_bounds_by_name(changes, refused):
    _, native = native_experts()
    with pytest.raises(ValueError, match=f"^moespec_experts refused {refused}: it needs "):
        nat.call("moespec_experts", *_experts_arguments(native, **changes))


def _kernel_experts(dtype, form) -> ExpertWeights:
    g = torch.Generator().manual_seed(4)
    experts = ExpertWeights(
        (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype),
        (torch.randn(E, H, I, generator=g) * 0.1).to(dtype),
    )
    if form == "packed":
        return experts.pack()
    return experts.quantize_int8() if form == "int8" else experts


FORMS = [
    (torch.float32, "as loaded"),
    (torch.float32, "packed"),
    (torch.bfloat16, "as loaded"),
    (torch.bfloat16, "packed"),
    (torch.bfloat16, "int8"),
]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype, form", FORMS, ids=[f"{d}-{f}" for d, f in FORMS])
def test_every_cpu_expert_kernel_takes_a_pass_of_no_tokens(kernel, dtype, form):
    experts = _kernel_experts(dtype, form)
    x = torch.randn(3, H).to(dtype)
    ids = torch.tensor([[0, 5], [5, 2], [7, 0]])
    weights = torch.softmax(torch.randn(3, TOP_K), dim=-1)
    if kernel == "dedup-linear" and experts.is_packed:  # it takes unpacked weights only
        with pytest.raises(ValueError, match="needs unpacked expert weights"):
            KERNELS[kernel](x[:0], ids[:0], weights[:0], experts)
        return
    out = KERNELS[kernel](x[:0], ids[:0], weights[:0], experts)
    assert out.shape == (0, H) and out.dtype == dtype
    full = KERNELS[kernel](x, ids, weights, experts)  # and tokens still give their values
    exact = KERNELS["reference"](x, ids, weights, experts)
    assert full.shape == (3, H) and exact.abs().max() > 0
    assert ((full.float() - exact.float()).abs().max() / exact.float().abs().max()) < 0.02


SETTINGS = BenchSettings(pass_sizes=(1, 3), chosen_levels=2, repeats=1, warmup=0, flush_bytes=0)


def test_the_calibration_times_the_native_operation_where_the_experts_take_it(
    tmp_path, monkeypatch
):
    experts, _ = native_experts()
    calls = []
    original = NativeExperts.__call__

    def counted(self, *args, **kwargs):
        calls.append(args[-1] if len(args) == 4 else kwargs["dedup"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(NativeExperts, "__call__", counted)
    bench = ExpertOpBenchmark({0: experts}, TOP_K, SETTINGS)
    assert bench.header["expert_operation"] == "native"
    records = bench.run(tmp_path / "bench.jsonl", progress=False)
    # every case of both kernels ran natively: the dedup flag of each kernel's cases
    assert sorted(set(calls)) == [False, True]
    assert len(calls) == len(records) * SETTINGS.repeats
    eager = ExpertOpBenchmark({0: experts}, TOP_K, SETTINGS, native=False)
    assert "expert_operation" not in eager.header
    with pytest.raises(ValueError, match="written with other settings"):
        eager.run(tmp_path / "bench.jsonl", progress=False)  # never mixes the two


def test_asking_for_the_native_operation_where_it_cannot_run_fails_in_one_line():
    needs_library()
    fp32 = make_experts(dtype=torch.float32)
    with pytest.raises(SettingError, match="cannot be timed here: .*bf16"):
        ExpertOpBenchmark({0: fp32}, TOP_K, SETTINGS, native=True)
    assert "expert_operation" not in ExpertOpBenchmark({0: fp32}, TOP_K, SETTINGS).header


def test_the_last_level_cache_is_read_from_linux(tmp_path):
    from moespec.calibrate.timing import last_level_cache_bytes

    for index, (level, kind, size) in enumerate(
        [
            (1, "Data", "48K"),
            (1, "Instruction", "32K"),
            (2, "Unified", "2048K"),
            (3, "Unified", "32M"),
        ]
    ):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(f"{value}\n")
    assert last_level_cache_bytes(tmp_path) == 32 * 2**20
    assert last_level_cache_bytes(tmp_path / "absent") is None


def test_a_working_set_beyond_the_cache_is_twice_a_large_cache(monkeypatch):
    import moespec.calibrate.timing as timing

    mib = 2**20
    for cache, wanted in ((32 * mib, 512 * mib), (504 * mib, 1008 * mib), (None, 512 * mib)):
        monkeypatch.setattr(timing, "last_level_cache_bytes", lambda cache=cache: cache)
        assert timing.beyond_last_level_cache(512 * mib) == wanted


def test_a_model_that_fits_in_the_last_level_cache_is_timed_warm(monkeypatch):
    import moespec.calibrate.plan as plan
    from moespec.demo import demo_paths
    from moespec.models import load_model

    model = load_model(demo_paths()[0], dtype="bf16")[0]  # 28.9 MB of weights
    settings = BenchSettings(flush_bytes=None)
    for cache, flush in ((32 * 2**20, 0), (16 * 2**20, 256 * 2**20), (None, 256 * 2**20)):
        monkeypatch.setattr(plan, "last_level_cache_bytes", lambda cache=cache: cache)
        assert plan.engine_cache_state(settings, model).flush_bytes == flush
    given = BenchSettings(flush_bytes=2**20)
    assert plan.engine_cache_state(given, model) is given  # a flush asked for is kept
