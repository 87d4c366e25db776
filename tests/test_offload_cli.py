"""The `moespec simulate` command: its JSON contract, its report and its errors."""

import json

import numpy as np
import pytest

from moespec.cli import main
from moespec.routing import RoutingTrace
from moespec.routing.store import write_trace


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(8)[:2] for _ in range(2 * 160)]).reshape(160, 2, 2)
    trace = RoutingTrace(
        ids.astype(np.int16), [0, 80, 160], ["a", "b"], 8, [10**6] * 2, [0, 1], model="tiny"
    )
    path = tmp_path_factory.mktemp("trace") / "tiny.parquet"
    write_trace(trace, path)
    return path


def run_cli(capsys, *argv):
    code = main(["simulate", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_is_keyed_by_policy_with_the_promised_fields(capsys, trace_file):
    code, out, _ = run_cli(capsys, "--trace", trace_file, "--tokens", 40, "--json")
    assert code == 0
    results = json.loads(out)
    assert list(results) == ["spac", "lru", "static", "static-layers", "hybrid", "spac-ar"]
    for r in results.values():
        assert {"tokens_per_second", "hit_rate", "bytes_copied"} <= set(r)
        assert r["tokens"] == 40


def test_the_text_table_names_every_policy(capsys, trace_file):
    code, out, _ = run_cli(
        capsys, "--trace", trace_file, "--tokens", 20, "--policy", "lru,hybrid-ar"
    )
    assert code == 0
    assert "lru " in out and "hybrid-ar " in out


def test_report_writes_tables_and_figures_and_refuses_to_clobber(capsys, trace_file, tmp_path):
    args = ["--trace", trace_file, "--tokens", 20, "--policy", "spac,static", "--report", tmp_path]
    code, _, _ = run_cli(capsys, *args, "--draft-stop", 0.5)
    assert code == 0
    report = (tmp_path / "report.md").read_text()
    for heading in ("per workload and policy", "one part removed", "expert cache size"):
        assert heading in report
    # the settings that change the figures are named: the draft stop, a synthetic trace's
    # local popularity (a recorded trace has none)
    assert "seed 0, draft stop 0.5. Policies" in report
    data = json.loads((tmp_path / "report.json").read_text())
    from moespec.report.offload import markdown

    data["workload"]["metadata"] = {"local_popularity": 0.8}
    assert "draft stop 0.5, each document's popularity 0.8 its own." in markdown(data)
    assert {r["policy"] for r in data["table2"]} >= {"spac", "spac-no-sd", "spac-no-evict"}
    assert {r["cache_ratio"] for r in data["figure5"]} == {0.1, 0.17, 0.25, 0.4, 0.6}
    for png in ["table1.png", "table2.png", "figure5.png", "draft-length.png"]:
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "already exists" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policy", "fifo"], "unknown policy 'fifo'"),
        (["--profile", "tpu"], "unknown hardware profile 'tpu'"),
        (["--expert-cache-ratio", "2"], "cache ratio must be in [0, 1]"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(capsys, trace_file, argv, message):
    code, _, err = run_cli(capsys, "--trace", trace_file, "--tokens", 10, *argv)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_profile_file_lacking_fields_is_refused(capsys, trace_file, tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"name": "half", "link_bandwidth": 1e9}))
    code, _, err = run_cli(capsys, "--trace", trace_file, "--profile", profile)
    assert code == 2 and "profile lacks" in err


def test_a_profile_whose_link_outruns_host_memory_is_refused(capsys, trace_file, tmp_path):
    # the copies read host memory: a link at or above it would leave the CPU's expert reads
    # no bandwidth at all (the contention model then stretched them a thousandfold)
    from moespec.offload import get_profile

    fields = get_profile("rtx4090-avx2").to_dict()
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(fields | {"link_bandwidth": 100e9, "sources": []}))
    code, _, err = run_cli(capsys, "--trace", trace_file, "--profile", profile)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "link_bandwidth (1e+11 B/s) must be below host_memory_bandwidth (7e+10 B/s)" in err
    profile.write_text(json.dumps(fields | {"link_bandwidth": 50e9, "sources": []}))
    code, _, err = run_cli(capsys, "--trace", trace_file, "--tokens", 10, "--profile", profile)
    assert code == 0, err


def test_a_synthetic_fit_split_of_several_requests(capsys):
    # --fit-documents: the fit split as that many requests of their own, as the gate profiles
    from moespec.offload.sim.experiments import load_workload

    workload = load_workload(
        synthetic="olmoe-1b-7b", tokens=30, fit_tokens=40, fit_documents=4, draft_length=4
    )
    assert workload.trace.doc_starts.tolist()[:5] == [0, 10, 20, 30, 40]
    assert workload.fit_trace().num_tokens == 40
    base = ("--synthetic", "olmoe-1b-7b", "--tokens", 8, "--fit-tokens", 40, "--json")
    code, out, err = run_cli(capsys, *base, "--fit-documents", 4, "--policy", "static")
    assert code == 0, err
    assert json.loads(out)["static"]["tokens"] == 8
    code, _, err = run_cli(capsys, *base, "--fit-documents", 0)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--fit-documents must be 1 to --fit-tokens (40)" in err
