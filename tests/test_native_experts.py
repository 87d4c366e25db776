"""One MoE layer's expert operation as the native pass runs it (NativeExperts), and the
calibration timing it where the engine's passes run natively."""

import pytest
import torch
import torch.nn.functional as F

from moespec.calibrate.bench import BenchSettings, ExpertOpBenchmark
from moespec.errors import SettingError
from moespec.kernels import ExpertWeights
from moespec.models.native_step import NativeExperts, experts_unsupported

E, H, I, TOP_K = 8, 64, 32, 2


def make_experts(dtype=torch.bfloat16, int8=False) -> ExpertWeights:
    g = torch.Generator().manual_seed(0)
    experts = ExpertWeights(
        (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype),
        (torch.randn(E, H, I, generator=g) * 0.1).to(dtype),
    )
    return experts.quantize_int8() if int8 else experts.pack()


def native_experts(**kwargs):
    experts = make_experts(**kwargs)
    if (why := experts_unsupported(experts)) is not None:
        pytest.skip(f"no native expert operation here: {why}")
    return experts, NativeExperts(experts)


def routing(tokens, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
    ids[-1] = ids[0]  # a repeated expert set, so that dedup shares reads
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), dim=-1)
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


def needs_the_library():
    from moespec.kernels import native as nat

    if nat.native().lib is None:
        pytest.skip(f"no native library here: {nat.native().reason}")


def test_experts_the_native_operation_cannot_take_are_named():
    needs_the_library()
    assert "bf16" in experts_unsupported(make_experts(dtype=torch.float32))
    with pytest.raises(ValueError, match="cannot run these experts"):
        NativeExperts(make_experts(dtype=torch.float32))


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
    needs_the_library()
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
