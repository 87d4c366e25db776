"""Streamed loads and converted models: the same greedy tokens as a load of the whole model,
every failure in one line naming the file, nothing half-written ever loadable."""

import json
import shutil

import pytest
import torch

from moespec.decoding.setup import greedy_reference
from moespec.kernels.cpu import cpu_paths
from moespec.models import CheckpointError, load_model
from moespec.models.converted import MANIFEST, WEIGHTS_FILE, convert, load_converted
from moespec.models.tensorfile import SafetensorsFile, header_for, write_safetensors

PROMPT = [5, 6, 7, 11, 3]


def whole_model_load(directory, dtype, weights=None):
    """The load before streaming: every layer read in the dtype first, then quantized and
    packed as a whole (the reference the streamed and converted loads must equal)."""
    model, _ = load_model(directory, dtype=dtype, pack=False)
    if weights is not None:
        model.quantize_int8(dense=weights == "int8")
    return model.pack()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_streamed_and_converted_loads_decode_the_whole_loads_greedy_tokens(
    family, dtype, checkpoint_dir, tmp_path
):
    directory, _ = checkpoint_dir(family)
    reference = greedy_reference(whole_model_load(directory, dtype), PROMPT, 12)
    streamed, _ = load_model(directory, dtype=dtype)
    assert greedy_reference(streamed, PROMPT, 12) == reference
    convert(directory, tmp_path / "converted", weights=dtype)
    converted, _ = load_model(tmp_path / "converted")
    assert greedy_reference(converted, PROMPT, 12) == reference


@pytest.mark.parametrize("weights", ["int8", "int8-experts"])
def test_int8_streamed_and_converted_loads_equal_quantizing_the_whole_model(
    weights, checkpoint_dir, tmp_path
):
    directory, _ = checkpoint_dir("qwen3_moe")
    whole = whole_model_load(directory, torch.bfloat16, weights)
    streamed, _ = load_model(directory, dtype="bf16", weights=weights)
    convert(directory, tmp_path / "c", weights=weights)
    converted, _ = load_model(tmp_path / "c")
    ids = torch.tensor(PROMPT)
    logits = [m(ids, m.new_cache(), all_logits=True) for m in (whole, streamed, converted)]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    assert converted.expert_format == "int8"


def test_converted_weights_are_views_of_the_mapped_file(checkpoint_dir, tmp_path):
    directory, _ = checkpoint_dir("olmoe")
    convert(directory, tmp_path / "c", weights="bf16")
    model, _ = load_converted(tmp_path / "c")
    mapped = model.weights_file
    layer = model.layers[0]
    weights = [model.embed, model.norm, layer.input_norm]
    if cpu_paths().bf16 == "native-pairs":  # elsewhere oneDNN packs the products at load
        weights += [layer.mlp.router, layer.attention.qkv, layer.mlp.experts.weights(3)[1]]
    # a packed weight (pair layout) holds its bytes in .packed
    assert all(mapped.holds(getattr(w, "packed", w)) for w in weights)
    assert not mapped.holds(torch.zeros(4))


def test_convert_refuses_an_existing_output_without_force(checkpoint_dir, tmp_path):
    directory, _ = checkpoint_dir("olmoe")
    out = tmp_path / "c"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists"):
        convert(directory, out)
    assert (out / "keep.txt").read_text() == "mine"
    convert(directory, out, force=True)
    assert not (out / "keep.txt").exists() and (out / MANIFEST).exists()


def test_an_interrupted_convert_leaves_nothing_loadable(checkpoint_dir, tmp_path):
    directory, _ = checkpoint_dir("olmoe")
    calls = []

    def stop_midway(done, total):
        calls.append(done)
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(directory, tmp_path / "c", progress=stop_midway)
    assert calls == [1, 2, 3]
    assert list(tmp_path.iterdir()) == []  # neither the output nor its temporary directory


def test_a_converted_model_from_another_layout_version_names_the_reconvert_command(
    checkpoint_dir, tmp_path
):
    directory, _ = checkpoint_dir("olmoe")
    convert(directory, tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / MANIFEST).read_text())
    manifest["layout_version"] = 0
    (tmp_path / "c" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"layout version 0.*moespec convert .* --force"):
        load_model(tmp_path / "c")


def test_a_converted_model_for_other_product_paths_is_refused(checkpoint_dir, tmp_path):
    directory, _ = checkpoint_dir("olmoe")
    convert(directory, tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / MANIFEST).read_text())
    manifest["layouts"] = {"bf16": "elsewhere", "int8": "elsewhere", "cpu_family": "other"}
    (tmp_path / "c" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"for the elsewhere path.*convert again here"):
        load_model(tmp_path / "c")


def test_a_converted_weights_file_that_changed_size_is_refused(checkpoint_dir, tmp_path):
    directory, _ = checkpoint_dir("olmoe")
    convert(directory, tmp_path / "c")
    with open(tmp_path / "c" / WEIGHTS_FILE, "ab") as f:
        f.write(b"\0" * 64)
    with pytest.raises(CheckpointError, match="changed after it was converted"):
        load_model(tmp_path / "c")


def test_a_converted_model_refuses_another_dtype_or_weights_kind(checkpoint_dir, tmp_path):
    directory, _ = checkpoint_dir("olmoe")
    convert(directory, tmp_path / "c", weights="bf16")
    with pytest.raises(CheckpointError, match="runs in that dtype"):
        load_model(tmp_path / "c", dtype="fp32")
    with pytest.raises(CheckpointError, match="again for int8 weights"):
        load_model(tmp_path / "c", weights="int8")


def test_convert_of_a_truncated_shard_names_the_file(checkpoint_dir, tmp_path):
    directory, _ = checkpoint_dir("olmoe")
    source = tmp_path / "src"
    shutil.copytree(directory, source)
    data = (source / "model.safetensors").read_bytes()
    (source / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model.safetensors .*truncated"):
        convert(source, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_safetensors_written_as_a_stream_read_back_by_the_safetensors_package(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int8),
        "c": torch.randn(2, 2, 2),
    }
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    write_safetensors(tmp_path / "x.safetensors", specs, iter(tensors.items()))
    back = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(back[n], t) for n, t in tensors.items())
    mapped = SafetensorsFile(tmp_path / "x.safetensors")
    assert all(torch.equal(mapped.view(n), t) for n, t in tensors.items())
    head, ranges = header_for(specs)
    assert len(head) % 64 == 0 and all(start % 64 == 0 for start, _ in ranges.values())


def test_a_stream_that_disagrees_with_its_specs_is_refused(tmp_path):
    specs = [("a", torch.float32, (2,))]
    with pytest.raises(ValueError, match=r"'a' is torch.float32 \[3\]"):
        write_safetensors(tmp_path / "x", specs, iter([("a", torch.zeros(3))]))


def test_the_convert_command_writes_once_and_refuses_in_one_line(checkpoint_dir, tmp_path, capsys):
    from moespec.cli import main

    directory, _ = checkpoint_dir("olmoe")
    out = tmp_path / "c"
    assert main(["convert", str(directory), str(out), "--weights", "int8", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["weights"] == "int8" and summary["bytes"] == (out / WEIGHTS_FILE).stat().st_size
    assert main(["convert", str(directory), str(out)]) == 2
    error = capsys.readouterr().err
    assert "already exists" in error and "--force" in error and error.count("\n") == 1
    assert main(["convert", str(out), str(tmp_path / "again")]) == 2
    assert "already converted" in capsys.readouterr().err
    assert main(["generate", "--model", str(out), "w1 w2", "--max-tokens", "3", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 3


def test_a_write_that_fails_midway_leaves_nothing_and_says_so_in_one_line(checkpoint_dir, tmp_path):
    """A real failed write (a file-size limit, as a full disk fails a write): exit 2, one
    line naming the output, neither the output nor its temporary directory left."""
    import resource
    import signal
    import subprocess
    import sys

    directory, _ = checkpoint_dir("olmoe")

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    out = tmp_path / "c"
    done = subprocess.run(
        [sys.executable, "-m", "moespec", "convert", str(directory), str(out)],
        capture_output=True,
        text=True,
        preexec_fn=limited,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and str(out) in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []
