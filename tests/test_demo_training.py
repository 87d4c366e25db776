"""Determinism of the demo-model training script (``scripts/train_demo.py``).

The full run takes most of an hour, so these tests replay only a sliver of it:

* the shipped checkpoints are laid out as documented and match the hashes in the log;
* on the interpreter (corpus) and software the demo was trained with, retraining the
  tokenizer reproduces the shipped tokenizer files byte for byte, and the first training steps
  of both models reproduce the parameter fingerprints recorded in ``training_log.json``;
  elsewhere those checks are skipped with the reason;
* anywhere, a tiny training run twice in-process writes byte-identical checkpoint folders.

The training code is the package ``moespec.demo.training`` (imported only here and by the
script); the script is its command line.
"""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
# the script relies on transformers 5 (experts_implementation, per-expert saving, `cache=`)
pytest.importorskip("transformers", minversion="5.24")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_demo.py"
DEMO = ROOT / "moespec" / "demo"
REPLAY_STEPS = 5


@pytest.fixture(scope="module")
def td():
    """The training package (moespec.demo.training), with transformers' progress bars off."""
    import transformers

    import moespec.demo.training

    transformers.utils.logging.disable_progress_bar()
    return moespec.demo.training


@pytest.fixture(scope="module")
def shipped_log():
    """The training log written next to the shipped checkpoints."""
    path = DEMO / "training_log.json"
    if not path.exists():
        pytest.skip(f"no shipped demo models ({path} is missing)")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def replayed(td, shipped_log):
    """The shipped run's tokenizer and first training steps, redone in a fresh process.

    A subprocess, because the script sets OMP_WAIT_POLICY=PASSIVE before torch loads (here torch
    is already loaded, and busy-waiting threads slow steps ~10x on a shared machine), and so
    that thread settings cannot leak into other tests. Skipped unless this interpreter's stdlib
    is the corpus the demo was trained on and tokenizers is the same version.
    """
    recorded = shipped_log["data"]
    if td.build_corpus().fingerprint != recorded["corpus_sha256"]:
        pytest.skip(
            f"this interpreter's stdlib (Python {sys.version.split()[0]}) is not the corpus of "
            f"the shipped demo (Python {recorded['python_version']}): fingerprints differ"
        )
    env = td.environment()
    if env["tokenizers"] != shipped_log["env"]["tokenizers"]:
        pytest.skip(f"tokenizers {env['tokenizers']} != {shipped_log['env']['tokenizers']}")
    code = (
        "import json, os\n"
        "os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')  # as scripts/train_demo.py\n"
        "import moespec.demo.training as td\n"
        f"log = json.loads(open({str(DEMO / 'training_log.json')!r}).read())\n"
        f"print(json.dumps(td.replay(log, {REPLAY_STEPS})))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_shipped_checkpoint_layout(shipped_log, td, kind):
    """bf16 weights, experts stored per expert, no timestamps, files as logged."""
    folder = DEMO / kind
    header = safetensors_header(folder / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    assert {t["dtype"] for t in header.values()} == {"BF16"}
    if kind == "target":
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in header
        assert "model.layers.0.mlp.experts.15.down_proj.weight" in header
    logged = shipped_log[kind]["files_sha256"]
    assert sorted(logged) == sorted(p.name for p in folder.iterdir())
    for name, digest in logged.items():
        assert td.file_sha256(folder / name) == digest, name


def test_tokenizer_retrains_byte_identical(replayed, shipped_log):
    """Retraining the tokenizer on this stdlib rewrites the shipped tokenizer files exactly."""
    assert replayed["corpus_sha256"] == shipped_log["data"]["corpus_sha256"]
    assert sorted(replayed["tokenizer_files"]) == ["tokenizer.json", "tokenizer_config.json"]
    for kind in ("target", "draft"):
        for name, digest in replayed["tokenizer_files"].items():
            assert shipped_log[kind]["files_sha256"][name] == digest, (kind, name)


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_first_steps_match_recorded_fingerprints(td, shipped_log, replayed, kind):
    """Replaying the first steps of the shipped run gives the logged parameter fingerprints."""
    env, recorded = td.environment(), shipped_log["env"]
    for key in ("torch", "transformers", "cpu_capability"):
        if env[key] != recorded[key]:
            pytest.skip(f"{key} {env[key]} != {recorded[key]}: fp32 bits may legitimately differ")
    expected = shipped_log[kind]["log"]["fingerprints"]
    got = replayed["fingerprints"][kind]
    assert sorted(got) == ["step_0", f"step_{REPLAY_STEPS}"]
    assert got == {step: expected[step] for step in got}


def tiny_run(td, docs, out: Path) -> None:
    """Tokenizer plus a 3-step training of a miniature target and draft, saved under ``out``."""
    tok = td.train_tokenizer([d.text for d in docs], vocab_size=512)
    chunks = td.chunk_stream(td.encode_documents(tok, docs), seq_len=64)
    small = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    configs = {
        "target": td.make_target_config(
            512, num_hidden_layers=2, moe_intermediate_size=32, num_experts=4, **small
        ),
        "draft": td.make_draft_config(512, num_hidden_layers=1, intermediate_size=128, **small),
    }
    for seed, (kind, config) in enumerate(configs.items()):
        spec = td.TrainSpec(steps=3, batch_size=2, warmup=2, seed=seed)
        model = td.build_model(config, seed)
        td.train(model, chunks, spec, echo=None)
        td.save_checkpoint(model, td.wrap_tokenizer(tok), out / kind)


def test_tiny_training_is_byte_identical(td, tmp_path):
    """Two in-process runs from the same seed save identical bytes (any Python version)."""
    docs = td.build_corpus().train[:12]
    with td.deterministic_torch(2):
        tiny_run(td, docs, tmp_path / "a")
        tiny_run(td, docs, tmp_path / "b")
    files = sorted(
        p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file()
    )
    assert files and files == sorted(
        p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file()
    )
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def test_the_command_line_refuses_to_overwrite_the_shipped_models_without_force():
    from tests.checkpoints import run_script

    done = run_script(SCRIPT, ["--out", str(DEMO)])
    assert done.returncode != 0 and "refusing to overwrite" in done.stderr
    assert "use --force" in done.stderr
