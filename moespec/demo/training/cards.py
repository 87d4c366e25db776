"""The model cards (README.md) of the target and the draft, from the training log."""

from collections.abc import Sequence

from moespec.demo.corpus import (  # the corpus definition moespec measures on
    EXCLUDED_DIR_NAMES,
    HELD_OUT_MODULUS,
)
from moespec.demo.training.corpus import EOS_TOKEN


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
