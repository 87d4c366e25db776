"""Memory you can see and set: footprints counted before loading, refusals before allocating."""

import pytest

from moespec.cli import main
from moespec.models import load_model
from moespec.models.converted import convert, load_converted
from moespec.models.memory import (
    MARGIN_BYTES,
    Footprint,
    MemoryRefusal,
    fit_memory,
    model_footprint,
    process_memory,
)


@pytest.mark.parametrize("weights", [None, "int8", "int8-experts"])
def test_the_footprint_counts_the_bytes_a_converted_model_maps(weights, checkpoint_dir, tmp_path):
    directory, _ = checkpoint_dir("qwen3_moe")
    footprint = model_footprint(directory, "bf16", weights)
    convert(directory, tmp_path / "c", weights=weights or "bf16")
    model, _ = load_converted(tmp_path / "c")
    handle = model.weights_file
    stored = sum(handle.view(name).nbytes for name in handle.names())
    assert footprint.weights_bytes == stored
    assert model_footprint(tmp_path / "c").weights_bytes == stored


def test_the_cache_per_position_is_the_models_own(checkpoint_dir):
    directory, _ = checkpoint_dir("olmoe")
    footprint = model_footprint(directory, "bf16")
    model, _ = load_model(directory)
    cache = model.new_cache(capacity=10)
    held = sum(t.nbytes for store in (cache.keys, cache.values) for t in store)
    assert footprint.cache_bytes(10) == held


FOOTPRINT = Footprint(
    weights_bytes=10 << 30,
    cache_bytes_per_position=1 << 20,
    max_positions=4096,
    weights="bf16",
    converted=False,
)


def test_weights_beyond_the_available_memory_are_refused_naming_int8():
    with pytest.raises(MemoryRefusal, match=r"needs 10.74 GB .* has 8.59 GB available.*int8"):
        fit_memory(FOOTPRINT, None, 8 << 30, name="big")


def test_the_default_context_is_the_models_capped_to_what_fits():
    assert fit_memory(FOOTPRINT, None, 64 << 30, name="m") == 4096
    room = (10 << 30) + MARGIN_BYTES + (1000 << 20)
    assert fit_memory(FOOTPRINT, None, room, name="m") == 1000


def test_a_context_whose_cache_does_not_fit_is_refused_with_the_one_that_does():
    room = (10 << 30) + MARGIN_BYTES + (1000 << 20)
    assert fit_memory(FOOTPRINT, 1000, room, name="m") == 1000
    with pytest.raises(MemoryRefusal, match=r"pass context=.1000. or less"):
        fit_memory(FOOTPRINT, 1001, room, name="m")


def test_process_memory_reads_peak_and_split_resident_memory():
    memory = process_memory()
    assert memory["peak_rss"] >= memory["rss"] > 0
    assert memory["rss_anon"] + memory["rss_file"] <= memory["rss"] + (1 << 20)


def test_generate_json_reports_weights_cache_and_resident_memory(capsys):
    import json

    from moespec.demo import demo_paths

    assert main(["generate", "def f(x):", "--max-tokens", "4", "--draft", "none", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    memory, footprint = out["memory"], model_footprint(demo_paths()[0])
    assert memory["weights_bytes"] == footprint.weights_bytes
    positions = len(out["prompt_tokens"]) + 4 + 1  # the cache is allocated once, this size
    assert memory["cache_bytes"] == footprint.cache_bytes(positions)
    assert memory["peak_rss"] >= memory["rss"] > memory["weights_bytes"]
