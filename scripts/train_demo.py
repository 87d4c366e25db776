"""Train moespec's embedded demo models: a tiny Qwen3-MoE target and a dense Qwen3 draft.

Both models are trained from scratch on the running interpreter's own standard-library sources
(``*.py`` under ``sysconfig.get_paths()["stdlib"]``), so no download is needed, and share one
byte-level BPE tokenizer trained on the same text. Everything is seeded and the step counts
are fixed, so a rerun on the same machine and software writes byte-identical checkpoints.

Usage::

    python scripts/train_demo.py --out moespec/demo [--target-steps N] [--draft-steps N]
        [--seed S] [--force]

The output directory receives ``target/``, ``draft/`` (Hugging Face checkpoint folders with
bf16 ``model.safetensors``, tokenizer files and a model card) and ``training_log.json``. Other
files in it are left alone. The parts are plain functions so that
``tests/test_demo_training.py`` can import this file (via importlib) and rerun a few steps.
"""

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Idle OpenMP threads must sleep, not spin: on a shared 2-core machine a spinning thread steals
# the core its partner needs and a training step gets ~10x slower. libgomp reads this once, when
# torch loads it, so it has to be set before the first torch import; it does not change results.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import tokenizers  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    DynamicCache,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from moespec.demo.corpus import (  # noqa: E402  (the corpus definition moespec measures on)
    EXCLUDED_DIR_NAMES,
    HELD_OUT_MODULUS,
    is_held_out,
    list_corpus_files,
    stdlib_root,
)
from moespec.provenance import cpu_capability  # noqa: E402

# --- corpus -------------------------------------------------------------------------------

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class Document:
    """One source file: its path relative to the stdlib root (POSIX form) and its text."""

    path: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The stdlib corpus split into training and held-out documents, both in sorted order."""

    root: str
    train: tuple[Document, ...]
    held_out: tuple[Document, ...]
    fingerprint: str


def corpus_fingerprint(docs: Sequence[Document]) -> str:
    """sha256 over the sorted (path, content) pairs, length-prefixed so it cannot alias."""
    h = hashlib.sha256()
    for doc in sorted(docs, key=lambda d: d.path):
        for blob in (doc.path.encode("utf-8"), doc.text.encode("utf-8")):
            h.update(len(blob).to_bytes(8, "big"))
            h.update(blob)
    return h.hexdigest()


def build_corpus(root: Path | None = None) -> Corpus:
    """Read the corpus files (UTF-8, as the stdlib is) and split them train / held-out."""
    root = stdlib_root() if root is None else Path(root)
    docs = [
        Document(rel, (root / rel).read_text(encoding="utf-8")) for rel in list_corpus_files(root)
    ]
    return Corpus(
        root=str(root),
        train=tuple(d for d in docs if not is_held_out(d.path)),
        held_out=tuple(d for d in docs if is_held_out(d.path)),
        fingerprint=corpus_fingerprint(docs),
    )


# --- tokenizer ----------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int = 4096) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) with a single special token, id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # the full byte alphabet up front, so no input byte is ever unknown
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer saved with the checkpoints (EOS doubles as padding)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, model_max_length=1024
    )


def encode_documents(tok: Tokenizer, docs: Sequence[Document]) -> torch.Tensor:
    """One int64 token stream: each document's tokens followed by the EOS separator."""
    eos = tok.token_to_id(EOS_TOKEN)
    stream: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs]):
        stream.extend(enc.ids)
        stream.append(eos)
    return torch.tensor(stream, dtype=torch.long)


def chunk_stream(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len + 1`` tokens (inputs plus shifted labels).

    Consecutive windows share one token so every token is predicted once; the tail that does
    not fill a window is dropped.
    """
    n = (stream.numel() - 1) // seq_len
    return stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len).contiguous()


# --- models -------------------------------------------------------------------------------


def make_target_config(vocab_size: int = 4096, **overrides) -> Qwen3MoeConfig:
    """The demo target: 4 layers, hidden 256, 16 experts top-2 of width 256 (~14.4M params).

    ``router_aux_loss_coef`` is 0 because the balancing loss is our own per-layer one
    (``balance_loss``); transformers' pooled-across-layers loss would be counted twice.
    """
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        intermediate_size=768,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        router_aux_loss_coef=0.0,
        eos_token_id=0,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


def make_draft_config(vocab_size: int = 4096, **overrides) -> Qwen3Config:
    """The demo draft: dense, 2 layers, hidden 256, MLP 768 (~2.6M params)."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=0,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def build_model(config, seed: int) -> torch.nn.Module:
    """A freshly initialised fp32 model; the seed fixes the initial weights."""
    torch.manual_seed(seed)
    if config.model_type == "qwen3_moe":
        # grouped_mm is the fastest fp32 experts kernel on CPU (faster than bf16 here)
        return Qwen3MoeForCausalLM._from_config(config, experts_implementation="grouped_mm")
    return Qwen3ForCausalLM._from_config(config)


def parameter_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name, dtype, shape and raw bytes (tied ones once)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """Hex sha256 of one file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --- training -----------------------------------------------------------------------------


@dataclass
class TrainSpec:
    """Hyper-parameters of one training run; recorded in the log so a test can replay it."""

    steps: int
    batch_size: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    balance_coef: float = 0.05
    seed: int = 0
    log_every: int = 25
    eval_every: int = 100
    fingerprint_steps: tuple[int, ...] = (0, 5)


@dataclass
class TrainLog:
    """What ``train`` records: per-step losses, periodic held-out loss, fingerprints, time."""

    loss: list[float] = field(default_factory=list)
    balance: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    held_out: list[tuple[int, float]] = field(default_factory=list)
    fingerprints: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    tokens: int = 0


@contextlib.contextmanager
def deterministic_torch(threads: int = 2) -> Iterator[None]:
    """Fix the thread count and demand deterministic kernels; restore both on exit.

    The thread count matters: fp32 reductions split differently with more threads.
    """
    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_det)
        torch.set_num_threads(old_threads)


def lr_at(step: int, spec: TrainSpec) -> float:
    """Linear warmup to ``spec.lr`` then cosine decay to ``spec.lr * spec.min_lr_ratio``."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return spec.lr * (spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cosine)


def batch_indices(n_chunks: int, spec: TrainSpec) -> Iterator[torch.Tensor]:
    """Chunk indices per step: successive seeded permutations (epochs), cut into batches."""
    gen = torch.Generator().manual_seed(spec.seed)
    pending = torch.empty(0, dtype=torch.long)
    for _ in range(spec.steps):
        while pending.numel() < spec.batch_size:
            pending = torch.cat([pending, torch.randperm(n_chunks, generator=gen)])
        yield pending[: spec.batch_size]
        pending = pending[spec.batch_size :]


def balance_loss(router_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-style load balancing computed per layer, then averaged over layers.

    For each layer, N * sum_i f_i * P_i, where f_i is the share of the layer's top-k slots
    routed to expert i and P_i the mean router probability of expert i; 1.0 when balanced.
    Pooling counts across layers (as transformers does) lets one layer's hot expert hide
    behind another layer's cold one, so each layer is balanced on its own.
    """
    per_layer = []
    for logits in router_logits:
        probs = logits.float().softmax(dim=-1)
        n_experts = probs.shape[-1]
        chosen = probs.topk(top_k, dim=-1).indices.reshape(-1)
        share = torch.bincount(chosen, minlength=n_experts).float() / chosen.numel()
        per_layer.append(n_experts * (share * probs.mean(dim=0)).sum())
    return torch.stack(per_layer).mean()


def lm_loss(model: torch.nn.Module, chunk: torch.Tensor, with_router: bool):
    """Mean next-token cross-entropy of a batch of windows, plus router logits if asked."""
    kwargs = {"output_router_logits": True} if with_router else {}
    out = model(input_ids=chunk[:, :-1], use_cache=False, **kwargs)
    logits = out.logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
    return ce, (out.router_logits if with_router else None)


@torch.no_grad()
def mean_loss(model: torch.nn.Module, chunks: torch.Tensor, batch_size: int = 8) -> float:
    """Token-weighted mean cross-entropy over equal-length windows (nats/token)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, chunks.shape[0], batch_size):
        batch = chunks[start : start + batch_size]
        ce, _ = lm_loss(model, batch, with_router=False)
        total += ce.item() * batch.shape[0]
    model.train(was_training)
    return total / chunks.shape[0]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay the matrices (incl. 3D expert weights), not the norm gains."""
    decay = [p for _, p in sorted(model.named_parameters()) if p.ndim >= 2]
    no_decay = [p for _, p in sorted(model.named_parameters()) if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def train(
    model: torch.nn.Module,
    chunks: torch.Tensor,
    spec: TrainSpec,
    eval_chunks: torch.Tensor | None = None,
    stop_after: int | None = None,
    echo: Callable[[str], None] | None = print,
    name: str = "model",
) -> TrainLog:
    """AdamW over seeded batches of ``chunks``; returns the loss curves and fingerprints.

    ``stop_after`` ends the run early without changing anything about the steps it does run
    (the schedule still spans ``spec.steps``), which is how the test replays the first steps.
    Fingerprints are taken *after* ``k`` optimizer steps for each ``k`` in
    ``spec.fingerprint_steps`` (0 = the initial weights).
    """
    is_moe = getattr(model.config, "num_experts", 0) > 0
    top_k = getattr(model.config, "num_experts_per_tok", 0)
    opt = torch.optim.AdamW(
        param_groups(model, spec.weight_decay), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8
    )
    log = TrainLog()
    model.train()
    start = time.perf_counter()
    last_steps = stop_after if stop_after is not None else spec.steps
    for step, idx in enumerate(batch_indices(chunks.shape[0], spec)):
        if step in spec.fingerprint_steps:
            log.fingerprints[f"step_{step}"] = parameter_fingerprint(model)
        if step >= last_steps:
            break
        lr = lr_at(step, spec)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = chunks[idx]
        ce, router_logits = lm_loss(model, batch, with_router=is_moe)
        bal = balance_loss(router_logits, top_k) if is_moe else torch.zeros(())
        (ce + spec.balance_coef * bal).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.loss.append(round(ce.item(), 5))
        log.balance.append(round(bal.item(), 5))
        log.lr.append(lr)
        log.tokens += batch[:, :-1].numel()
        done = step + 1
        if eval_chunks is not None and (done % spec.eval_every == 0 or done == spec.steps):
            log.held_out.append((done, round(mean_loss(model, eval_chunks), 5)))
        if echo and (done % spec.log_every == 0 or done == last_steps):
            elapsed = time.perf_counter() - start
            recent = log.loss[-spec.log_every :]
            held = f" held-out {log.held_out[-1][1]:.3f}" if log.held_out else ""
            echo(
                f"[{name}] step {done}/{spec.steps} loss {sum(recent) / len(recent):.3f} "
                f"bal {bal.item():.3f} lr {lr:.2e}{held} "
                f"{log.tokens / elapsed:,.0f} tok/s {elapsed:.0f}s"
            )
    else:
        if spec.steps in spec.fingerprint_steps:
            log.fingerprints[f"step_{spec.steps}"] = parameter_fingerprint(model)
    log.seconds = time.perf_counter() - start
    return log


# --- saving -------------------------------------------------------------------------------


def save_checkpoint(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Write a bf16 Hugging Face checkpoint folder (weights, config, generation config,
    tokenizer). The experts are written per expert (``mlp.experts.E.gate_proj.weight`` ...),
    transformers 5's default layout, and safetensors metadata is only ``{"format": "pt"}``."""
    shipped = copy.deepcopy(model).to(torch.bfloat16)
    shipped.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors arrive 0600 from transformers' temp-file write


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into ``out``."""
    tokenizer.save_pretrained(out)
    set_tokenizer_class(out / "tokenizer_config.json")


def set_tokenizer_class(path: Path) -> None:
    """Name the class ``PreTrainedTokenizerFast``: transformers 5 writes its new backend name,
    which transformers 4 cannot load; the old name loads the same tokenizer.json in both."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_shipped(path: Path) -> torch.nn.Module:
    """Load a saved checkpoint for evaluation: bf16-rounded weights, computed in fp32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


# --- evaluation ---------------------------------------------------------------------------


def unigram_loss(train_stream: torch.Tensor, chunks: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of the windows' label tokens under the training unigram distribution,
    with add-one smoothing so unseen tokens have finite cost (nats/token)."""
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    logp = counts.log() - counts.sum().log()
    return float(-logp[chunks[:, 1:].reshape(-1)].mean())


@torch.no_grad()
def routing_top_k(model: torch.nn.Module, chunks: torch.Tensor, batch_size: int = 8):
    """Each layer's top-k expert ids for every input token of ``chunks``.

    Returns a tensor (layers, windows, seq_len, k) and the held-out loss of the same pass.
    """
    k = model.config.num_experts_per_tok
    per_batch, total = [], 0.0
    for start in range(0, chunks.shape[0], batch_size):
        batch = chunks[start : start + batch_size]
        ce, router_logits = lm_loss(model, batch, with_router=True)
        total += ce.item() * batch.shape[0]
        b, t = batch.shape[0], batch.shape[1] - 1
        per_batch.append(
            torch.stack([r.topk(k, dim=-1).indices.view(b, t, k) for r in router_logits])
        )
    return torch.cat(per_batch, dim=1), total / chunks.shape[0]


def overlap_share(prev: torch.Tensor, cur: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Per pair, the share of ``cur``'s k experts that ``prev`` also selected."""
    prev_hot = F.one_hot(prev, n_experts).sum(dim=-2)  # (..., n_experts) membership of prev
    return prev_hot.gather(-1, cur).float().mean(dim=-1)


def expert_reuse(
    top: torch.Tensor, tokens: torch.Tensor, eos_id: int, n_experts: int, seed: int
) -> dict:
    """Next-token expert reuse rho(2) per layer with its two baselines and expert shares.

    ``top``: (layers, windows, T, k) routed experts of the input tokens ``tokens`` (windows, T).
    rho(2) averages, over consecutive pairs (t-1, t) inside one document (neither token is the
    EOS separator, which also keeps pairs from straddling files), the share of t's experts that
    t-1 also used. The random-pairing baseline applies the same estimator after shuffling the
    eligible tokens of each layer (a seeded permutation): it measures what expert popularity
    alone gives. The uniform baseline is k / N.
    """
    k = top.shape[-1]
    real = tokens != eos_id
    pair_ok = real[:, 1:] & real[:, :-1]
    gen = torch.Generator().manual_seed(seed)
    rho, shuffled, max_share, shares = [], [], [], []
    for layer in top:
        rho.append(float(overlap_share(layer[:, :-1], layer[:, 1:], n_experts)[pair_ok].mean()))
        flat = layer[real]  # (tokens, k), stream order
        perm = flat[torch.randperm(flat.shape[0], generator=gen)]
        shuffled.append(float(overlap_share(perm[:-1], perm[1:], n_experts).mean()))
        share = torch.bincount(flat.reshape(-1), minlength=n_experts).double() / flat.numel()
        shares.append([round(float(s), 5) for s in share])
        max_share.append(float(share.max()))
    return {
        "rho2_per_layer": rho,
        "rho2_layer_mean": sum(rho) / len(rho),
        "random_pairing_per_layer": shuffled,
        "random_pairing_layer_mean": sum(shuffled) / len(shuffled),
        "uniform_baseline": k / n_experts,
        "max_expert_share_per_layer": max_share,
        "fair_share": 1 / n_experts,
        "expert_shares_per_layer": shares,
        "pairs": int(pair_ok.sum()),
    }


def acceptance_prompts(
    tok: Tokenizer, docs: Sequence[Document], n_prompts: int, prompt_len: int
) -> torch.Tensor:
    """``n_prompts`` distinct equal-length prompts from the held-out files.

    Candidates are the non-overlapping ``prompt_len``-token windows of each file, except the
    first (file heads are mostly license text and docstrings); the prompts are evenly spaced
    over the candidates in file order, so every file contributes about in proportion to its size.
    """
    candidates = [
        ids[j : j + prompt_len]
        for ids in (enc.ids for enc in tok.encode_batch([d.text for d in docs]))
        for j in range(prompt_len, len(ids) - prompt_len + 1, prompt_len)
    ]
    if len(candidates) < n_prompts:
        raise ValueError(f"only {len(candidates)} held-out windows for {n_prompts} prompts")
    picks = [i * len(candidates) // n_prompts for i in range(n_prompts)]
    return torch.tensor([candidates[i] for i in picks])


@torch.no_grad()
def greedy_decode(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts with a KV cache (no EOS stop)."""
    cache = DynamicCache(config=model.config)
    seq, step_input = prompts, prompts
    for _ in range(new_tokens):
        logits = model(input_ids=step_input, cache=cache, use_cache=True).logits[:, -1]
        step_input = logits.argmax(dim=-1, keepdim=True)
        seq = torch.cat([seq, step_input], dim=1)
    return seq


@torch.no_grad()
def greedy_acceptance(
    target: torch.nn.Module, draft: torch.nn.Module, prompts: torch.Tensor, new_tokens: int
) -> dict:
    """Per-token agreement of the draft's greedy choice with the target's greedy output.

    The target greedily continues each prompt; then, for every generated position, the draft
    sees the same context (prompt + the target's tokens so far) and we count how often its
    argmax equals the target's token. That rate is the geometric acceptance ``a`` of greedy
    speculative decoding.
    """
    seq = greedy_decode(target, prompts, new_tokens)
    p = prompts.shape[1]
    draft_pick = draft(input_ids=seq[:, :-1], use_cache=False).logits[:, p - 1 :].argmax(dim=-1)
    agree = (draft_pick == seq[:, p:]).float()
    return {
        "acceptance": float(agree.mean()),
        "per_prompt": [round(float(a), 4) for a in agree.mean(dim=1)],
        "prompts": prompts.shape[0],
        "prompt_tokens": p,
        "new_tokens": new_tokens,
    }


# --- model cards --------------------------------------------------------------------------


def fmt_list(values: Sequence[float], digits: int = 3) -> str:
    """Comma-separated rounded numbers for the cards."""
    return ", ".join(f"{v:.{digits}f}" for v in values)


def card_common(info: dict) -> str:
    """Data, tokenizer and reproduction sections shared by both cards."""
    data, env = info["data"], info["env"]
    excluded = ", ".join(f"`{d}`" for d in sorted(EXCLUDED_DIR_NAMES))
    return f"""
## Data

The `*.py` files of the CPython {data["python_version"]} standard library
(`sysconfig.get_paths()["stdlib"]`), read as UTF-8 in sorted path order: {data["files"]} files,
{data["bytes"]:,} bytes. Excluded: every directory named {excluded} (third-party packages,
byte-code caches and the test suites such as `test/`, `idlelib/idle_test`, `lib2to3/tests`), and
the build-specific `config-3.X-*/` and `_sysconfigdata_*.py`. Files whose sha256(path) is 0 mod
{HELD_OUT_MODULUS} are held out: {data["held_out_files"]} files, {data["held_out_tokens"]:,} tokens
({data["train_tokens"]:,} training tokens). Corpus fingerprint `{data["corpus_sha256"]}`.

## Tokenizer

Byte-level BPE trained with `tokenizers` on the training files; vocabulary {data["vocab_size"]},
one special token `{EOS_TOKEN}` (id 0) that separates files and serves as EOS and padding.

## Reproduce

```
{info["command"]}
```

with `OUT` the folder to write (`moespec/demo` in the repository). Seeded and deterministic
({env["threads"]} threads, `torch.use_deterministic_algorithms(True)`):
the same software (torch {env["torch"]}, transformers {env["transformers"]}, tokenizers
{env["tokenizers"]}) on a CPU of the same kind ({env["cpu_capability"]}) rewrites these files
byte for byte. Loss curves and fingerprints are in `../training_log.json`.
"""


def card_training(record: dict, seq_len: int) -> str:
    """Training paragraph of a card."""
    spec, log = record["spec"], record["log"]
    return f"""
## Training

{spec["steps"]} AdamW steps (betas 0.9/0.95, weight decay {spec["weight_decay"]} on matrices) of
{spec["batch_size"]} windows x {seq_len} tokens ({log["tokens"]:,} training tokens seen), peak
learning rate {spec["lr"]:g} with {spec["warmup"]} warmup steps and cosine decay to
{spec["min_lr_ratio"]:g}x, gradient clipping {spec["grad_clip"]}, fp32 on CPU, seed
{spec["seed"]}. Final training loss (mean of the last {spec["log_every"]} steps)
{sum(log["loss"][-spec["log_every"] :]) / len(log["loss"][-spec["log_every"] :]):.3f}.
Weights saved in bf16.
"""


def routing_table(r: dict, n_experts: int) -> str:
    """Per-layer rho(2), baselines and largest expert share as a Markdown table."""
    rows = [
        "| layer | rho(2) | random pairing | uniform k/N | max expert share |",
        "|---|---|---|---|---|",
    ]
    for i, rho in enumerate(r["rho2_per_layer"]):
        top = r["max_expert_share_per_layer"][i]
        rows.append(
            f"| {i} | {rho:.3f} | {r['random_pairing_per_layer'][i]:.3f} | "
            f"{r['uniform_baseline']:.3f} | {top:.3f} ({top * n_experts:.2f}x fair) |"
        )
    return "\n".join(rows)


def acceptance_line(acc: dict) -> str:
    """How the acceptance was measured, for both cards."""
    return (
        f"per-token agreement of the draft's argmax with the target's greedy output given the "
        f"same context; {acc['prompts']} held-out prompts of {acc['prompt_tokens']} tokens, "
        f"{acc['new_tokens']} generated tokens each"
    )


def target_card(info: dict) -> str:
    """README.md of the target checkpoint, filled from measured numbers only."""
    rec, ev = info["target"], info["eval"]
    cfg, r = rec["config"], ev["routing"]
    n_experts, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    max_share = max(r["max_expert_share_per_layer"])
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [qwen3_moe, moe, demo]
---
# moespec demo target: tiny Qwen3-MoE

A {rec["params"] / 1e6:.2f}M-parameter `Qwen3MoeForCausalLM` trained from scratch on the Python
standard library and shipped with moespec, so that its MoE inference and speculative decoding
run end to end without downloads. It writes plausible-looking Python and nothing more. Its
draft model is `../draft`.

## Architecture

`qwen3_moe`: {cfg["num_hidden_layers"]} layers, hidden size {cfg["hidden_size"]},
{cfg["num_attention_heads"]} query / {cfg["num_key_value_heads"]} key-value heads of dimension
{cfg["head_dim"]}, every layer sparse with {n_experts} experts and top-{k} routing
(`norm_topk_prob=True`), expert intermediate size {cfg["moe_intermediate_size"]}, vocabulary
{cfg["vocab_size"]}, tied embeddings; bf16 weights, {rec["bytes"] / 1e6:.1f} MB. Experts are
stored per expert (`model.layers.L.mlp.experts.E.{{gate,up,down}}_proj.weight`).
{card_training(rec, info["seq_len"])}
Load balancing: our own Switch-style loss N * sum_i f_i * P_i, computed per layer and averaged
over layers, coefficient {rec["spec"]["balance_coef"]}. Transformers' auxiliary loss, which pools
counts over layers, is off (`router_aux_loss_coef=0`) so nothing is counted twice.

## Measured on the held-out files (these bf16 weights, fp32 compute)

- Held-out loss **{ev["target_loss"]:.3f} nats/token** vs a unigram baseline of
  {ev["unigram_loss"]:.3f} (training-split unigram, add-one smoothing), over
  {ev["held_out_windows"]} windows of {info["seq_len"]} tokens.
- Greedy acceptance of the draft **{ev["acceptance"]["acceptance"]:.3f}**
  ({acceptance_line(ev["acceptance"])}).
- Next-token expert reuse, layer mean **rho(2) = {r["rho2_layer_mean"]:.3f}**, vs
  {r["random_pairing_layer_mean"]:.3f} for tokens paired at random (this model's routing with the
  token order shuffled per layer: expert popularity alone) and {r["uniform_baseline"]:.3f} for
  uniform routing (k/N); over {r["pairs"]:,} consecutive token pairs within files.
- Largest share of a layer's top-{k} slots taken by one expert: {max_share:.3f}
  (fair share 1/N = {r["fair_share"]:.4f}, limit 3/N = {3 * r["fair_share"]:.4f}).

{routing_table(r, n_experts)}
{card_common(info)}"""


def draft_card(info: dict) -> str:
    """README.md of the draft checkpoint, filled from measured numbers only."""
    rec, ev = info["draft"], info["eval"]
    cfg = rec["config"]
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [qwen3, draft, speculative-decoding, demo]
---
# moespec demo draft: tiny dense Qwen3

A {rec["params"] / 1e6:.2f}M-parameter `Qwen3ForCausalLM`, the speculative-decoding draft for
moespec's demo target `../target`, trained on the same data with the same tokenizer.

## Architecture

`qwen3`: {cfg["num_hidden_layers"]} layers, hidden size {cfg["hidden_size"]},
{cfg["num_attention_heads"]} query / {cfg["num_key_value_heads"]} key-value heads of dimension
{cfg["head_dim"]}, MLP {cfg["intermediate_size"]}, vocabulary {cfg["vocab_size"]}, tied
embeddings; bf16 weights, {rec["bytes"] / 1e6:.1f} MB.
{card_training(rec, info["seq_len"])}
## Measured on the held-out files (these bf16 weights, fp32 compute)

- Held-out loss **{ev["draft_loss"]:.3f} nats/token** (target {ev["target_loss"]:.3f}, unigram
  baseline {ev["unigram_loss"]:.3f}).
- Greedy acceptance against the target **{ev["acceptance"]["acceptance"]:.3f}**
  ({acceptance_line(ev["acceptance"])}).
{card_common(info)}"""


# --- replay (for the determinism test) --------------------------------------------------


def replay(log: dict, steps: int) -> dict:
    """Redo the data preparation and the first ``steps`` training steps of a logged run.

    Returns the sha256 of the retrained tokenizer files and, per model, the parameter
    fingerprints taken on the way, to compare with those in ``log``. Run it in a fresh process
    (the test does) so that OMP_WAIT_POLICY above takes effect.
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


# --- driver -------------------------------------------------------------------------------

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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="e.g. moespec/demo")
    ap.add_argument("--target-steps", type=int, default=800)
    ap.add_argument("--draft-steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="replace existing outputs")
    return ap.parse_args(argv)


def command_line(args: argparse.Namespace) -> str:
    """The flags that define the run. The output folder is left as ``OUT``: it does not affect
    the result, and the cards must not depend on it."""
    return (
        "python scripts/train_demo.py --out OUT --target-steps "
        f"{args.target_steps} --draft-steps {args.draft_steps} --seed {args.seed}"
        f" --batch-size {args.batch_size} --seq-len {args.seq_len}"
        f" --vocab-size {args.vocab_size} --threads {args.threads}"
    )


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


def run(args: argparse.Namespace) -> dict:
    """Train, save and evaluate into a staging folder, then rename the outputs into place."""
    wall = time.perf_counter()
    out: Path = args.out
    clash = [n for n in OUTPUT_NAMES if (out / n).exists()]
    if clash and not args.force:
        sys.exit(f"refusing to overwrite {', '.join(str(out / n) for n in clash)}; use --force")
    out.mkdir(parents=True, exist_ok=True)
    # staged next to the outputs so the final renames stay on one filesystem
    staging = Path(tempfile.mkdtemp(prefix=".train_demo-", dir=out))
    (staging / ".gitignore").write_text("*\n")  # keep a half-written run out of `git add`
    try:
        info = train_and_evaluate(args, staging)
        info["wall_seconds"] = round(time.perf_counter() - wall, 1)
        (staging / "training_log.json").write_text(json.dumps(info, indent=1) + "\n")
        install_outputs(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote {', '.join(str(out / n) for n in OUTPUT_NAMES)} in {info['wall_seconds']}s")
    return info


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


def train_and_evaluate(args: argparse.Namespace, staging: Path) -> dict:
    """The whole pipeline, writing ``target/`` and ``draft/`` under ``staging``."""
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
        "command": command_line(args),
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


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: parse flags, then train under fixed threads and deterministic kernels."""
    args = parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    with deterministic_torch(args.threads):
        run(args)


if __name__ == "__main__":
    main()
