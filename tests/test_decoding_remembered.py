"""Measurements remembered between runs: written after a generation, seeding the next one's
verify times, draft times and acceptances; ignored (one warning) when corrupt, of another
layout or machine; keyed by engine; not touched with --no-cache."""

import json

import pytest

from moespec.cli import main
from moespec.decoding import remembered
from moespec.decoding.remembered import LAYOUT, Remembered
from moespec.decoding.setup import speculation_factory
from moespec.demo import demo_paths
from moespec.session import GenerateSettings, generate_text


def run(notes=None, **settings):
    settings = {"prompt": "import os\nimport sys\nimport os\n", "max_tokens": 96, **settings}
    notes = [] if notes is None else notes
    return generate_text(GenerateSettings(**settings), on_note=notes.append)


def open_entry():
    target = demo_paths()[0]
    return Remembered.open(target, weights=None, dtype="bf16", threads=_threads())


def _threads():
    import torch

    return torch.get_num_threads()


def test_a_run_remembers_and_the_next_starts_from_it(remembered_measurements):
    run()
    data = json.loads(remembered_measurements.read_text())
    assert data["layout"] == LAYOUT and data["machine"] == remembered.machine()
    (entry,) = data["entries"].values()
    assert "suffix" in entry["drafters"] and "levels" in entry["drafters"]["suffix"]
    # a fresh speculation seeded from it knows tau(n) before any step
    from moespec.decoding import Sampler
    from moespec.models import load_model

    model, tokenizer = load_model(demo_paths()[0])
    make = speculation_factory(
        "auto",
        target=model,
        tokenizer=tokenizer,
        sampler=Sampler(),
        prompt=[1],
        max_tokens=8,
        dtype="bf16",
    )
    fresh = make()
    assert fresh.verify_times.known() == {}
    open_entry().seed(fresh)
    assert fresh.verify_times.known() == {int(n): s for n, s in entry["verify"].items()}
    suffix = fresh.options["suffix"]
    assert [suffix.policy.accepted, suffix.policy.rejected] == pytest.approx(
        entry["drafters"]["suffix"]["acceptance"]
    )


def test_only_times_measured_often_enough_and_sane_are_remembered(tmp_path):
    from moespec.decoding.speculation import Speculation
    from moespec.decoding.suffix import SuffixDrafter

    speculation = Speculation.auto([SuffixDrafter()])
    samples = {1: [1.0] * 4, 2: [1.5] * 4, 3: [2.0] * 2, 4: [9.0] * 4}
    for n, values in samples.items():
        for value in [100.0, *values]:  # the first sample of a size is dropped
            speculation.verify_times.add(n, value)
    memory = Remembered(tmp_path / "m.json", "key")
    memory.take(speculation)
    # size 3 stands on two samples; size 4 is dearer than four one-token passes
    assert memory.entry["verify"] == {"1": 1.0, "2": 1.5}
    memory.save()
    again = Remembered(tmp_path / "m.json", "key")
    fresh = Speculation.auto([SuffixDrafter()])
    again.seed(fresh)
    assert fresh.verify_times.known() == {1: 1.0, 2: 1.5}


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("{not json", "unreadable"),
        (json.dumps({"layout": LAYOUT + 1, "entries": {}}), "layout"),
        (json.dumps({"layout": LAYOUT, "machine": {"cpu": "elsewhere"}, "entries": {}}), "machine"),
    ],
)
def test_a_bad_file_is_ignored_with_one_warning_and_rebuilt(remembered_measurements, content, why):
    remembered_measurements.write_text(content)
    notes = []
    run(notes)
    warnings = [n for n in notes if n.startswith("warning:")]
    assert len(warnings) == 1 and why in warnings[0]
    assert json.loads(remembered_measurements.read_text())["layout"] == LAYOUT


def test_no_cache_neither_reads_nor_writes(remembered_measurements, capsys):
    remembered_measurements.write_text("{corrupt")
    assert main(["generate", "import os", "--max-tokens", "8", "--no-cache"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert remembered_measurements.read_text() == "{corrupt"


def test_another_engine_is_another_entry(monkeypatch, tmp_path):
    before = open_entry().key
    source = tmp_path / "step.c"
    source.write_text("/* another engine */")
    monkeypatch.setattr("moespec.kernels.native.SOURCES", (source,))
    assert open_entry().key != before


def test_a_server_starts_from_remembered_times_and_keeps_its_own(
    remembered_measurements, checkpoint_dir
):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from moespec.serve.app import create_app
    from tests.serving import tiny_engine

    target, _ = checkpoint_dir("qwen3_moe")
    engine = tiny_engine(target, draft="suffix", remember=True)
    try:
        assert engine.speculation.verify_times.known() == {}  # nothing remembered yet
        body = {"prompt": "w1 w2 w3 w1 w2 w3 w1", "max_tokens": 64, "temperature": 0}
        client = TestClient(create_app(engine))
        for _ in range(3):  # enough passes of a size to be remembered
            assert client.post("/v1/completions", json=body).status_code == 200
    finally:
        engine.close()
    (entry,) = json.loads(remembered_measurements.read_text())["entries"].values()
    assert entry["verify"]
    again = tiny_engine(target, draft="suffix", remember=True)
    try:
        known = again.speculation.verify_times.known()
        assert known == {int(n): s for n, s in entry["verify"].items()}
    finally:
        again.close()


@pytest.mark.parametrize(
    "entry",
    [
        "oops",
        {"verify": [1, 2], "drafters": "x"},
        {"drafters": {"suffix": [1]}},
        {"drafters": {"suffix": {"levels": "z", "draft": 3, "acceptance": "q"}}},
    ],
)
def test_an_entry_edited_by_hand_into_nonsense_is_ignored(tmp_path, entry):
    from moespec.decoding.speculation import Speculation
    from moespec.decoding.suffix import SuffixDrafter

    file = tmp_path / "m.json"
    data = {"layout": LAYOUT, "machine": remembered.machine(), "entries": {"k": entry}}
    file.write_text(json.dumps(data))
    memory = Remembered(file, "k")
    speculation = Speculation.auto([SuffixDrafter()])
    memory.seed(speculation)
    assert speculation.verify_times.known() == {}
    memory.take(speculation)
    memory.save()
    assert isinstance(json.loads(file.read_text())["entries"]["k"]["drafters"]["suffix"], dict)
