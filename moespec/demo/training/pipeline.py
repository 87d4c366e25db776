"""The whole run: data, both models trained and saved, measured, logged and carded; and the
replay of a logged run's first steps (for the determinism test)."""

import argparse
import contextlib
import platform
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer

from moespec.demo.training.cards import draft_card, fmt_list, target_card
from moespec.demo.training.configs import (
    build_model,
    file_sha256,
    make_draft_config,
    make_target_config,
)
from moespec.demo.training.corpus import EOS_TOKEN, Corpus, build_corpus
from moespec.demo.training.loop import TrainLog, TrainSpec, deterministic_torch, mean_loss, train
from moespec.demo.training.measure import (
    acceptance_prompts,
    expert_reuse,
    greedy_acceptance,
    routing_top_k,
    unigram_loss,
)
from moespec.demo.training.saving import load_shipped, save_checkpoint, save_tokenizer
from moespec.demo.training.tokenizer import (
    chunk_stream,
    encode_documents,
    train_tokenizer,
    wrap_tokenizer,
)
from moespec.provenance import cpu_capability


def replay(log: dict, steps: int) -> dict:
    """Redo the data preparation and the first ``steps`` training steps of a logged run.

    Returns the sha256 of the retrained tokenizer files and, per model, the parameter
    fingerprints taken on the way, to compare with those in ``log``. Run it in a fresh process
    (the test does) so that OMP_WAIT_POLICY=PASSIVE takes effect (scripts/train_demo.py).
    """
    data = prepare_data(log["data"]["vocab_size"], log["seq_len"])
    result = {"corpus_sha256": data.corpus.fingerprint, "tokenizer_files": {}, "fingerprints": {}}
    with tempfile.TemporaryDirectory() as tmp:
        save_tokenizer(wrap_tokenizer(data.tok), Path(tmp))
        for path in sorted(Path(tmp).iterdir()):
            result["tokenizer_files"][path.name] = file_sha256(path)
    makers = {"target": make_target_config, "draft": make_draft_config}
    with deterministic_torch(log["env"]["threads"]):
        for kind, make in makers.items():
            spec = TrainSpec(**{**log[kind]["spec"], "fingerprint_steps": (0, steps)})
            model = build_model(make(log["data"]["vocab_size"]), spec.seed)
            run_log = train(model, data.train_chunks, spec, stop_after=steps, echo=None)
            result["fingerprints"][kind] = run_log.fingerprints
    return result


OUTPUT_NAMES = ("target", "draft", "training_log.json")


def environment() -> dict:
    """Versions and CPU features the bytes depend on."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "cpu_capability": cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def install_outputs(staging: Path, out: Path) -> None:
    """Rename each finished output from ``staging`` into ``out``, replacing old ones last."""
    for name in OUTPUT_NAMES:
        dest = out / name
        if dest.exists():
            dest.rename(staging / f"old-{name}")
        (staging / name).rename(dest)


def model_record(model, spec: TrainSpec, log: TrainLog, folder: Path) -> dict:
    """Config, size, spec and log of one trained model for the log and its card."""
    return {
        "config": model.config.to_dict(),
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": (folder / "model.safetensors").stat().st_size,
        "spec": asdict(spec),
        "log": asdict(log),
        "files_sha256": {p.name: file_sha256(p) for p in sorted(folder.iterdir())},
    }


@contextlib.contextmanager
def phase(name: str, seconds: dict) -> Iterator[None]:
    """Time a phase of the run into ``seconds[name]`` and say when it is done."""
    start = time.perf_counter()
    yield
    seconds[name] = round(time.perf_counter() - start, 1)
    print(f"{name}: {seconds[name]:.1f}s", flush=True)


@dataclass
class Data:
    """Tokenizer and token windows shared by both models."""

    corpus: Corpus
    tok: Tokenizer
    train_stream: torch.Tensor
    held_stream: torch.Tensor
    train_chunks: torch.Tensor
    held_chunks: torch.Tensor


def prepare_data(vocab_size: int, seq_len: int, root: Path | None = None) -> Data:
    """Read the corpus, train the tokenizer on the training files, cut both splits."""
    corpus = build_corpus(root)
    tok = train_tokenizer([d.text for d in corpus.train], vocab_size)
    train_stream = encode_documents(tok, corpus.train)
    held_stream = encode_documents(tok, corpus.held_out)
    return Data(
        corpus,
        tok,
        train_stream,
        held_stream,
        chunk_stream(train_stream, seq_len),
        chunk_stream(held_stream, seq_len),
    )


def target_and_draft(args: argparse.Namespace) -> list[tuple[str, object, TrainSpec]]:
    """(name, config, spec) of both models; the draft's seed is offset so it differs."""
    batch = args.batch_size
    return [
        (
            "target",
            make_target_config(args.vocab_size),
            TrainSpec(steps=args.target_steps, batch_size=batch, seed=args.seed),
        ),
        (
            "draft",
            make_draft_config(args.vocab_size),
            TrainSpec(steps=args.draft_steps, batch_size=batch, seed=args.seed + 1),
        ),
    ]


def data_record(data: Data, args: argparse.Namespace, tokenizer_json: Path) -> dict:
    """What the log and the cards say about the corpus and tokenizer."""
    docs = data.corpus.train + data.corpus.held_out
    return {
        "python_version": platform.python_version(),
        "stdlib_root": data.corpus.root,
        "files": len(docs),
        "held_out_files": len(data.corpus.held_out),
        "held_out_paths": [d.path for d in data.corpus.held_out],
        "bytes": sum(len(d.text.encode("utf-8")) for d in docs),
        "train_tokens": data.train_stream.numel(),
        "held_out_tokens": data.held_stream.numel(),
        "vocab_size": args.vocab_size,
        "corpus_sha256": data.corpus.fingerprint,
        "tokenizer_json_sha256": file_sha256(tokenizer_json),
    }


def evaluate(staging: Path, data: Data, seed: int) -> dict:
    """The cards' numbers, measured on the saved checkpoints (what ships)."""
    target, draft = load_shipped(staging / "target"), load_shipped(staging / "draft")
    top, target_loss = routing_top_k(target, data.held_chunks)
    eos = data.tok.token_to_id(EOS_TOKEN)
    routing = expert_reuse(top, data.held_chunks[:, :-1], eos, target.config.num_experts, seed)
    prompts = acceptance_prompts(data.tok, data.corpus.held_out, n_prompts=64, prompt_len=64)
    return {
        "held_out_windows": data.held_chunks.shape[0],
        "target_loss": target_loss,
        "draft_loss": mean_loss(draft, data.held_chunks),
        "unigram_loss": unigram_loss(data.train_stream, data.held_chunks, target.vocab_size),
        "acceptance": greedy_acceptance(target, draft, prompts, new_tokens=64),
        "routing": routing,
    }


def summary(ev: dict) -> str:
    """One paragraph of the headline numbers for the console."""
    r = ev["routing"]
    return (
        f"held-out loss target {ev['target_loss']:.3f} draft {ev['draft_loss']:.3f} "
        f"unigram {ev['unigram_loss']:.3f}; acceptance {ev['acceptance']['acceptance']:.3f}; "
        f"rho2 {r['rho2_layer_mean']:.3f} (random {r['random_pairing_layer_mean']:.3f}, "
        f"uniform {r['uniform_baseline']:.3f}); max expert share per layer "
        f"{fmt_list(r['max_expert_share_per_layer'])} (fair {r['fair_share']:.4f})"
    )


def train_and_evaluate(args: argparse.Namespace, staging: Path, command: str) -> dict:
    """The whole pipeline, writing ``target/`` and ``draft/`` under ``staging``; `command`:
    the command line that defines the run, for the log and the cards."""
    seconds: dict[str, float] = {}
    with phase("data", seconds):
        data = prepare_data(args.vocab_size, args.seq_len)
        hf_tok = wrap_tokenizer(data.tok)
    print(
        f"corpus {data.corpus.root}: {len(data.corpus.train)} train + "
        f"{len(data.corpus.held_out)} held-out files, {data.train_stream.numel():,} + "
        f"{data.held_stream.numel():,} tokens",
        flush=True,
    )
    # a fixed slice of held-out windows for the loss curve; the full set at the end
    stride = max(1, data.held_chunks.shape[0] // 32)
    curve_chunks = data.held_chunks[::stride][:32]
    records = {}
    for kind, config, spec in target_and_draft(args):
        with phase(f"train_{kind}", seconds):
            model = build_model(config, spec.seed)
            print(f"[{kind}] {sum(p.numel() for p in model.parameters()):,} parameters")
            log = train(model, data.train_chunks, spec, eval_chunks=curve_chunks, name=kind)
            save_checkpoint(model, hf_tok, staging / kind)
            records[kind] = model_record(model, spec, log, staging / kind)
    with phase("evaluate", seconds):
        ev = evaluate(staging, data, args.seed)
    info = {
        "command": command,
        "out": args.out.as_posix(),
        "seq_len": args.seq_len,
        "env": environment(),
        "data": data_record(data, args, staging / "target" / "tokenizer.json"),
        **records,
        "eval": ev,
        "seconds": seconds,
    }
    for kind, card in (("target", target_card), ("draft", draft_card)):
        (staging / kind / "README.md").write_text(card(info))
        info[kind]["files_sha256"]["README.md"] = file_sha256(staging / kind / "README.md")
    print(summary(ev), flush=True)
    return info
